"""Shared helpers of the inference tests: model configs, single-threaded torch (the tests
time nothing, and one thread is several times faster on the shared 2-core CI machines)."""

from __future__ import annotations

import pytest

from tests.models.conftest import load_model_recipe


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this directory runs with one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_model_recipe("tiny")


def quantised(cfg, on: bool = True):
    return cfg.replace(fp4_main_kv=on, fp8_swa_kv=on, fp4_indexer=on)
