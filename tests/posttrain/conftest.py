"""Fixtures shared by the post-training tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_s2.cli import main

TINY_PRETRAIN = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "tiny_pretrain.yaml"


@pytest.fixture(scope="session")
def tiny_pretrained_run(tmp_path_factory) -> Path:
    """A run directory with a 2-step `tiny` pre-training checkpoint (the policy that the
    disaggregated eval and weight-broadcast tests serve): trained once per test process."""
    run = tmp_path_factory.mktemp("tiny_pretrained") / "run"
    assert main(["train", str(TINY_PRETRAIN), "training.train_steps=2", "training.seq_length=32",
                 "training.global_batch_size=4", "training.micro_batch_size=2", "data.num_documents=100",
                 "checkpoint.save_interval=2", "logging.progress_bar=false", "logging.tensorboard=false",
                 "--run-dir", str(run)]) == 0
    return run
