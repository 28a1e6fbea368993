"""Speculative decoding in the engine with the DSpark drafter (report §2.4.3): exact for greedy,
lossless for sampling, rolled-back caches identical to never having drafted."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.engine import InferenceEngine
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.models.v41.model import build_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def model(dspark_cfg):
    return build_model(dspark_cfg, seed=5).eval()


def engine(model, **kw) -> InferenceEngine:
    base = dict(max_num_seqs=4, max_model_len=96, page_tokens=4, prefill_chunk=16, max_prefill_tokens=32)
    base.update(kw)
    return InferenceEngine(model, EngineConfig(**base))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 127, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_speculative_decode_equals_plain_greedy(model):
    ps = prompts(5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [r.token_ids for r in engine(model).generate(ps, params)]
    eng = engine(model, speculative=True, speculative_schedule="fixed")
    spec = [r.token_ids for r in eng.generate(ps, params)]
    assert spec == plain
    stats = eng.stats()["speculative"]
    assert stats["rounds"] > 0 and stats["drafted"] > 0
    print(f"greedy: {stats}")


def test_a_rollback_restores_the_cache_byte_for_byte(model):
    eng = engine(model, speculative=True)
    rid = eng.add_request(list(range(1, 14)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        eng.step()  # prefill + a few speculative steps
    req = eng.requests[rid]
    before = eng.executor.export_state(req)
    start = req.num_computed
    for length, keep in ((5, 0), (5, 2), (3, 1)):
        eng.executor.begin_speculation(req, length)
        req.tokens.extend([7] * (length - 1))
        from megatron_s2.models.family.engine import Chunk

        eng.executor.forward([Chunk(req, start, length, "all")])
        del req.tokens[start + 1:]
        eng.executor.rollback(req, 0)
        after = eng.executor.export_state(req)
        assert set(after) == set(before)
        for key in before:
            assert torch.equal(after[key], before[key]), (length, key)


def test_speculation_without_a_drafter_is_refused(dspark_cfg):
    plain = build_model(dspark_cfg.replace(dspark_layers=0, dspark_target_layer_ids=()), seed=0).eval()
    with pytest.raises(ConfigError, match="speculative: the model has no DSpark drafter"):
        engine(plain, speculative=True)
