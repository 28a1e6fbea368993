"""Conversion from and to real multi-rank checkpoints (2 CPU ranks, gloo).

The trainer saves `tiny` under three layouts — TP2 with sequence parallelism, PP2 with two
virtual stages per rank, EP2 x engram-parallel 2 with ZeRO-1 — at step 0 and after one step,
and records the loss of the trained TP2 model on the first batch. Then, in this process:

* the step-0 checkpoints of all three read back (through the sharded core, whatever layout
  wrote them) as exactly the single-rank model's initial state;
* the trained TP2 checkpoint is exported (built-in verification: tensors bitwise, logits
  equal), imported for the PP2 x VPP2 layout (verification reads it as each of those ranks
  would) and for one rank, where the trainer loads it and computes the same loss on the same
  batch as the TP2 run (1e-6 relative, the parity bound of tests/parallel).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint.hf.checkpoint_io import read_back_as_layout, read_full_state
from megatron_s2.cli import main as cli_main
from tests.parallel.spawn import run_distributed
from tests.tiny_runs import tiny_trainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
BASE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32", "training.global_batch_size=4",
        "training.micro_batch_size=2", "data.num_documents=200", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.resume=false", "training.train_steps=1", "training.seed=5"]
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "ep2_engram2_zero1": ["parallel.ep=2", "parallel.engram_parallel=2", "parallel.distributed_optimizer=true"],
}


def _trainer(rank, world, overrides, run_dir):
    return tiny_trainer(rank, world, run_dir, overrides, base=BASE)


def _worker(rank, world, root):
    root = Path(root)
    for name, overrides in LAYOUTS.items():
        trainer = _trainer(rank, world, overrides, root / name)
        first_batch = trainer.data.state_dict()
        trainer.save()
        trainer.train()
        if name == "tp2_sp":  # the trained model's loss on the first batch
            trainer.data.load_state_dict(first_batch)
            torch.save(trainer.compute_gradients(trainer.data.next_step()).loss, root / f"loss_rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_layouts")
    run_distributed(2, _worker, str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_initial_checkpoints_read_as_the_single_rank_model(runs, layout):
    from megatron_s2.models.v41.model import build_model

    loaded = read_full_state(runs / layout / "checkpoints" / "step_00000000")
    assert loaded.world_size == 2
    reference = build_model(loaded.recipe.model, seed=5).state_dict()
    assert set(loaded.state) == set(reference)
    for name, t in reference.items():
        assert torch.equal(loaded.state[name], t), f"{layout}: {name}"


@pytest.mark.slow
def test_trained_checkpoint_converts_across_layouts(runs, tmp_path):
    trained = read_full_state(runs / "tp2_sp")
    assert trained.step == 1 and "tp=2+sp" in trained.layout
    assert cli_main(["checkpoint", "export", str(runs / "tp2_sp"), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert cli_main(["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "pp2"), "parallel.pp=2", "parallel.vpp=2",
                    "--no-progress"]) == 0
    imported = read_full_state(tmp_path / "pp2")
    assert "pp=2 vpp=2" in imported.layout and imported.world_size == 2
    as_pp2 = read_back_as_layout(tmp_path / "pp2", imported.recipe, 2)
    for name, t in trained.state.items():
        assert torch.equal(imported.state[name], t) and torch.equal(as_pp2[name], t), name
    # the same Hugging Face checkpoint on one rank: the trainer loads it, same loss as TP2
    assert cli_main(["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "one"), "--no-progress"]) == 0
    trainer = _trainer(0, 1, [f"checkpoint.load={tmp_path / 'one'}", "checkpoint.load_optimizer=false"],
                       tmp_path / "single")
    assert trainer.restore()
    single = trainer.compute_gradients(trainer.data.next_step()).loss
    for rank in range(2):
        assert torch.load(runs / f"loss_rank{rank}.pt") == pytest.approx(single, rel=1e-6)
