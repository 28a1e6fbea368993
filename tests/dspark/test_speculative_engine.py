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


def test_more_drafts_than_the_drafter_proposes_is_refused(model):
    block = model.config.dspark_block_size
    with pytest.raises(ConfigError, match=rf"speculative_tokens: 100 drafts a round asked.*at most {block}"):
        engine(model, speculative=True, speculative_tokens=100)
    assert engine(model, speculative=True, speculative_tokens=block).speculator.max_drafts == block


def _chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_speculative_sampling_follows_the_policy_distribution(dspark_cfg):
    """The first two tokens of 800 seeded requests (top-k 6, temperature 1) against the
    policy's own joint distribution computed by full forwards: a chi-square test. The first token
    comes from the prompt's forward; the next step drafts one token and verifies it, so the second
    token is an accepted draft or a draw from the residual max(0, p - q)."""
    from megatron_s2.inference.sampling import sampling_log_probs

    model = build_model(dspark_cfg, seed=9).eval()
    prompt = [3, 17, 40, 99, 5, 62]
    params = dict(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    n = 800
    eng = engine(model, speculative=True, speculative_schedule="fixed", max_num_seqs=16, max_waiting=n)
    done = eng.generate([prompt] * n, [SamplingParams(seed=i, **params) for i in range(n)])
    stats = eng.stats()["speculative"]
    assert 0.05 < stats["acceptance_rate"] < 0.95, stats  # both paths exercised
    sp = SamplingParams(**params)

    def dist(tokens):
        with torch.no_grad():
            return sampling_log_probs(model(torch.tensor([tokens]))[0, -1], sp).exp()

    joint = {}
    p1 = dist(prompt)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    counts = {}
    for r in done:
        key = tuple(r.token_ids[:2])
        assert len(r.token_ids) == 3 and key in joint, f"{r.token_ids} is outside the policy's top-6 support"
        counts[key] = counts.get(key, 0) + 1
    cells, stat, small = 0, 0.0, [0.0, 0]
    for key, prob in joint.items():
        expected = n * prob
        if expected < 5:  # pool the rare cells
            small[0] += expected
            small[1] += counts.get(key, 0)
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    if small[0] > 0:
        stat += (small[1] - small[0]) ** 2 / small[0]
        cells += 1
    p_value = _chi2_sf(stat, cells - 1)
    print(f"chi-square {stat:.2f} over {cells} cells, p = {p_value:.3f}; acceptance {stats['acceptance_rate']:.2f}")
    assert p_value > 1e-3


def test_routing_records_cover_exactly_the_kept_tokens(model):
    """R3 (report §5.2.1) under speculation: one routing row per fed token, in position order;
    rejected drafts leave none."""
    ps = prompts(3, seed=4)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, record_routing=True)
    eng = engine(model, speculative=True, speculative_schedule="fixed")
    for r, p in zip(eng.generate(ps, params), ps):
        fed = len(p) + len(r.token_ids) - 1
        assert r.routed_experts.shape[0] == fed, (r.routed_experts.shape, fed)
        assert (r.routed_experts >= 0).all()
    assert eng.stats()["speculative"]["drafted"] > eng.stats()["speculative"]["accepted"]  # rejections happened


def test_pause_update_resume_and_abort_mid_generation(model):
    """Token-level interruption (§5.2.3) between speculative steps: paused requests keep their
    state, versions advance, an abort frees the request's state; the rest finish exactly as
    an uninterrupted greedy run."""
    ps = prompts(3, seed=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = [r.token_ids for r in engine(model).generate(ps, params)]
    eng = engine(model, speculative=True, speculative_schedule="fixed")  # every decode step speculates
    handles = [eng.submit(p, params) for p in ps]
    for _ in range(4):
        eng.step()
    eng.pause()
    eng.step()  # nothing runs while paused
    eng.set_policy_version(1)
    eng.abort(handles[1].request_id)
    eng.resume()
    while eng.has_work():
        eng.step()
    results = [h.result() for h in handles]
    assert results[1].finish_reason.value == "abort"
    assert results[0].token_ids == plain[0] and results[2].token_ids == plain[2]
    assert set(results[0].versions) == {0, 1}
    assert eng.stats()["free_swa_slots"] == 4


def _accepted_draft_stop(model, prompt, params, **engine_kw) -> int:
    """A token that a speculative run emits as an accepted draft (not the last token of its
    verification round) and that does not occur earlier in the output: a stop token there ends
    the request in the middle of a round. ``engine_kw``: the configuration of the run the stop
    is meant for (with an SWA pool the prompt's last token is decoded — speculatively — after
    the pool's snapshot, so the two runs must agree on it to draw the same tokens)."""
    eng = engine(model, speculative=True, speculative_schedule="fixed", **engine_kw)
    handle = eng.submit(prompt, params)
    while eng.has_work():
        eng.step()
    seen = []
    while not handle.empty():
        out = handle.get()
        for token in out.token_ids[:-1]:  # every token of a round but its last is an accepted draft
            if token not in seen:
                return token
            seen.append(token)
        seen += out.token_ids[-1:]
    pytest.fail("no verification round accepted a draft")


def test_a_stop_token_among_accepted_drafts_ends_the_round_there(model):
    """A stop token accepted as a draft ends the request at that token: the state it leaves
    (routing records, the SWA-pool snapshot a next turn resumes from) covers the tokens fed up
    to it, not the accepted drafts after it."""
    prompt = prompts(1, seed=11)[0]
    sampled = dict(max_tokens=24, temperature=1.0, seed=2, ignore_eos=True)
    pool = dict(prefix_caching=True, swa_pool_slots=2)
    stop = _accepted_draft_stop(model, prompt, SamplingParams(**sampled), **pool)
    eng = engine(model, speculative=True, speculative_schedule="fixed", **pool)
    first = eng.generate([prompt], SamplingParams(stop_token_ids=(stop,), record_routing=True, **sampled))[0]
    assert first.token_ids[-1] == stop and first.finish_reason.value == "stop"
    assert first.routed_experts.shape[0] == len(prompt) + len(first.token_ids) - 1

    # the next turn resumes from the snapshot of the first: the same distributions as a fresh prefill
    turn = prompt + first.token_ids + [9, 33, 29]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    resumed = eng.generate([turn], greedy)[0]
    assert eng.executor.tiers.hits["swa_snapshots"] == 1
    fresh = engine(model).generate([turn], greedy)[0]
    assert resumed.token_ids == fresh.token_ids
    assert resumed.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)


