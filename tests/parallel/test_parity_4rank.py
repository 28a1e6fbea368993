"""Layouts on 4 CPU ranks against the single-rank run: EP4, ETP2xEP2, TP2xEP2xDP2.

Same data, seed and tolerances as test_parity_2rank.py (fp32).
"""

from __future__ import annotations

import pytest

from tests.parallel.parity import MHC_COEFFICIENTS, assemble, assert_close, load_records, run_layout
from tests.parallel.spawn import run_distributed
from tests.parallel.test_parity_2rank import GRAD_FLOOR, GRAD_RTOL, MHC_PARAM_RTOL, PARAM_RTOL

LAYOUTS = {
    "ep4": ["parallel.ep=4"],
    "etp2_ep2": ["parallel.etp=2", "parallel.ep=2"],
    "tp2_ep2_dp2": ["parallel.tp=2", "parallel.ep=2"],
}


def _all_layouts(rank, world, root):
    from pathlib import Path

    for name, overrides in LAYOUTS.items():
        out = Path(root) / name
        out.mkdir(parents=True, exist_ok=True)
        run_layout(rank, world, overrides, str(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity4")
    ref_dir = root / "reference"
    ref_dir.mkdir()
    run_layout(0, 1, [], str(ref_dir))
    run_distributed(4, _all_layouts, str(root))
    return root, load_records(ref_dir, 1)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(results, layout):
    root, ref = results
    records = load_records(root / layout, 4)
    for rec in records:
        assert rec["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert rec["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert_close(assemble(records, "grads"), assemble([ref], "grads"), f"{layout} gradients", GRAD_RTOL,
                 floor=GRAD_FLOOR)
    assert_close(assemble(records, "params"), assemble([ref], "params"), f"{layout} parameters after 3 steps",
                 PARAM_RTOL, loose=(MHC_COEFFICIENTS, MHC_PARAM_RTOL))
    for name, value in ref["buffers"].items():
        for rec in records:
            assert (rec["buffers"][name] - value).abs().max() <= 1e-6, f"{layout}: buffer {name}"
