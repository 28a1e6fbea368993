"""Non-finite losses and gradients: stop (or skip) before the update, never commit NaN.

Reproduced break: a run whose gradients turned NaN kept training, committed checkpoints full
of NaN that `checkpoint verify` passed, and `keep_last` rotation deleted the last good ones.
The divergence is injected with a gradient hook on one parameter (from a chosen step on), the
rest is the real trainer, checkpoint manager and CLI.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import CheckpointStore
from megatron_s2.checkpoint.offline import read_full_tensors
from megatron_s2.config.recipe import load_recipe
from megatron_s2.runtime.finite import NonFiniteStep
from megatron_s2.training.trainer import Trainer

# one intra-op thread for the in-process runs (tests/conftest.py): tiny models, 2 shared cores
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
FAST = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32", "training.global_batch_size=4",
        "training.micro_batch_size=2", "data.num_documents=300", "logging.progress_bar=false",
        "logging.tensorboard=false", "schedule.warmup_steps=2", "schedule.decay_start_step=1000",
        "schedule.decay_end_step=2000"]


def _trainer(run_dir: Path, steps: int, *extra: str, logs: list | None = None) -> Trainer:
    recipe = load_recipe(RECIPE, [*FAST, f"training.train_steps={steps}", f"training.run_dir={run_dir}", *extra])
    log = (lambda *a, **k: logs.append(" ".join(map(str, a)))) if logs is not None else (lambda *a, **k: None)
    return Trainer(recipe, run_dir, log=log)


def _poison(trainer: Trainer, steps: set[int]) -> None:
    """NaN gradients on one weight during the given optimiser steps (1-based)."""
    weight = trainer.model.output_layer.weight
    weight.register_hook(lambda g: g * math.nan if trainer.step + 1 in steps else g)


def _all_finite(step_dir: Path) -> bool:
    _, tensors = read_full_tensors(step_dir, ("model/", "optim/"))
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def test_diverging_run_stops_and_keeps_its_good_checkpoints(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(run, 6, "checkpoint.save_interval=1", "checkpoint.keep_last=2")
    _poison(trainer, set(range(3, 100)))
    with pytest.raises(NonFiniteStep, match=r"step 3: gradient norm nan .*training.non_finite=stop"):
        trainer.train()
    store = CheckpointStore(run / "checkpoints")
    assert [p.name for p in store.committed()] == ["step_00000001", "step_00000002"]
    assert store.latest_valid().name == "step_00000002"
    assert all(_all_finite(p) for p in store.committed())
    assert not (run / "FINISHED").exists()
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()), "the NaN update was applied"


@pytest.mark.slow
def test_skip_policy_drops_one_bad_step_and_trains_on(tmp_path):
    logs: list[str] = []
    trainer = _trainer(tmp_path / "run", 5, "training.non_finite=skip", "checkpoint.save_interval=0", logs=logs)
    _poison(trainer, {3})
    before: dict[str, torch.Tensor] = {}

    original = trainer.apply_gradients

    def spy(loss=None):
        if trainer.step == 2:  # the poisoned step: record the parameters it must leave alone
            before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        norm = original(loss)
        if trainer.step == 3:
            for n, p in trainer.model.named_parameters():
                assert torch.equal(p, before[n]), f"{n} changed during a skipped step"
        return norm

    trainer.apply_gradients = spy
    result = trainer.train()
    assert result.final_step == 5 and before
    assert any("step 3: gradient norm nan: update skipped" in line for line in logs)
    assert _all_finite(tmp_path / "run" / "checkpoints" / "step_00000005")
    assert (tmp_path / "run" / "FINISHED").exists()


def test_skip_policy_gives_up_after_the_limit(tmp_path):
    trainer = _trainer(tmp_path / "run", 8, "training.non_finite=skip", "training.non_finite_max_skips=2")
    _poison(trainer, set(range(2, 100)))
    with pytest.raises(NonFiniteStep, match=r"step 4: .*3 steps in a row"):
        trainer.train()
    assert trainer.step == 3  # steps 2 and 3 skipped (counted), step 4 stopped


def test_checkpoint_manager_never_commits_non_finite_state(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(run, 1, "checkpoint.save_interval=0")
    trainer.train()  # commits step 1
    with torch.no_grad():
        trainer.model.output_layer.weight[0, 0] = math.inf
    trainer.step = 2
    with pytest.raises(Exception, match=r"checkpoint step 2 not written: 'model/output_layer.weight' holds NaN"):
        trainer.save()
    store = CheckpointStore(run / "checkpoints")
    assert [p.name for p in store.committed()] == ["step_00000001"]
    assert store.latest_valid().name == "step_00000001"
