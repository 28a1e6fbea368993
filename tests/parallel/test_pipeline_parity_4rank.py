"""Pipeline / context / tensor combinations on 4 CPU ranks against the single-rank run:
PP4 (cuts at 2, 4, 6: inside the encoder's Full->Reuse group, between encoder and decoder,
inside the decoder's group), PP4 with an uneven explicit split, CP2 x PP2, TP2 x PP2 with
shadow replicas. Tolerances as in test_parity_2rank.py."""

from __future__ import annotations

import pytest

from tests.parallel.parity import MHC_COEFFICIENTS, assemble, assert_close, load_records, run_layout
from tests.parallel.spawn import run_distributed
from tests.parallel.test_parity_2rank import GRAD_FLOOR, GRAD_RTOL, MHC_PARAM_RTOL, PARAM_RTOL

LAYOUTS = {
    "pp4": ["parallel.pp=4"],
    "pp4_uneven": ["parallel.pp=4", "parallel.pipeline_layers=[1,2,2,3]"],
    "cp2_pp2": ["parallel.cp=2", "parallel.pp=2"],
    "tp2_pp2_shadow": ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layers=[5,3]",
                       "parallel.payload_index_k=shadow", "parallel.payload_candidates=shadow"],
}


def _all_layouts(rank, world, root):
    from pathlib import Path

    for name, overrides in LAYOUTS.items():
        out = Path(root) / name
        out.mkdir(parents=True, exist_ok=True)
        run_layout(rank, world, overrides, str(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline4")
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
        assert all(d == 0.0 for d in rec["shadow_divergence"])
    assert_close(assemble(records, "grads"), assemble([ref], "grads"), f"{layout} gradients", GRAD_RTOL,
                 floor=GRAD_FLOOR)
    assert_close(assemble(records, "params"), assemble([ref], "params"), f"{layout} parameters after 3 steps",
                 PARAM_RTOL, loose=(MHC_COEFFICIENTS, MHC_PARAM_RTOL))