def test_drafts_take_only_pages_the_step_does_not_need(model):
    """With a page pool too small for every request, drafts verify only in pages the step's
    prompt chunks do not need (the plain engine preempts instead of running out): the same
    tokens as plain greedy decode, no OutOfPages."""
    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(0, 127, (n,), generator=g).tolist() for n in (21, 12, 17, 28, 27, 17)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    small = dict(num_pages=1 + 96 // 4 + 4)  # one request of max_model_len, and 4 pages more
    plain = [r.token_ids for r in engine(model, **small).generate(ps, params)]
    spec = engine(model, speculative=True, speculative_schedule="fixed", **small)
    assert [r.token_ids for r in spec.generate(ps, params)] == plain


def test_a_resumed_cache_state_drafts_from_its_own_rows_only(model):
    """A request resumed from an exported cache state (a rollout after a restart, §5.2.3) takes
    an SWA slot another request may have used: its drafter must not read that request's rows
    (the export carries none of the drafter's, so the resumed prefix is masked)."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    source = engine(model, speculative=True, max_num_seqs=1)
    rid = source.add_request(prompts(1, seed=12)[0], greedy)
    for _ in range(3):
        source.step()
    state, tokens = source.export_cache_state(rid), list(source.requests[rid].tokens)

    def proposal(eng):
        resumed = eng.add_request(tokens, greedy, cache_state=state)
        eng.step()  # admits it from the state, then one speculative round
        base, _ = eng.executor.drafter.propose([eng.requests[resumed]])
        return base

    used = engine(model, speculative=True, max_num_seqs=1)
    used.generate(prompts(1, seed=13), greedy)  # leaves its rows in the only slot
    # masked rows still enter the window kernels at weight 0 (rounding only); the other
    # request's rows, read as this one's, move the logits by ~0.3
    torch.testing.assert_close(proposal(used), proposal(engine(model, speculative=True, max_num_seqs=1)),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_speculative_tokens_without_speculative_is_refused(command, tmp_path, capsys):
    """``--speculative-tokens 3`` alone decoded plainly without a word: one line, exit 2, checked
    before the checkpoint is read."""
    from megatron_s2.cli import main

    assert main([command[0], str(tmp_path / "missing"), *command[1:], "--speculative-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].split("configuration error: ", 1)[-1].startswith("--speculative-tokens: "), err[0]


def _assert_drafts_equal_teacher_forced(model, eng, req):
    base, _ = eng.executor.drafter.propose([req])
    p = req.num_computed
    tokens = torch.tensor([req.tokens + [0] * model.config.dspark_block_size])
    model.capture_dspark = True
    try:
        mb = {"tokens": tokens}
        ctx = model.make_context(mb)
        with torch.no_grad():
            logits = model(tokens, ctx)
            tf, _ = model.dspark_teacher_forced(logits, mb, ctx)
            bias, _ = model.dspark.markov(tokens[0, p:p + model.config.dspark_block_size])
    finally:
        model.capture_dspark = False
    torch.testing.assert_close(base[0], tf.logits[0, p - 1] - bias, rtol=0, atol=2e-5)


def test_engine_drafts_equal_the_teacher_forced_drafter(model):
    """What the engine's drafter proposes from its rings (fed by prompt chunks and by the kept
    tokens of speculative steps) equals the training view of the same anchor: the teacher-forced
    drafter over the whole sequence (base logits, before the Markov bias)."""
    eng = engine(model, speculative=True, speculative_schedule="fixed", prefill_chunk=8)
    rid = eng.add_request(prompts(1, seed=21)[0] + [5] * 6, SamplingParams(max_tokens=20, temperature=1.0,
                                                                             seed=1, ignore_eos=True))
    for _ in range(6):  # chunked prefill, then speculative steps (kept and rolled-back drafts)
        eng.step()
    req = eng.requests[rid]
    assert eng.stats()["speculative"]["rounds"] >= 2
    _assert_drafts_equal_teacher_forced(model, eng, req)


def test_drafts_after_a_plain_stretch_equal_the_teacher_forced_drafter(model):
    """While the schedule decodes plainly the drafter's rows wait in a backlog and enter its rings
    in batched flushes (one each time a backlog spans the window, the rest at the next proposal):
    the first proposal after 20 plain steps sees exactly the rows it would have seen step by step."""
    eng = engine(model, speculative=True, prefill_chunk=8)
    eng.speculator.gate.decide = lambda *_: False  # the gate keeps finding that drafting does not pay
    rid = eng.add_request(prompts(1, seed=22)[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(24):
        eng.step()
    req = eng.requests[rid]
    assert eng.stats()["speculative"]["rounds"] == 0 and req.num_generated >= 20
    _assert_drafts_equal_teacher_forced(model, eng, req)
