"""Shared fixtures of the server tests: one checkpoint the session trains itself (a few steps
of the tiny V4.1 pre-training recipe with the shipped byte-level BPE tokenizer, whose V4-style
chat template the chat endpoint and verifiers' renderer use), loaded once, and servers started
in-process on free ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_s2.cli import main
from megatron_s2.config.engine import EngineConfig
from megatron_s2.serve import ServeConfig, ServerThread, build_state
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "tiny_pretrain.yaml"
TRAIN = ["training.train_steps=3", "training.seq_length=32", "training.global_batch_size=4",
         "training.micro_batch_size=2", "data.num_documents=200", "checkpoint.save_interval=3",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this directory runs with one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A run directory as the trainer leaves it (config, tokenizer, a committed checkpoint)."""
    run = tmp_path_factory.mktemp("serve") / "run"
    assert main(["train", str(RECIPE), *TRAIN, "--run-dir", str(run)]) == 0
    return run


@pytest.fixture(scope="session")
def loaded(run_dir):
    """(model, tokenizer, description) of the trained checkpoint, as ``megatron-s2 serve`` loads it."""
    from megatron_s2.inference.weights import load_model

    return load_model(str(run_dir), "cpu")


@pytest.fixture(scope="session")
def tok(loaded):
    """The trained checkpoint's tokenizer."""
    return loaded[1]


def start_server(loaded, name="tiny", serve=None, **engine) -> ServerThread:
    model, tokenizer, description = loaded
    engine_config = EngineConfig(**{**dict(max_num_seqs=8, max_model_len=256, seed=0), **engine})
    state = build_state(model, tokenizer, description, serve or ServeConfig(disconnect_poll_s=0.05), engine_config,
                        model_name=name)
    return ServerThread(state).start()


@pytest.fixture(scope="module")
def server(loaded):
    """A server with the default settings, one per test module (modules that need other
    settings define their own ``server``)."""
    srv = start_server(loaded)
    yield srv
    srv.stop()
