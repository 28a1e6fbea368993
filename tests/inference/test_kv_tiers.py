"""KV tiers (report §3.2.1) and SWA Bounded Replay (§3.2.2) through the engine.

* The short-TTL SWA pool resumes a regeneration (same prompt) after the prompt's last-but-one
  token and a next turn at the end of the previous output — exactly (greedy tokens equal the
  whole-sequence forward), sharing the cached pages and copying the page being filled.
* A global-KV prefix hit without an SWA snapshot replays the last W prefix tokens (SWA only)
  with encoder bounded replay, or runs the prompt from the start without it (exact).
* Snapshots expire after their TTL; finished requests leave only cached, evictable pages.
* The bounded-replay report computes finite KL and FLOPs ratios on tiny (not asserted to a bound).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron_s2.tools.replay_report import measure_bounded_replay
from megatron_s2.models.v41.model import build_model

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return build_model(tiny_cfg, seed=2).eval()


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 128, (n,), generator=g).tolist()


def engine(model, **kw):
    cfg = dict(max_num_seqs=2, max_model_len=96, prefill_chunk=16, max_prefill_tokens=16, page_tokens=8,
               prefix_caching=True)
    eng = InferenceEngine(model, EngineConfig(**{**cfg, **kw}))
    eng.processed = []
    real = eng.executor.runner.forward

    def counting(rows, **k):
        eng.processed.append(sum(len(r.tokens) for r in rows))
        return real(rows, **k)

    eng.executor.runner.forward = counting
    return eng


def greedy_reference(model, tokens, n):
    with torch.no_grad():
        for _ in range(n):
            tokens = tokens + [int(model(torch.tensor([tokens]))[0, -1].argmax())]
    return tokens


def run(eng, prompts, params=GREEDY):
    eng.processed.clear()
    return eng.generate(prompts, params)


def test_swa_pool_resumes_regeneration_and_next_turn_exactly(model):
    eng = engine(model, swa_pool_slots=4)
    p = prompt(29)
    first = run(eng, [p])[0]
    assert first.token_ids == greedy_reference(model, p, 6)[len(p):]
    again = run(eng, [p])[0]                     # regeneration: resumes after token P-1
    assert again.token_ids == first.token_ids
    assert sum(eng.processed) == 1 + 5 and eng.executor.tiers.hits["swa_snapshots"] == 1
    turn = p + first.token_ids + prompt(7, seed=1)  # next turn: resumes at the end of the output
    second = run(eng, [turn])[0]
    assert second.token_ids == greedy_reference(model, turn, 6)[len(turn):]
    assert sum(eng.processed) == (len(turn) - (len(p) + 5)) + 5 and eng.executor.tiers.hits["swa_snapshots"] == 2


def test_two_continuations_of_one_snapshot_do_not_share_the_page_being_filled(model):
    eng = engine(model, swa_pool_slots=4)
    p = prompt(21)  # the snapshot ends inside a page
    first = run(eng, [p])[0]
    turns = [p + first.token_ids + prompt(3, seed=s) for s in (5, 6)]
    both = run(eng, turns)
    assert eng.executor.tiers.hits["swa_snapshots"] == 2
    for t, r in zip(turns, both):
        assert r.token_ids == greedy_reference(model, t, 6)[len(t):]


def test_prefix_hit_without_swa_state_replays_the_window_or_runs_exactly(model):
    w = model.config.window_size
    p = prompt(40)
    longer = p + prompt(9, seed=3)
    eng = engine(model)  # no SWA pool: a hit finds global KV only
    run(eng, [p])
    replayed = run(eng, [longer])[0]
    hit = 40  # the 5 pages the first request completed (its 44 processed tokens)
    assert eng.executor.tiers.hits["encoder_replays"] == 1 and eng.executor.tiers.hits["prefix_pages"] == hit // 8
    assert sum(eng.processed) == (len(longer) - (hit - w)) + 5
    assert all(math.isfinite(x) for x in replayed.logprobs)
    exact = engine(model, encoder_bounded_replay=False)
    run(exact, [p])
    got = run(exact, [longer])[0]
    assert sum(exact.processed) == len(longer) + 5 and exact.executor.tiers.hits["encoder_replays"] == 0
    assert got.token_ids == greedy_reference(model, longer, 6)[len(longer):]


def test_snapshots_expire_and_finished_requests_leave_only_evictable_pages(model):
    eng = engine(model, swa_pool_slots=2, swa_pool_ttl_s=0.05)
    total = eng.executor.global_kv.pool.num_free
    p = prompt(30)
    run(eng, [p, prompt(17, seed=4)])
    assert len(eng.executor.tiers.snapshots) == 2 and eng.executor.global_kv.pool.num_free < total
    time.sleep(0.1)
    run(eng, [p])  # the expired snapshots are dropped at admission; the prefix is still cached
    assert eng.executor.tiers.hits["swa_snapshots"] == 0 and eng.executor.tiers.hits["encoder_replays"] == 1
    time.sleep(0.1)
    eng.executor.tiers.expire()
    assert not eng.executor.tiers.snapshots and eng.executor.global_kv.pool.num_free == total
    assert len(eng.executor.global_kv.pool.evictable) > 0 and len(eng.executor.swa.free) == eng.executor.swa.num_slots


def test_decoder_bounded_replay_runs_the_decoder_over_the_last_window_only(model):
    w = model.config.window_size
    eng = engine(model, prefix_caching=False, decoder_bounded_replay=True)
    seen = []
    real = eng.executor.runner.model.run_layers

    def spy(hidden, ctx, layer_ids=None):
        seen.append((tuple(layer_ids) if layer_ids is not None else None, int(ctx.kv_cache.valid.sum())))
        return real(hidden, ctx, layer_ids)

    eng.executor.runner.model.run_layers = spy
    try:
        run(eng, [prompt(37)], SamplingParams(max_tokens=2, temperature=0))
    finally:
        del eng.executor.runner.model.run_layers
    decoder = tuple(range(model.config.num_encoder_layers, model.config.num_layers))
    # the decoder saw the last W prompt tokens, then the one decode step (whole-model calls: None)
    assert sum(n for ids, n in seen if ids in (None, decoder)) == w + 1
    assert any(ids == decoder for ids, _ in seen)
    with pytest.raises(ConfigError, match="swa_pool_slots"):
        EngineConfig(swa_pool_slots=2)


@pytest.mark.slow
def test_bounded_replay_report_is_computed(tiny_cfg):
    model = build_model(tiny_cfg.replace(init_std=0.1), seed=0).eval()
    toks = prompt(60, seed=9)
    report = {m.variant: m for m in measure_bounded_replay(model, toks[:52], toks[52:], cached_prefix=40,
                                                         page_tokens=8, chunk=16)}
    assert set(report) == {"exact", "decoder", "encoder", "encoder+decoder"}
    assert report["exact"].kl_mean == 0 and report["exact"].flops_ratio == 1
    for m in report.values():
        assert math.isfinite(m.kl_mean) and m.kl_mean >= 0 and 0 < m.flops_ratio <= 1
