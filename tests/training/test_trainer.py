"""Trainer on one process: falling loss, bit-identical resume, metrics files, safe checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import CheckpointStore, verify_checkpoint
from megatron_s2.config.recipe import load_recipe
from megatron_s2.training.trainer import Trainer

# one intra-op thread for these in-process runs (tests/conftest.py): tiny models, 2 shared cores
# (24 steps with two threads took 496 s at load 6; one thread ~34 s)
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
FAST = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32", "training.global_batch_size=4", "training.micro_batch_size=2",
        "data.num_documents=2000", "logging.progress_bar=false", "logging.log_interval=100",
        "schedule.warmup_steps=2", "schedule.decay_start_step=1000", "schedule.decay_end_step=2000"]


def _train(run_dir: Path, steps: int, *extra: str) -> Trainer:
    recipe = load_recipe(RECIPE, [*FAST, f"training.train_steps={steps}", f"training.run_dir={run_dir}", *extra])
    trainer = Trainer(recipe, run_dir)
    trainer.result = trainer.train()
    return trainer


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
    straight = _train(tmp_path / "a", 4, "checkpoint.save_interval=0")
    first = _train(tmp_path / "b", 2, "checkpoint.save_interval=0")
    resumed = _train(tmp_path / "b", 4, "checkpoint.save_interval=0")
    assert resumed.result.steps_run == 2
    assert first.result.losses + resumed.result.losses == straight.result.losses  # exact float equality
    assert first.result.fingerprints + resumed.result.fingerprints == straight.result.fingerprints
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_loss_falls_and_metrics_are_written(tmp_path):
    run = tmp_path / "run"
    # 16 steps: the mean of the last 4 losses sits 0.55 below the first 4's (24 steps: 0.80; 12: 0.36)
    trainer = _train(run, 16, "schedule.lr=3e-3")
    losses = trainer.result.losses
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 17))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "model_tflops"):
        assert key in records[0]
    assert (run / "config.yaml").is_file() and (run / "FINISHED").is_file()
    # The resolved config alone reproduces the run's recipe.
    again = load_recipe(run / "config.yaml")
    assert again == trainer.recipe
    # TensorBoard events read back.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tb_losses = [e.value for e in acc.Scalars("train/loss")]
    assert tb_losses == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_uncommitted_latest_falls_back(tmp_path):
    run = tmp_path / "run"
    _train(run, 2, "checkpoint.save_interval=1", "checkpoint.keep_last=5")
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    (root / "step_00000002" / "COMMITTED").unlink()  # as if the process died before the commit
    messages = []
    store = CheckpointStore(root, log=messages.append)
    assert store.latest_valid() == root / "step_00000001"
    assert any("latest' points at step_00000002, which is not valid" in m for m in messages)
    # A flipped byte is detected and named.
    shard = root / "step_00000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match="__0_0.distcp: checksum mismatch"):
        verify_checkpoint(root / "step_00000001")


def test_sft_phase_masks_prompt_tokens(tmp_path):
    trainer = _train(tmp_path / "sft", 1, "phase.kind=sft")
    batch = trainer.data.next_step()[0]
    assert 0 < batch["loss_mask"].mean() < 1


def test_the_model_is_built_once_per_start(tmp_path, monkeypatch):
    """Issue 19: the start-up memory plan counts the meta model that then gets real storage in
    place — the family builds the model once per start, not a meta copy and then the real one."""
    from megatron_s2.models.family import family_of

    recipe = load_recipe(RECIPE, [*FAST, "training.train_steps=1", f"training.run_dir={tmp_path / 'run'}"])
    family = type(family_of(recipe.model))
    built = []
    original = family.build_model

    def counting(self, *args, **kwargs):
        built.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(family, "build_model", counting)
    trainer = Trainer(recipe, tmp_path / "run")
    assert len(built) == 1
    assert all(not p.is_meta for p in trainer.model.parameters())
