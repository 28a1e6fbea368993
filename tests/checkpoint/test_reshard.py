"""A checkpoint saved at TP2 x PP2 continues identically at other layouts (4 CPU ranks).

The source run (TP2 x PP2, cut after layer 4 with shadow payloads, so that pipeline rank 1
holds shadow replicas of layer 4's indexer) trains 3 steps and saves after step 2. Each
target layout is a fresh Trainer that loads that checkpoint (``checkpoint.load``) and trains
step 3; its step-3 loss and its parameters after step 3 must match the uninterrupted source
run's: the loss within 1e-5 relative, the parameters within the parity tolerances of
tests/parallel/test_parity_2rank.py (mHC coefficient predictors looser; see MHC_COEFFICIENTS)
— which holds only if the optimiser state (Muon / Sinkhorn momenta, Adam moments and step
counts), the data position and the MoE bias buffers were all carried over.

Targets: PP4 (through the offline ``megatron-s2 checkpoint reshard`` command), TP1 x DP4,
EP2 with engram-parallel 2 and ZeRO-1, TP2 x PP2 with virtual stages, and CP2 x EP2 x ETP2.
A control run loads the checkpoint at TP1 x DP4 but drops the optimiser state before step 3
and must *fail* the parameter comparison, showing that the comparison sees optimiser state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_s2.checkpoint.dcp_io import read_index
from tests.checkpoint.runs import (
    buffers,
    load_records,
    opt_state_names,
    save_record,
    shards,
    train,
    trainer,
)
from tests.parallel.parity import MHC_COEFFICIENTS, TOLERANCES, assemble, assert_close
from tests.parallel.spawn import run_distributed

# every test reads the module's trained runs (spawned ranks): the whole module is slow
pytestmark = pytest.mark.slow

SOURCE = ["parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layers=[5,3]",
          "parallel.payload_index_k=shadow", "parallel.payload_candidates=shadow"]
TARGETS = {
    "pp4_offline": ["parallel.pp=4"],
    "tp1_dp4": [],
    "ep2_engram2_zero1": ["parallel.ep=2", "parallel.engram_parallel=2", "parallel.distributed_optimizer=true"],
    "tp2_pp2_vpp2": ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"],
    "cp2_ep2_etp2": ["parallel.cp=2", "parallel.ep=2", "parallel.etp=2"],
}
CONTROL = "tp1_dp4_optimizer_state_dropped"
LOSS_RTOL = 1e-5
PARAM_RTOL, MHC_PARAM_RTOL = TOLERANCES["param_rtol"], TOLERANCES["mhc_param_rtol"]


def _source(rank: int, world: int, root: str) -> None:
    run = train(rank, world, Path(root) / "source", [*SOURCE, "training.train_steps=3", "checkpoint.save_interval=2"])
    t = run["trainer"]
    save_record(Path(root) / "source", rank, {
        "losses": run["losses"], "params": shards(t), "buffers": buffers(t), "opt_state": opt_state_names(t),
        "replicas": sorted(f"{k[0]}:{k[1]}" for k in t.pipeline.payloads.shadows.replicas)})


def _targets(rank: int, world: int, root: str) -> None:
    root = Path(root)
    for name, overrides in TARGETS.items():
        source = root / ("resharded" if name == "pp4_offline" else "source/checkpoints")
        run = train(rank, world, root / name, [*overrides, "training.train_steps=3", f"checkpoint.load={source}"])
        t = run["trainer"]
        save_record(root / name, rank, {"losses": run["losses"], "params": shards(t), "buffers": buffers(t),
                                        "opt_state": opt_state_names(t), "logs": run["logs"]})
    t = trainer(rank, world, root / CONTROL, ["training.train_steps=3", f"checkpoint.load={root}/source/checkpoints"])
    t.restore()
    for opt in t.optimizer.optimizers.values():
        opt.state.clear()
    out = t.train_step()
    save_record(root / CONTROL, rank, {"losses": [out["loss"]], "params": shards(t)})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_s2.cli import main

    root = tmp_path_factory.mktemp("reshard")
    run_distributed(4, _source, str(root))
    code = main(["checkpoint", "reshard", str(root / "source" / "checkpoints"), str(root / "resharded"),
                 "parallel.tp=1", "parallel.pp=4", "parallel.pipeline_layers=[]"])
    assert code == 0
    run_distributed(4, _targets, str(root))
    return root, load_records(root / "source", 4)


@pytest.mark.slow
def test_source_checkpoint_holds_owners_only(results):
    root, source = results
    assert any(rec["replicas"] for rec in source), "the source layout must exercise shadow replicas"
    keys = set(read_index(root / "source" / "checkpoints" / "step_00000002").state_dict_metadata)
    model_keys = {k[len("model/"):] for k in keys if k.startswith("model/")}
    assert model_keys == set(assemble(source, "params")) | {
        n for rec in source for n in rec["buffers"]}  # every owner parameter, nothing else
    optim_params = {k.split("/")[2] for k in keys if k.startswith("optim/")}
    assert optim_params == set().union(*(rec["opt_state"] for rec in source))


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_next_step_matches_uninterrupted_run(results, target):
    root, source = results
    records = load_records(root / target, 4)
    ref_loss = source[0]["losses"][2]
    for rec in records:
        assert len(rec["losses"]) == 1, "the target must resume at step 2 and train exactly step 3"
        assert rec["losses"][0] == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert_close(assemble(records, "params"), assemble(source, "params"), f"{target} parameters after step 3",
                 PARAM_RTOL, loose=(MHC_COEFFICIENTS, MHC_PARAM_RTOL))
    ref_buffers = {n: b for rec in source for n, b in rec["buffers"].items()}  # pipeline ranks hold some
    assert {n for rec in records for n in rec["buffers"]} == set(ref_buffers)
    for rec in records:
        for name, value in rec["buffers"].items():
            assert (value - ref_buffers[name]).abs().max() <= 1e-6, f"{target}: buffer {name}"
    assert set().union(*(rec["opt_state"] for rec in records)) == set().union(*(r["opt_state"] for r in source))
    assert any("reseeded" in line for line in records[0]["logs"]), "a changed layout reseeds, saying so"


def test_zero1_target_reads_owned_state_only(results):
    root, _ = results
    records = load_records(root / "ep2_engram2_zero1", 4)
    per_rank = [set(rec["opt_state"]) for rec in records]
    union = set().union(*per_rank)
    assert all(names and names < union for names in per_rank)


def test_dropping_optimizer_state_is_detected(results):
    root, source = results
    records = load_records(root / CONTROL, 4)
    assert records[0]["losses"][0] == pytest.approx(source[0]["losses"][2], rel=LOSS_RTOL)  # same weights and data
    with pytest.raises(AssertionError, match="parameters after step 3"):
        assert_close(assemble(records, "params"), assemble(source, "params"), "control parameters after step 3",
                     PARAM_RTOL, loose=(MHC_COEFFICIENTS, MHC_PARAM_RTOL))
