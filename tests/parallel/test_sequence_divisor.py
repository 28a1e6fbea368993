"""The sequence-length divisor is derived by the layout and checked wherever a recipe's layout is built.

Before: with tp > 1 and no sequence parallelism the layout accepted a sequence length that the
MoE layer (which routes a disjoint 1/tp of every context-parallel rank's tokens on each tp
rank) rejects only at the first forward. Now ``ParallelLayout.seq_len_divisor`` names the
multiple and ``ParallelLayout.from_recipe`` — shared by the trainer, ``train``'s start-up check,
the launcher's pre-flight and the planners — refuses such recipes with one line.
"""

from __future__ import annotations

import pytest

from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout
from tests.parallel.parity import BASE, RECIPE


def _layout(world: int, **sizes) -> ParallelLayout:
    recipe = load_recipe(RECIPE, BASE)
    return ParallelLayout.build(ParallelConfig(**sizes), recipe.model, world)


@pytest.mark.parametrize("sizes, world, divisor", [
    ({}, 1, 1),
    (dict(tp=2), 2, 2),
    (dict(tp=2, sequence_parallel=True), 2, 2),
    (dict(cp=2), 2, 4),
    (dict(tp=2, cp=2), 4, 4),
    (dict(tp=2, cp=4), 8, 8),
    (dict(tp=2, cp=2, sequence_parallel=True), 4, 8),
    (dict(tp=2, cp=3), 6, 6),
])
def test_divisor_is_derived_from_the_sizes(sizes, world, divisor):
    assert _layout(world, **sizes).seq_len_divisor == divisor


def test_tensor_parallel_without_sp_checks_the_moe_split():
    recipe = load_recipe(RECIPE, [*BASE, "parallel.tp=2", "training.seq_length=33"])
    with pytest.raises(ConfigError, match=r"training\.seq_length: 33 is not divisible by tp\*cp = 2 .*MoE.*"
                                          r"use a multiple of 2"):
        ParallelLayout.from_recipe(recipe, 2)
    assert ParallelLayout.from_recipe(load_recipe(RECIPE, [*BASE, "parallel.tp=2", "training.seq_length=34"]), 2).tp == 2


def test_launch_preflight_runs_the_same_check():
    from megatron_s2.launcher.preflight import plan_launch

    recipe = load_recipe(RECIPE, [*BASE, "parallel.tp=2", "parallel.dp=1", "training.seq_length=33"])
    with pytest.raises(ConfigError, match=r"training\.seq_length: 33 is not divisible by tp\*cp = 2"):
        plan_launch(recipe, local=True, visible_gpus=0)


def test_weight_tools_skip_the_batch_geometry():
    recipe = load_recipe(RECIPE, [*BASE, "parallel.tp=2", "training.seq_length=33"])
    assert ParallelLayout.from_recipe(recipe, 2, batch=False).seq_len_divisor == 2
