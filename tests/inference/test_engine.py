"""The engine (report §5.2.3): continuous batching, sampling semantics, per-token log-probs and
policy versions, token-level interruption with weight swaps, routing records for Rollout
Routing Replay, request-state freeing, the bounded queue, and the background driver."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import (EngineConfig, FinishReason, InferenceEngine, PromptTooLong, QueueFull,
                                   SamplingParams)
from megatron_s2.inference.driver import EngineDriver
from megatron_s2.inference.sampling import sampling_log_probs
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

PROMPTS = [list(range(5, 5 + n)) for n in (13, 5, 20, 9, 3)]


def engine_config(**kw):
    return EngineConfig(**{**dict(max_num_seqs=3, max_model_len=64, prefill_chunk=6, max_prefill_tokens=8,
                                  page_tokens=8), **kw})


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return build_model(tiny_cfg, seed=0).eval()


@pytest.fixture(scope="module")
def other_model(tiny_cfg):
    return build_model(tiny_cfg, seed=1).eval()


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]


def test_greedy_continuous_batching_equals_the_full_forward(model):
    """5 requests of different lengths through 3 slots: they join and leave between steps."""
    engine = InferenceEngine(model, engine_config())
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0, logprobs=3))
    for prompt, r in zip(PROMPTS, results):
        logits = full_logits(model, prompt + r.token_ids)[len(prompt) - 1:-1]
        assert r.token_ids == logits.argmax(-1).tolist()
        ref = torch.log_softmax(logits, -1)
        got = torch.tensor(r.logprobs)
        assert torch.allclose(got, ref.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0], atol=1e-5)
        assert [t for t, _ in r.top_logprobs[0]] == ref[0].topk(3).indices.tolist()
        assert r.finish_reason is FinishReason.LENGTH and r.versions == [0] * 9


def test_sampled_log_probs_are_under_the_sampling_distribution(model):
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=20, top_p=0.9, seed=11)
    r = InferenceEngine(model, engine_config()).generate([PROMPTS[0]], params)[0]
    logits = full_logits(model, PROMPTS[0] + r.token_ids)[len(PROMPTS[0]) - 1:-1]
    for i, tok in enumerate(r.token_ids):
        logp = sampling_log_probs(logits[i], params)
        assert abs(r.logprobs[i] - float(logp[tok])) < 1e-5
        assert torch.isfinite(logp).sum() <= 20  # top-k support


def test_sampling_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    top_k = sampling_log_probs(logits, SamplingParams(top_k=2))
    assert torch.isfinite(top_k).tolist() == [True, True, False, False, False]
    assert torch.allclose(top_k.exp().sum(), torch.tensor(1.0))
    # top-p: the smallest most-likely set reaching p (p(0)=0.64, p(0)+p(1)=0.87)
    probs = torch.softmax(logits, -1)
    assert torch.isfinite(sampling_log_probs(logits, SamplingParams(top_p=0.6))).sum() == 1
    assert torch.isfinite(sampling_log_probs(logits, SamplingParams(top_p=float(probs[0]) + 0.01))).sum() == 2
    hot = sampling_log_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.log_softmax(logits / 2, -1))
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0), dict(stop=("",))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model):
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 1)]
    alone = InferenceEngine(model, engine_config()).generate([PROMPTS[1]], params[0])[0]
    batch = InferenceEngine(model, engine_config()).generate([PROMPTS[1], PROMPTS[1], PROMPTS[1]], params)
    assert batch[0].token_ids == alone.token_ids == batch[2].token_ids
    assert batch[1].token_ids != batch[0].token_ids


def test_a_request_resubmitted_with_its_generated_prefix_draws_the_same_continuation(model):
    """A seeded draw depends on (seed, position) only: a request re-submitted after a restart with
    its first tokens appended to the prompt (an RL rollout resumed from a checkpoint, report
    §5.2.1) draws the tokens the uninterrupted request drew, although that one had already made
    the earlier draws."""
    (whole,) = InferenceEngine(model, engine_config()).generate(
        [PROMPTS[3]], SamplingParams(max_tokens=10, temperature=1.0, seed=7))
    for cut in (1, 4):
        (tail,) = InferenceEngine(model, engine_config()).generate(
            [PROMPTS[3] + whole.token_ids[:cut]], SamplingParams(max_tokens=10 - cut, temperature=1.0, seed=7))
        assert tail.token_ids == whole.token_ids[cut:], cut
        assert torch.allclose(torch.tensor(tail.logprobs), torch.tensor(whole.logprobs[cut:]), atol=1e-5)


def test_stop_strings_stop_tokens_and_eos(model):
    text = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731 - a toy detokenizer
    greedy = InferenceEngine(model, engine_config()).generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0))
    ids = greedy[0].token_ids
    stop = text(ids[3:5])
    first = text(ids).find(stop)
    by_string, by_token = InferenceEngine(model, engine_config(), detokenize=text).generate([PROMPTS[2]] * 2, [
        SamplingParams(max_tokens=8, temperature=0, stop=(stop,)),
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(ids[2],))])
    by_eos, ignoring = InferenceEngine(model, engine_config(), eos_token_ids=[ids[6]]).generate([PROMPTS[2]] * 2, [
        SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    assert by_string.token_ids == ids[:first + len(stop)] and by_string.stop_reason == stop
    assert by_string.finish_reason is FinishReason.STOP
    assert by_token.token_ids == ids[:ids.index(ids[2]) + 1] and by_token.stop_reason == ids[2]
    assert by_eos.token_ids == ids[:ids.index(ids[6]) + 1] and by_eos.finish_reason is FinishReason.STOP
    assert ignoring.token_ids == ids and ignoring.finish_reason is FinishReason.LENGTH


def run_steps(engine, prompts, params, on_step=None):
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    step = 0
    while engine.has_work():
        if on_step is not None:
            on_step(step)
        engine.step()
        step += 1
    return [h.result(timeout=0) for h in handles]


def test_pause_swap_same_weights_resume_is_invisible(model, tiny_cfg):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=i) for i in range(len(PROMPTS))]
    reference = run_steps(InferenceEngine(model, engine_config()), PROMPTS, params)
    same = build_model(tiny_cfg, seed=0).eval()
    engine = InferenceEngine(model, engine_config())
    pauses = set(random.Random(0).sample(range(1, 20), 6))

    def maybe_pause(step):
        if step in pauses:
            engine.pause()
            assert engine.step() == []  # paused: nothing moves
            engine.update_weights(same)
            engine.resume()

    got = run_steps(engine, PROMPTS, params, maybe_pause)
    assert engine.policy_version == len(pauses)
    for a, b in zip(reference, got):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_versions_change_exactly_at_the_swap(model, other_model, tiny_cfg):
    params = [SamplingParams(max_tokens=10, temperature=0) for _ in PROMPTS]
    engine = InferenceEngine(build_model(tiny_cfg, seed=0).eval(), engine_config())  # its weights get replaced
    produced = {}
    handles = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    for _ in range(7):
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.token_ids)
    engine.pause()
    assert engine.update_weights(other_model) == 1
    engine.resume()
    while engine.has_work():
        engine.step()
    results = [h.result(timeout=0) for h in handles]
    assert any(0 < produced.get(r.request_id, 0) < 10 for r in results)
    for r in results:
        before = produced.get(r.request_id, 0)
        assert r.versions == [0] * before + [1] * (10 - before)
    # the old weights' tokens are the old model's greedy choice, the request goes on from its cache
    r = results[0]
    before = produced[r.request_id]
    logits = full_logits(model, PROMPTS[0] + r.token_ids)[len(PROMPTS[0]) - 1:]
    assert r.token_ids[:before] == logits[:before].argmax(-1).tolist()


def test_routing_records_replay_in_the_training_forward(model):
    params = SamplingParams(max_tokens=6, temperature=0, record_routing=True, record_indexer_topk=True)
    r = InferenceEngine(model, engine_config()).generate([PROMPTS[2]], params)[0]
    fed = PROMPTS[2] + r.token_ids[:-1]
    layers = model.layer_ids
    assert tuple(r.routed_experts.shape) == (len(fed), len(layers), model.config.moe_topk)
    ids = torch.tensor([fed])
    record = RoutingReplay(RoutingMode.RECORD)
    with torch.no_grad():
        plain = model(ids, ForwardContext.create(ids, model.config.plan, routing=record))
        replayed = model(ids, ForwardContext.create(ids, model.config.plan, routing=r.routing_replay(layers)))
    for i, layer in enumerate(layers):
        assert torch.equal(record.records()[layer][0][0], r.routed_experts[:, i]), layer
    assert torch.equal(plain, replayed)
    assert sorted(r.indexer_topk) == [1, 3, 4, 6] and r.indexer_topk[4].shape == (len(fed), model.config.index_topk)


def test_request_state_is_freed_when_it_completes_or_is_aborted(model):
    engine = InferenceEngine(model, engine_config())
    free_pages, free_slots = engine.executor.global_kv.pool.num_free, len(engine.executor.swa.free)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, (2, 30, 3, 30, 1))]
    seen_finish = {}
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                seen_finish[out.request_id] = out
                assert out.request_id not in {r.request_id for r in engine.running}
    engine.abort(handles[1].request_id)
    engine.abort(handles[3].request_id)
    while engine.has_work():
        engine.step()
    assert handles[1].result(timeout=0).finish_reason is FinishReason.ABORT
    assert engine.executor.global_kv.pool.num_free == free_pages and len(engine.executor.swa.free) == free_slots
    assert not engine.requests and not engine.running and not engine.waiting


def test_a_request_whose_stop_check_raises_fails_alone(model):
    """One request's own post-processing error (here its stop-string check: the detokenizer
    raises on its text) ends that request with ERROR and frees its state; the other requests
    of the same steps finish exactly as without it, and the engine takes new work."""

    def detokenize(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine = InferenceEngine(model, engine_config(), detokenize=detokenize)
    free_pages, free_slots = engine.executor.global_kv.pool.num_free, len(engine.executor.swa.free)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    bad = engine.submit(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, stop=["zz"]))
    good = engine.submit(PROMPTS[1], greedy)
    while engine.has_work():
        engine.step()
    failed = bad.result(timeout=0)
    assert failed.finish_reason is FinishReason.ERROR and "UnicodeDecodeError" in failed.error
    alone = InferenceEngine(model, engine_config()).generate([PROMPTS[1]], greedy)[0]
    assert good.result(timeout=0).token_ids == alone.token_ids
    assert engine.executor.global_kv.pool.num_free == free_pages and len(engine.executor.swa.free) == free_slots
    assert engine.generate([PROMPTS[2]], greedy)[0].finish_reason is FinishReason.LENGTH


def test_bounded_queue_and_bad_requests(model):
    engine = InferenceEngine(model, engine_config(max_waiting=2, max_model_len=16))
    engine.add_request([5, 6])
    engine.add_request([5, 6])
    with pytest.raises(QueueFull):
        engine.add_request([5, 6])
    with pytest.raises(PromptTooLong):
        engine.add_request(list(range(5, 21)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([5, 10_000])
    engine.step()  # both admitted: room in the queue again
    engine.add_request([5, 6])
    with pytest.raises(ConfigError, match="page_tokens"):
        InferenceEngine(model, EngineConfig(page_tokens=7))


def test_background_driver_pause_resume_and_threads(model):
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(len(PROMPTS))]
    reference = run_steps(InferenceEngine(model, engine_config()), PROMPTS, params)
    engine = InferenceEngine(model, engine_config())
    driver = EngineDriver(engine)
    handles = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    driver.start()
    try:
        for _ in range(3):
            time.sleep(0.05)
            engine.pause()
            frozen = [(r.request_id, len(r.tokens), r.num_computed) for r in engine.running]
            engine.update_weights(model.state_dict())
            time.sleep(0.05)
            assert frozen == [(r.request_id, len(r.tokens), r.num_computed) for r in engine.running]
            engine.resume()
        results = []
        threads = [threading.Thread(target=lambda h=h: results.append(h.result(timeout=60))) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        driver.stop()
    by_id = {r.request_id: r for r in results}
    for h, ref in zip(handles, reference):
        assert by_id[h.request_id].token_ids == ref.token_ids
    assert engine.policy_version == 3


def test_preemption_under_page_pressure_recomputes_and_keeps_the_tokens(model):
    """11 usable pages of 8 tokens for 3 requests growing to ~30 tokens each: the newest request
    is preempted (its cache dropped) and later re-runs its prompt and generated tokens."""
    prompts = [list(range(5, 5 + n)) for n in (20, 18, 22)]
    engine = InferenceEngine(model, engine_config(num_pages=12, max_model_len=40))
    preempted = []
    real = engine._preempt
    engine._preempt = lambda req: (preempted.append(req.request_id), real(req))
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert preempted
    for prompt, r in zip(prompts, results):
        assert r.token_ids == full_logits(model, prompt + r.token_ids)[len(prompt) - 1:-1].argmax(-1).tolist()
    assert engine.executor.global_kv.pool.num_free == 11


def test_update_weights_from_a_checkpoint_directory(model, other_model, tiny_cfg, tmp_path):
    from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
    from megatron_s2.config.recipe import load_recipe
    from tests.parallel.parity import RECIPE

    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1"])
    write_full_state(other_model.state_dict(), recipe, tmp_path / "checkpoints", step=3)
    engine = InferenceEngine(build_model(tiny_cfg, seed=0).eval(), engine_config())
    assert engine.update_weights(tmp_path) == 1
    for (name, a), b in zip(engine.model.state_dict().items(), other_model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="does not exist"):
        engine.update_weights(tmp_path / "missing")
