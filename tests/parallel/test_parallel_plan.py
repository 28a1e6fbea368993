"""The V4.1 parallel plan: one typed placement per parameter, checked against what modules allocate.

Models are built with process-group handles of the right sizes but no processes (construction
communicates nothing), so every layout's placements are checked in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_s2.config.recipe import load_recipe
from megatron_s2.models.v41.model import V41Model
from megatron_s2.models.v41.parallel_plan import PLAN, Rule, apply_plan, describe_plan
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.placement import Replicas, Style, mark_param, placement_of
from megatron_s2.parallel.grad_finalize import reduction_group, replication
from tests.parallel.parity import BASE, RECIPE


def _group(size: int, rank: int = 0) -> Group:
    return Group(size=size, rank=rank, ranks=tuple(range(size)))


def _model(**sizes) -> tuple[V41Model, ParallelGroups]:
    cfg = load_recipe(RECIPE, BASE).model
    sp = sizes.pop("sp", False)
    groups = ParallelGroups(sequence_parallel=sp, **{k: _group(v) for k, v in sizes.items()})
    return V41Model(cfg, groups), groups


def _placements(model: nn.Module) -> dict:
    return {n: placement_of(p) for n, p in model.named_parameters()}


def test_every_parameter_is_planned_and_tensor_parallelism_is_where_the_plan_says():
    model, _ = _model(tp=2, stage=4, dp_cp=2)
    placed = _placements(model)
    assert all(p.planned for p in placed.values())
    a = "layers.1.attention"
    cfg = model.config
    assert placed[f"{a}.linear_q_up.weight"].style is Style.COLUMN
    assert placed[f"{a}.linear_q_up.weight"].head_split == cfg.num_attention_heads // 2
    assert placed[f"{a}.linear_out_a"].head_split == cfg.o_groups // 2
    assert placed[f"{a}.indexer.linear_q.weight"].head_split == cfg.index_num_heads // 2
    assert placed[f"{a}.linear_out_b.weight"].style is Style.ROW
    # latents and the router: tp-partial with tp > 1, with or without SP
    for name in (f"{a}.linear_q_down.weight", f"{a}.compressor.linear_kv.weight", f"{a}.index_key.norm.weight",
                 f"{a}.indexer.linear_weights.weight", "layers.1.mlp.router.weight"):
        assert placed[name].tp_partial and placed[name].style is Style.REPLICATED, name
    # stream-side parameters are tp-partial only under SP
    for name in ("layers.1.attn_norm.weight", "layers.1.attn_hc.fn", "layers.1.engram.q_weight", "final_norm.weight"):
        assert not placed[name].tp_partial, name
    sp_placed = _placements(_model(tp=2, sp=True)[0])
    for name in ("layers.1.attn_norm.weight", "layers.1.attn_hc.fn", "layers.1.engram.q_weight", "final_norm.weight",
                 "layers.1.engram.table.weight"):
        assert sp_placed[name].tp_partial, name
    assert not any(p.tp_partial for p in _placements(_model()[0]).values())


def test_experts_and_engram_tables_reduce_over_their_replicas():
    model, groups = _model(ep=2, etp=2, engram=2, stage=8, expert_dp=2, engram_replica=2, dp_cp=8)
    w2 = model.layers["1"].mlp.experts.w2
    assert placement_of(w2).style is Style.EXPERTS and placement_of(w2).shard.cut_dims == [0, 2]
    assert reduction_group(w2, groups) == ("expert_dp", groups.expert_dp) and replication(w2, groups) == 2
    table = model.layers["1"].engram.table.weight
    assert placement_of(table).replicas is Replicas.ENGRAM and placement_of(table).style is Style.ENGRAM_ROWS
    assert replication(table, groups) == 4
    norm = model.layers["1"].attn_norm.weight
    assert reduction_group(norm, groups)[0] == "dp_cp" and replication(norm, groups) == 8


def test_a_shard_that_contradicts_the_plan_is_an_error(monkeypatch):
    monkeypatch.setitem(PLAN["moe"], "shared_expert.w2", Rule(Style.COLUMN))  # the module cuts dim 1
    with pytest.raises(ValueError, match=r"'moe': 'shared_expert.w2' is planned column"):
        _model(tp=2)


def test_a_parameter_without_a_rule_is_an_error():
    class Extra(nn.Module):
        PLAN_SECTION = "block"

        def __init__(self):
            super().__init__()
            self.attn_norm = nn.Module()
            self.attn_norm.weight = mark_param(nn.Parameter(torch.ones(4)), (4,))
            self.new_scale = nn.Parameter(torch.ones(4))

    with pytest.raises(ValueError, match=r"no rule for 'new_scale'.*parallel_plan.py"):
        apply_plan(Extra())


def test_the_plan_reads_as_one_table():
    text = describe_plan()
    assert len(text.splitlines()) == 1 + sum(len(rules) for rules in PLAN.values())
    assert "attention  linear_q_up.weight" in text and "column" in text
