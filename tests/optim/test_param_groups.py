"""Parameter-group rule table (report §2.5): default assignment, errors, start-up table."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.optimizer import OptimizerConfig, ParamGroupRule, default_param_group_rules
from megatron_s2.config.schema import ConfigError
from megatron_s2.optim import assign_param_groups, build_optimizer, describe_param_groups
from megatron_s2.parallel.sharding import mark_param
from tests.optim.optim_toy_model import set_head_split


def _assignment(model: torch.nn.Module, rules=None) -> dict[str, tuple[str, bool, float, int]]:
    rules = rules or default_param_group_rules()
    return {a.name: (a.rule.kind, a.rule.weight_decay, a.rule.lr_mult, a.head_split)
            for a in assign_param_groups(model, rules)}


def test_default_rules_assign_our_names(toy_model):
    got = _assignment(toy_model)
    layer = "decoder.layers.0."
    expected = {
        "embedding.word_embeddings.weight": ("sinkhorn", False, 1.0, 1),
        "output_layer.weight": ("sinkhorn", False, 1.0, 1),
        layer + "engram.table.weight": ("sinkhorn", False, 5.0, 1),
        layer + "engram.q_weight": ("adamw", False, 1.0, 1),
        layer + "engram.k_weight": ("adamw", False, 1.0, 1),
        layer + "engram.value_proj.weight": ("muon", True, 1.0, 1),
        layer + "input_layernorm.weight": ("adamw", True, 1.0, 1),
        layer + "self_attention.q_norm.weight": ("adamw", True, 1.0, 1),
        layer + "self_attention.indexer.k_norm.weight": ("adamw", True, 1.0, 1),
        layer + "self_attention.indexer.k_norm.bias": ("adamw", False, 1.0, 1),
        layer + "self_attention.attn_sink": ("adamw", False, 1.0, 1),
        layer + "self_attention.linear_proj.bias": ("adamw", False, 1.0, 1),
        layer + "hc.base": ("adamw", False, 1.0, 1),
        layer + "hc.scale": ("adamw", False, 1.0, 1),
        layer + "self_attention.linear_q_up.weight": ("muon_headwise", True, 1.0, 3),
        layer + "self_attention.indexer.linear_q.weight": ("muon_headwise", True, 1.0, 2),
        layer + "self_attention.linear_q_down.weight": ("muon", True, 1.0, 1),
        layer + "self_attention.linear_proj.weight": ("muon", True, 1.0, 1),
        layer + "experts.weight1": ("muon", True, 1.0, 1),
        "decoder.final_layernorm.weight": ("adamw", True, 1.0, 1),
    }
    for name, want in expected.items():
        assert got[name] == want, name
    assert len(got) == len(list(toy_model.parameters()))


def test_engram_lr_mult_flows_from_config(toy_model):
    got = _assignment(toy_model, OptimizerConfig(engram_lr_mult=3.0).rules)
    assert got["decoder.layers.0.engram.table.weight"][2] == 3.0


def test_unmatched_parameter_is_an_error_naming_it(toy_model):
    rules = (ParamGroupRule("*", "adamw", ndim="<=1"), ParamGroupRule("*.weight", "muon", ndim=">=2"))
    with pytest.raises(ConfigError, match=r"'decoder\.layers\.0\.hc\.base'.*matches no rule"):
        assign_param_groups(toy_model, rules)


def test_frozen_parameters_are_skipped(toy_model):
    toy_model.embedding.word_embeddings.weight.requires_grad_(False)
    got = _assignment(toy_model)
    assert "embedding.word_embeddings.weight" not in got
    # A frozen parameter needs no rule at all.
    toy_model.decoder.layers[0].hc.base.requires_grad_(False)
    toy_model.decoder.layers[1].hc.base.requires_grad_(False)
    rules = (ParamGroupRule("*", "adamw", ndim="<=1"), ParamGroupRule("*", "muon", ndim=">=2"))
    assert "decoder.layers.0.hc.base" not in _assignment(toy_model, rules)


def test_headwise_rule_requires_head_split_attribute(toy_model):
    set_head_split(toy_model.decoder.layers[1].self_attention.linear_q_up.weight, None)
    with pytest.raises(ConfigError, match=r"layers\.1\.self_attention\.linear_q_up\.weight.*head_split"):
        assign_param_groups(toy_model, default_param_group_rules())


def test_headwise_rows_must_divide(toy_model):
    set_head_split(toy_model.decoder.layers[0].self_attention.linear_q_up.weight, 5)
    with pytest.raises(ConfigError, match="12 rows, not divisible by head_split=5"):
        assign_param_groups(toy_model, default_param_group_rules())


def test_matrix_rule_on_a_vector_is_an_error(toy_model):
    rules = (ParamGroupRule("*", "muon"),)
    with pytest.raises(ConfigError, match="updates matrices"):
        assign_param_groups(toy_model, rules)


def test_describe_param_groups_table(toy_model):
    text = describe_param_groups(toy_model)
    lines = text.splitlines()
    rules = default_param_group_rules()
    assert len(lines) == 2 + len(rules) + 1  # title, header, one line per rule, total
    engram = next(line for line in lines if "*engram.table.weight" in line)
    assert engram.split() == ["2", "*engram.table.weight", "any", "sinkhorn", "no", "5", "1", "78"]
    catch_all = lines[2 + len(rules) - 1].split()
    assert catch_all[1:4] == ["*", ">=2", "muon"]
    total = lines[-1].split()
    numel = sum(p.numel() for p in toy_model.parameters())
    assert total[-2:] == [str(len(list(toy_model.parameters()))), f"{numel:,}"]


def test_sharded_matrix_is_rejected_but_expert_sharding_is_allowed(toy_model):
    experts = toy_model.decoder.layers[0].experts.weight1
    mark_param(experts, (8, 10, 12), splits=((0, 0, 2),))  # expert parallel: whole matrices
    build_optimizer(toy_model, OptimizerConfig())
    proj = toy_model.decoder.layers[0].self_attention.linear_proj.weight
    mark_param(proj, (12, 24), splits=((1, 0, 2),))  # tensor parallel: half a matrix
    with pytest.raises(ConfigError, match=r"linear_proj\.weight.*sharded along dim \[1\]"):
        build_optimizer(toy_model, OptimizerConfig())


def test_row_groups_must_name_sinkhorn_parameters(toy_model):
    with pytest.raises(ConfigError, match=r"row_groups names \['decoder\.final_layernorm\.weight'\]"):
        build_optimizer(toy_model, OptimizerConfig(), row_groups={"decoder.final_layernorm.weight": None})
    table = toy_model.decoder.layers[0].engram.table.weight
    mark_param(table, (26, 6), splits=((0, 0, 2),))  # engram-parallel row shard
    with pytest.raises(ConfigError, match=r"engram\.table\.weight' \(sinkhorn\).*row_groups"):
        build_optimizer(toy_model, OptimizerConfig())
    build_optimizer(toy_model, OptimizerConfig(), row_groups={"decoder.layers.0.engram.table.weight": None})
