"""Engram prefetch inside the pipeline schedule against the single-rank run (4 CPU ranks).

PP2 x DP2 with engram-parallel 2: the Engram layers 1 and 5 sit on different stages, each
stage prefetches its own layer's rows for the step (report §3.1.3) over its data-parallel
peers and returns the row gradients after its last backward; PP2 x DP2 x ZeRO-1 adds the
reduce-scatter of gradients to owners under pipelining. Tolerances as in test_parity_2rank.py.
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import TOLERANCES, check_against_reference, load_records, run_layouts

LAYOUTS = {
    "pp2_dp2_engram2": ["parallel.pp=2", "parallel.engram_parallel=2"],
    "pp2_dp2_engram2_zero1": ["parallel.pp=2", "parallel.engram_parallel=2", "parallel.distributed_optimizer=true"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("pipeline_engram"), 4, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(results, layout):
    root, ref = results
    check_against_reference(load_records(root / layout, 4), ref, layout, **TOLERANCES)
