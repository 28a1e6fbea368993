"""Shared helpers of the inference tests: model configs, single-threaded torch (the tests
time nothing, and one thread is several times faster on the shared 2-core CI machines)."""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import load_model_recipe


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_model_recipe("tiny")


def quantised(cfg, on: bool = True):
    return cfg.replace(fp4_main_kv=on, fp8_swa_kv=on, fp4_indexer=on)
