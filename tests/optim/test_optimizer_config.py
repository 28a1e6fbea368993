"""OptimizerConfig / ParamGroupRule: report defaults, recipe mapping, validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_s2.config.optimizer import OptimizerConfig, ParamGroupRule, ScheduleConfig, default_param_group_rules
from megatron_s2.config.schema import ConfigError, field_docs, from_mapping, to_mapping


def test_defaults_are_the_report_values():
    cfg = OptimizerConfig()
    assert (cfg.momentum, cfg.muon_weight_decay, cfg.muon_update_rms) == (0.95, 0.1, 0.18)
    assert (cfg.ns_steps, cfg.ns_polish_steps) == (8, 2)  # DeepSeek-V4 hybrid Newton-Schulz: 8 fast + 2 stabilising
    assert (cfg.sinkhorn_iters, cfg.sinkhorn_tau, cfg.sinkhorn_eps, cfg.sinkhorn_lr_scale) == (11, 1e-3, 1e-20, 0.18)
    assert (cfg.adamw_betas, cfg.adamw_eps, cfg.adamw_weight_decay) == ((0.9, 0.95), 1e-20, 0.1)
    assert (cfg.clip_grad, cfg.engram_lr_mult, cfg.nesterov) == (1.0, 5.0, True)
    assert cfg.rules == default_param_group_rules(5.0)


@pytest.mark.parametrize("cls", [OptimizerConfig, ScheduleConfig, ParamGroupRule])
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in dataclasses.fields(cls) if f.name not in docs] == []


def test_recipe_mapping_round_trip_with_rules():
    recipe = {
        "momentum": 0.9,
        "param_group_rules": [
            {"pattern": "*engram.table.weight", "kind": "sinkhorn", "lr_mult": 5},
            {"pattern": "*", "kind": "adamw", "ndim": "<=1"},
            {"pattern": "*", "kind": "muon", "weight_decay": True, "ndim": ">=2"},
        ],
    }
    cfg = from_mapping(OptimizerConfig, recipe)
    assert cfg.rules[0] == ParamGroupRule("*engram.table.weight", "sinkhorn", lr_mult=5.0)
    assert from_mapping(OptimizerConfig, to_mapping(cfg)) == cfg
    typo = {"param_group_rules": [{"pattern": "*", "kind": "adamw", "lr_multiplier": 2}]}
    with pytest.raises(ConfigError, match=r"'param_group_rules\[0\]\.lr_multiplier'; did you mean 'lr_mult'"):
        from_mapping(OptimizerConfig, typo)
    with pytest.raises(ConfigError, match="'sgd' is not one of"):
        from_mapping(OptimizerConfig, {"param_group_rules": [{"pattern": "*", "kind": "sgd"}]})


@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum=1.0), "momentum: must be in"),
    (dict(ns_steps=0), "ns_steps: Muon needs at least one"),
    (dict(ns_polish_steps=-1), "ns_polish_steps: must be non-negative"),
    (dict(sinkhorn_iters=0), "sinkhorn_iters"),
    (dict(sinkhorn_tau=1.0), "sinkhorn_tau"),
    (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
    (dict(clip_grad=-1.0), "clip_grad: must be non-negative"),
    (dict(engram_lr_mult=0.0), "engram_lr_mult: must be positive"),
    (dict(engram_lr_mult=4.0, param_group_rules=(ParamGroupRule("*", "adamw"),)),
     "engram_lr_mult: only shapes the default rule table"),
])
def test_optimizer_validation_names_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pattern="", kind="adamw"), "pattern: must be a non-empty"),
    (dict(pattern="*", kind="adamw", lr_mult=0.0), "lr_mult: must be positive"),
    (dict(pattern="*emb*", kind="sinkhorn", weight_decay=True), "weight_decay: the Sinkhorn-balanced update"),
    (dict(pattern="*", kind="muon", ndim="<=1"), "ndim: kind 'muon' updates matrices"),
])
def test_rule_validation_names_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParamGroupRule(**kwargs)
