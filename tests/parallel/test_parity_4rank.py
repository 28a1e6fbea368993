"""Layouts on 4 CPU ranks against the single-rank run: EP4, ETP2xEP2, TP2xEP2xDP2.

Same data, seed and tolerances as test_parity_2rank.py (fp32).
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import TOLERANCES, check_against_reference, load_records, run_layouts

LAYOUTS = {
    "ep4": ["parallel.ep=4"],
    "etp2_ep2": ["parallel.etp=2", "parallel.ep=2"],
    "tp2_ep2_dp2": ["parallel.tp=2", "parallel.ep=2"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("parity4"), 4, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(results, layout):
    root, ref = results
    check_against_reference(load_records(root / layout, 4), ref, layout, **TOLERANCES)
