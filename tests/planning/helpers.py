"""Shared recipe overrides of the planning tests: `tiny`, small batches, no files written."""

from __future__ import annotations

from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
BASE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=64", "training.micro_batch_size=2",
        "training.global_batch_size=8", "data.num_documents=200", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.resume=false", "checkpoint.save_at_end=false",
        "training.train_steps=1"]


def recipe(*overrides: str):
    from megatron_s2.config.recipe import load_recipe

    return load_recipe(RECIPE, [*BASE, *overrides])


def trainer(rank: int, world: int, overrides: list[str], run_dir):
    from megatron_s2.training.trainer import Trainer

    r = recipe(*overrides, f"training.run_dir={run_dir}")
    return Trainer(r, Path(run_dir), rank=rank, world_size=world, log=lambda *a, **k: None)
