"""The one helper for "a tiny run" that many test modules start: the real trainer on the `tiny`
recipe (``recipes/pretrain_tiny.yaml``) with a module's base overrides, in this process or in a
spawned rank (and a tiny forecaster checkpoint, :func:`trained_forecaster`). Modules keep their own base overrides (batch geometry, steps, seed) and pass them
as ``base``; nothing else is duplicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "pretrain_tiny.yaml"

__all__ = ["TINY_RECIPE", "tiny_recipe", "tiny_trainer", "tiny_train", "FORECAST_RECIPE", "trained_forecaster"]


def tiny_recipe(overrides: Sequence[str] = (), *, base: Sequence[str] = (), run_dir: Path | str | None = None,
                recipe_path: Path = TINY_RECIPE):
    """The recipe under ``base + overrides`` (and ``training.run_dir`` when given)."""
    from megatron_s2.config.recipe import load_recipe

    extra = [f"training.run_dir={run_dir}"] if run_dir is not None else []
    return load_recipe(recipe_path, [*base, *overrides, *extra])


def tiny_trainer(rank: int, world: int, run_dir: Path | str, overrides: Sequence[str] = (), *,
                 base: Sequence[str] = (), logs: list | None = None, recipe_path: Path = TINY_RECIPE):
    """The real :class:`~megatron_s2.training.trainer.Trainer` of rank ``rank`` of ``world``
    (rank 0's log lines are appended to ``logs`` when given)."""
    from megatron_s2.training.trainer import Trainer

    log = (lambda *a, **k: logs.append(" ".join(str(x) for x in a))) if logs is not None else (lambda *a, **k: None)
    recipe = tiny_recipe(overrides, base=base, run_dir=run_dir, recipe_path=recipe_path)
    return Trainer(recipe, Path(run_dir), rank=rank, world_size=world, log=log)


def tiny_train(rank: int, world: int, run_dir: Path | str, overrides: Sequence[str] = (), *,
               base: Sequence[str] = (), recipe_path: Path = TINY_RECIPE) -> dict:
    """Run ``Trainer.train()``; return losses, token fingerprints, rank-0 log lines, the trainer."""
    logs: list[str] = []
    t = tiny_trainer(rank, world, run_dir, overrides, base=base, logs=logs, recipe_path=recipe_path)
    result = t.train()
    return {"losses": result.losses, "fingerprints": result.fingerprints, "logs": logs, "trainer": t,
            "final_step": result.final_step}


FORECAST_RECIPE = REPO / "recipes" / "timeseries_forecast_tiny.yaml"


def trained_forecaster(run: Path, learned_horizon: bool = False) -> Path:
    """A 3-step ``timeseries_forecast_tiny`` run in ``run`` (~12 s): a checkpoint to forecast from.
    ``learned_horizon``: with the recipe's learned horizon predictor; without it (default) the
    checkpoint is one of the runs before it, whose horizons the parser reads."""
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.training.forecast_trainer import ForecastTrainer

    recipe = load_recipe(FORECAST_RECIPE, [f"training.run_dir={run}", "training.train_steps=3", "data.num_documents=16",
                                           "schedule.warmup_steps=1", "schedule.decay_start_step=2",
                                           "schedule.decay_end_step=3", "checkpoint.save_interval=3",
                                           f"model.timeseries.horizon_predictor={str(learned_horizon).lower()}"])
    ForecastTrainer(recipe, run, log=lambda *a, **k: None).train()
    return run
