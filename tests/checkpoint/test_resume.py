"""Resume at the same layout is bit-identical: 2N steps straight == N steps + resume N steps.

On 2 CPU ranks (fp32), two ways in:

* ``tp2`` — save at the end of step 2, a new Trainer resumes from the run directory's
  ``latest`` (synchronous save, RNG states restored);
* ``dp2_zero1_async`` — ZeRO-1 with ``checkpoint.async_save``: the step-2 save is written
  by the background thread while step 3 trains; a new run is then initialised from that
  asynchronously written step directory (``checkpoint.load``) and trains steps 3-4.

Losses must be equal as floats and the token ids of every step (``batch_fingerprint``) equal;
parameters after the last step are compared bit for bit. The saved checkpoints are also
checked for duplication: every tensor's chunks in DCP's index cover it exactly once.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint.dcp_io import read_index
from tests.checkpoint.runs import (
    load_records,
    opt_state_names,
    save_record,
    shards,
    train,
)
from tests.parallel.spawn import run_distributed

# every test reads the module's trained runs (spawned ranks): the whole module is slow
pytestmark = pytest.mark.slow

N = 2
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "dp2_zero1_async": ["parallel.distributed_optimizer=true", "checkpoint.async_save=true"],
}


def _runs(rank: int, world: int, root: str) -> None:
    for name, overrides in LAYOUTS.items():
        out = Path(root) / name
        straight = train(rank, world, out / "straight", [*overrides, f"training.train_steps={2 * N}"])
        if "checkpoint.async_save=true" in overrides:
            # Step N is saved in the background while step N+1 trains; the end-of-run save waits for it.
            first = train(rank, world, out / "split", [*overrides, f"training.train_steps={N + 1}",
                                                       f"checkpoint.save_interval={N}", "checkpoint.save_at_end=true"])
            first_losses, first_prints = first["losses"][:N], first["fingerprints"][:N]
            source = out / "split" / "checkpoints" / f"step_{N:08d}"
            second = train(rank, world, out / "resumed", [*overrides, f"training.train_steps={2 * N}",
                                                          f"checkpoint.load={source}"])
        else:
            first = train(rank, world, out / "split", [*overrides, f"training.train_steps={N}",
                                                       "checkpoint.save_at_end=true"])
            first_losses, first_prints = first["losses"], first["fingerprints"]
            second = train(rank, world, out / "split", [*overrides, f"training.train_steps={2 * N}",
                                                        "checkpoint.resume=true"])
        save_record(out, rank, {
            "straight": straight["losses"], "straight_prints": straight["fingerprints"],
            "split": first_losses + second["losses"], "split_prints": first_prints + second["fingerprints"],
            "first_extra": first["losses"][N:], "resumed_steps": second["final_step"] - N,
            "logs": second["logs"], "straight_params": shards(straight["trainer"]),
            "resumed_params": shards(second["trainer"]), "opt_state": opt_state_names(second["trainer"]),
            "straight_opt_state": opt_state_names(straight["trainer"]),
        })


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run_distributed(2, _runs, str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bit_identical(results, layout):
    records = load_records(results / layout, 2)
    for rank, rec in enumerate(records):
        assert rec["resumed_steps"] == N
        assert rec["split"] == rec["straight"], f"rank {rank}: losses differ after resume"  # exact floats
        assert rec["split_prints"] == rec["straight_prints"], f"rank {rank}: token order differs after resume"
        assert rec["first_extra"] == rec["straight"][N:N + len(rec["first_extra"])]
        for name, (_, _, value) in rec["straight_params"].items():
            assert torch.equal(rec["resumed_params"][name][2], value), f"rank {rank}: {name}"
        assert rec["opt_state"] == rec["straight_opt_state"]
    assert not any("reseeded" in line for line in records[0]["logs"]), "same layout must restore RNG states"
    assert any("checkpoint: resumed from" in line for line in records[0]["logs"])


@pytest.mark.slow
def test_zero1_state_is_split_between_owners(results):
    records = load_records(results / "dp2_zero1_async", 2)
    names = [set(rec["opt_state"]) for rec in records]
    assert names[0] and names[1] and not names[0] & names[1]  # each state restored on its owner only


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saved_tensors_are_stored_once(results, layout):
    step_dir = results / layout / "split" / "checkpoints" / f"step_{N:08d}"
    index = read_index(step_dir)
    for fqn, md in index.state_dict_metadata.items():
        stored = sum(math.prod(c.sizes) for c in md.chunks)
        assert stored == math.prod(md.size), f"{fqn}: {stored} elements stored for {math.prod(md.size)}"
    files = sorted(p.name for p in step_dir.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote (replicas balanced, not duplicated)
    keys = set(index.state_dict_metadata)
    assert {k.split("/")[1] for k in keys if k.startswith("rng/")} == {"00000", "00001"}
    assert not any("shadow" in k or "replica" in k for k in keys)
