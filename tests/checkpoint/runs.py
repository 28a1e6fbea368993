"""Training runs the checkpoint tests start, in this process or in spawned ranks.

Every run is the real :class:`~megatron_s2.training.trainer.Trainer` on the tiny recipe with
the parity overrides of :mod:`tests.parallel.parity` (``BASE``), so that losses and parameters
can be compared across layouts with the parity tolerances. Records travel back to the test
through ``rank<N>.pt`` files (written with ``torch.save``, read by the test that wrote them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.parallel.parity import BASE, _shards
from tests.tiny_runs import tiny_recipe, tiny_train, tiny_trainer

__all__ = ["opt_state_names", "recipe", "save_record", "shards", "train", "trainer"]


def recipe(run_dir: Path, overrides: list[str]):
    return tiny_recipe(overrides, base=BASE, run_dir=run_dir)


def trainer(rank: int, world: int, run_dir: Path, overrides: list[str], logs: list | None = None):
    return tiny_trainer(rank, world, run_dir, overrides, base=BASE, logs=logs)


def train(rank: int, world: int, run_dir: Path, overrides: list[str]) -> dict:
    """Run ``Trainer.train()`` (:func:`tests.tiny_runs.tiny_train` with the parity overrides)."""
    return tiny_train(rank, world, run_dir, overrides, base=BASE)


def shards(t) -> dict:
    """This rank's parameter shards with their place in the global tensors (parity format)."""
    return _shards(t.model.named_parameters(), "")


def opt_state_names(t) -> list[str]:
    inner = getattr(t.optimizer, "inner", t.optimizer)
    return sorted(name for opt in inner.optimizers.values() for g in opt.param_groups
                  for name, p in zip(g["param_names"], g["params"]) if opt.state.get(p))


def buffers(t) -> dict:
    return {n: b.detach().clone() for n, b in t.model.named_buffers() if "bias" in n}


def save_record(out: Path, rank: int, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{rank}.pt")


def load_records(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
