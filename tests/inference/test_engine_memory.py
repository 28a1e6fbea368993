"""An engine whose KV cache cannot fit is refused before anything is allocated: ``megatron-s2
serve --max-model-len 10000000`` used to zero tens of GiB of pages and be killed by the
kernel's OOM killer (exit 137, no message) instead of naming the option to lower."""

from __future__ import annotations

import time

import pytest

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import EngineConfig, InferenceEngine
from megatron_s2.models.v41.accounting import kv_cache_bytes
from megatron_s2.models.v41.model import build_model


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return build_model(tiny_cfg, seed=0).eval()


def test_a_kv_cache_larger_than_memory_is_a_config_error_naming_the_options(model):
    config = EngineConfig(max_model_len=10 ** 9, max_num_seqs=16)
    needed = kv_cache_bytes(model.config, config)
    assert needed > 1024 ** 4  # terabytes: nothing may try to allocate this
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        InferenceEngine(model, config)
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert message.startswith("max_model_len") and "max_num_seqs" in message and "GiB" in message
    assert "\n" not in message


def test_the_estimate_is_what_the_engine_allocates(model):
    config = EngineConfig(max_model_len=256, max_num_seqs=3, prefix_caching=True, swa_pool_slots=2)
    engine = InferenceEngine(model, config)
    allocated = engine.executor.global_kv.buffer_bytes() + engine.executor.swa.bytes_per_slot() * engine.executor.swa.num_slots
    assert kv_cache_bytes(model.config, config) == allocated
