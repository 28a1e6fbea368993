"""`plan layouts`: enumerate through ParallelLayout.build, rank by fit / communication / headroom."""

from __future__ import annotations

from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.models.v41.comm import comm_volume
from megatron_s2.planning.layouts import enumerate_layouts, rank_layouts
from tests.planning.helpers import recipe


def test_enumeration_keeps_buildable_layouts_and_says_why_others_fail():
    r = recipe("training.global_batch_size=16")
    kept, rejected = enumerate_layouts(r, 8)
    assert kept and rejected
    for rr, layout in kept:
        assert layout.world_size == 8 and layout.tp * layout.pp * layout.cp * layout.dp == 8
    reasons = " | ".join(x.reason for x in rejected)
    assert "4 query heads not divisible by tp=8" in reasons  # tiny has 4 heads
    assert any(x.parallel.tp == 8 for x in rejected)
    assert not any(layout.tp == 8 for _, layout in kept)


def test_ranking_puts_fitting_layouts_first_then_less_communication():
    r = recipe("training.global_batch_size=16")
    unlimited, _ = rank_layouts(r, 4)
    assert all(c.fits and c.headroom is None for c in unlimited)
    memories = sorted(c.memory for c in unlimited)
    limit = memories[len(memories) // 2] / 1024 ** 3  # half of the layouts fit
    ranked, _ = rank_layouts(r, 4, gpu_mem_gb=limit)
    fits = [c.fits for c in ranked]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    fitting = [c for c in ranked if c.fits]
    assert [c.comm for c in fitting] == sorted(c.comm for c in fitting)
    assert all(c.headroom == c.gpu_mem - c.memory for c in ranked)
    assert fitting[0].memory <= limit * 1024 ** 3


def test_impossible_cluster_has_no_layout():
    r = recipe("training.global_batch_size=16")
    ranked, rejected = rank_layouts(r, 3)  # 8 layers, 4 heads, 16 sequences: nothing splits over 3
    assert ranked == [] and rejected
    assert any("do not split evenly" in x.reason or "not a multiple" in x.reason for x in rejected)


def test_communication_grows_with_the_dimensions_that_communicate():
    r = recipe("training.global_batch_size=16")
    base = comm_volume(r, ParallelLayout.from_recipe(r, 1), 0, grad_bytes=1e6)
    assert base.total == 0  # one rank: nothing leaves it
    for overrides, kind in ((["parallel.tp=2"], "tp"), (["parallel.ep=2"], "ep"), (["parallel.pp=2"], "pp"),
                            (["parallel.cp=2"], "cp"), ([], "dp")):
        rr = recipe("training.global_batch_size=16", *overrides)
        vol = comm_volume(rr, ParallelLayout.from_recipe(rr, 2), 0, grad_bytes=1e6)
        assert vol.parts.get(kind, 0) > 0, (overrides, vol.parts)
