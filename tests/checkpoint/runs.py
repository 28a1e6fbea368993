"""Training runs the checkpoint tests start, in this process or in spawned ranks.

Every run is the real :class:`~megatron_s2.training.trainer.Trainer` on the tiny recipe with
the parity overrides of :mod:`tests.parallel.parity` (``BASE``), so that losses and parameters
can be compared across layouts with the parity tolerances. Records travel back to the test
through ``rank<N>.pt`` files (written with ``torch.save``, read by the test that wrote them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_s2.config.recipe import load_recipe
from tests.parallel.parity import BASE, RECIPE, _shards

__all__ = ["opt_state_names", "recipe", "save_record", "shards", "train", "trainer"]


def recipe(run_dir: Path, overrides: list[str]):
    return load_recipe(RECIPE, [*BASE, *overrides, f"training.run_dir={run_dir}"])


def trainer(rank: int, world: int, run_dir: Path, overrides: list[str], logs: list | None = None):
    from megatron_s2.training.trainer import Trainer

    log = (lambda *a, **k: logs.append(" ".join(str(x) for x in a))) if logs is not None else (lambda *a, **k: None)
    return Trainer(recipe(run_dir, overrides), run_dir, rank=rank, world_size=world, log=log)


def train(rank: int, world: int, run_dir: Path, overrides: list[str]) -> dict:
    """Run ``Trainer.train()``; return losses, token fingerprints, rank-0 log lines, the trainer."""
    logs: list[str] = []
    t = trainer(rank, world, run_dir, overrides, logs)
    result = t.train()
    return {"losses": result.losses, "fingerprints": result.fingerprints, "logs": logs, "trainer": t,
            "final_step": result.final_step}


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
