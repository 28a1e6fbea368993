"""Shared recipe overrides of the planning tests: `tiny`, small batches, no files written."""

from __future__ import annotations

from tests.tiny_runs import TINY_RECIPE as RECIPE  # noqa: F401 (the planning tests name it)
from tests.tiny_runs import tiny_recipe, tiny_trainer
BASE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=64", "training.micro_batch_size=2",
        "training.global_batch_size=8", "data.num_documents=200", "logging.progress_bar=false",
        "logging.tensorboard=false", "checkpoint.resume=false", "checkpoint.save_at_end=false",
        "training.train_steps=1"]


def recipe(*overrides: str):
    return tiny_recipe(overrides, base=BASE)


def trainer(rank: int, world: int, overrides: list[str], run_dir):
    return tiny_trainer(rank, world, run_dir, overrides, base=BASE)
