"""Pipeline / context / tensor combinations on 4 CPU ranks against the single-rank run:
PP4 (cuts at 2, 4, 6: inside the encoder's Full->Reuse group, between encoder and decoder,
inside the decoder's group), PP4 with an uneven explicit split, CP2 x PP2, TP2 x PP2 with
shadow replicas. Tolerances as in test_parity_2rank.py."""

from __future__ import annotations

import pytest

from tests.parallel.parity import TOLERANCES, check_against_reference, load_records, run_layouts

LAYOUTS = {
    "pp4": ["parallel.pp=4"],
    "pp4_uneven": ["parallel.pp=4", "parallel.pipeline_layers=[1,2,2,3]"],
    "cp2_pp2": ["parallel.cp=2", "parallel.pp=2"],
    "tp2_pp2_shadow": ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layers=[5,3]",
                       "parallel.payload_index_k=shadow", "parallel.payload_candidates=shadow"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("pipeline4"), 4, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(results, layout):
    root, ref = results
    check_against_reference(load_records(root / layout, 4), ref, layout, **TOLERANCES)
