"""Real, unmodified harnesses playing the embedded agentic tasks through the gateway (issue 25,
"Real harnesses, unmodified"; walkthrough Ch. 6-7).

The tiny checkpoint of the server tests is served in-process with a PrefixTree trace store; the
engine is steered to scripted answers (a task's reference solution, or an immediate submit) in
the one tool-call format, so the episodes are deterministic while every token still comes out of
the engine's sampler. Each harness (OpenAI Agents SDK, the anthropic client, smolagents, our own
loop) then runs its own loop against a session URL with the sandbox's tools as its native
function tools; the tests check the trace against the engine's own requests, the grading, the
process weights and Eq. 30 over the group.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_s2.posttrain.agentic.gateway_episode import group_token_advantages, run_harness_episode
from megatron_s2.posttrain.agentic.harnesses import HARNESSES, HarnessSettings, make_harness
from megatron_s2.posttrain.agentic.runner import run_episode
from megatron_s2.posttrain.agentic.sandbox import SandboxUnavailable, detect_runtime
from megatron_s2.posttrain.agentic.tasks import load_task
from megatron_s2.posttrain.agentic.tools import format_call
from megatron_s2.posttrain.rollout.agentic_trace import episode_samples
from megatron_s2.config.posttrain.agentic import SandboxConfig
from megatron_s2.serve import ServeConfig
from megatron_s2.serve.gateway.traces import TraceStore
from tests.serve.conftest import loaded, run_dir, start_server  # noqa: F401 - the served checkpoint's fixtures
from tests.serve.test_gateway import ScriptedPolicy

EOS = "<｜end▁of▁sentence｜>"


class EngineLog:
    """Every engine request of the server, in arrival order (the engine's own prompt + samples)."""

    def __init__(self, engine):
        self.requests: dict[str, object] = {}
        real = engine.executor.forward

        def forward(chunks, **kw):
            for chunk in chunks:
                self.requests.setdefault(chunk.request.request_id, chunk.request)
            return real(chunks, **kw)

        engine.executor.forward = forward


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def runtime():
    try:
        return detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("harness-traces")


@pytest.fixture(scope="module")
def server(loaded, traces):  # noqa: F811
    srv = start_server(loaded, name="policy", serve=ServeConfig(disconnect_poll_s=0.05, gateway_traces=str(traces)),
                       max_model_len=8192, max_num_seqs=4)  # smolagents' own prompt: ~5k tokens
    srv.log = EngineLog(srv.state.backend.engine)  # wrapped first: it sees what the steering leaves
    srv.policy = ScriptedPolicy(srv.state.backend.engine)
    yield srv
    srv.stop()


def _script(tok, calls) -> list[list[int]]:
    """One answer per call (the one tool-call format), as token ids the engine is steered to."""
    return [tok.encode(format_call(c["name"], c.get("arguments", {})) + EOS) for c in calls]


@pytest.mark.slow
@pytest.mark.parametrize("harness, declare", [pytest.param(h, True, id=h) for h in sorted(HARNESSES)]
                         + [pytest.param("anthropic", False, id="anthropic-undeclared")])
def test_a_harness_plays_a_task_into_trainable_traces(server, traces, loaded, runtime, harness, declare):  # noqa: F811
    """Per harness, a group of two sessions of one task — the reference solution and an immediate
    submit: (1) every tool call ran in the episode's sandbox and the episodes are graded after the
    agent stopped (1 and 0); (2) each trace's token ids are exactly the engine's last request of
    that session (prompt + samples) and each trainable span is exactly one sample; (3) process
    weights per policy segment and Eq. 30 over the group land on exactly those spans; (4) the
    trainer's samples (``episode_samples``) carry the same ids, mask, log-probs and weights."""
    tok = loaded[1]
    task = load_task("sum_pair")
    settings = HarnessSettings(model="policy", max_turns=6, max_tokens=160, temperature=1.0, declare_tools=declare)
    episodes, scripts = [], []
    for member, calls in enumerate([list(task.reference), [{"name": "submit", "arguments": {}}]]):
        script = _script(tok, calls)
        server.policy.queue[:] = script
        seen = len(server.log.requests)
        session = f"{harness}{'' if declare else '-undeclared'}-{task.name}@{member}"
        episodes.append(run_harness_episode(task, make_harness(harness), runtime, server_url=server.url,
                                            session=session, trace_dir=traces, settings=settings))
        requests = list(server.log.requests.values())[seen:]
        assert [r.output_ids for r in requests] == script, episodes[-1].error or "other model calls than scripted"
        if harness == "anthropic":  # declared: the schemas reach the prompt; undeclared: the tools are only named
            assert ("## Tools" in tok.decode(requests[0].tokens, keep_special=True)) == declare
        scripts.append((script, requests))
    ref, idle = episodes
    assert (ref.reward, ref.status, ref.stop_reason) == (1.0, "passed", "submitted"), ref.grade
    assert (idle.reward, idle.status, idle.stop_reason) == (0.0, "failed", "submitted")
    assert [call.name for call, _ in ref.tool_log] == [c["name"] for c in task.reference]
    for episode, (script, requests) in zip(episodes, scripts):
        calls = TraceStore(traces).session_calls(episode.session)
        spans = []
        for sample in episode.samples:  # one branch (or one per call: smolagents re-renders its history)
            leaf = next(k for k, call in enumerate(calls) if call.response == sample.segments[-1].node)
            assert sample.token_ids.tolist() == requests[leaf].tokens  # the engine's own ids, never re-tokenised
            spans += [sample.token_ids[s.start:s.end].tolist() for s in sample.segments if s.trainable]
            assert np.isfinite(sample.logprobs[sample.loss_mask]).all()
        assert spans == script  # every sample trained once, in one branch only
        assert episode.categories == ["clean"] * len(script) and episode.weights == [1.0] * len(script)
    for episode, advantages, value in zip(episodes, group_token_advantages(episodes), (1.0, -1.0)):
        for sample, adv in zip(episode.samples, advantages):  # leave-one-out: +1 and -1, Eq. 30 with w = 1
            assert (adv[sample.loss_mask] == value).all() and not adv[~sample.loss_mask].any()
    # (4) as the trainer's samples: the same ids, mask and log-probs, one span per policy segment
    for episode, (script, _) in zip(episodes, scripts):
        rollouts = episode_samples(episode, 0, version=3, layer_ids=None)
        assert [r.sample_id for r in rollouts] == list(range(len(rollouts)))
        assert [r.tokens[a:b] for r in rollouts for a, b in r.spans] == script
        assert [w for r in rollouts for w in r.process_weights] == [1.0] * len(script)
        assert all(r.reward == episode.reward and r.correct == (episode.reward > 0) for r in rollouts)
        for r, branch in zip(rollouts, [b for b in episode.samples if b.loss_mask.any()]):
            assert r.policy_mask == branch.loss_mask[:len(r.tokens)].tolist()
            assert np.allclose([lp for lp, m in zip(r.logprobs, r.policy_mask) if m], branch.logprobs[branch.loss_mask])
            assert {v for v, m in zip(r.versions, r.policy_mask) if m} == {3}


@pytest.mark.slow
def test_a_re_rendering_harness_trains_every_call_once(server, traces, loaded, runtime, monkeypatch):  # noqa: F811
    """smolagents writes its earlier calls back as its own text, so its session leaves one trace
    branch per model call. Laid out as the trainer's rows (``episode_sample``, then the step's
    micro-batches, beside a one-call episode of the same group): (a) every trained token is what the
    engine sampled for that call, with its log-prob, in that call's exact context; (b) each call's
    sample is trained in exactly one row (token_mean counts every sampled token once); (c) the
    harness's re-rendering of its earlier calls is context, never trained."""
    from megatron_s2.config.posttrain.loss import LossConfig
    from megatron_s2.posttrain.rollout.agentic_trace import episode_sample
    from megatron_s2.posttrain.train_batch import build_micro_batches

    tok, engine = loaded[1], server.state.backend.engine
    sampled: dict[str, dict] = {}
    add_request = engine.add_request

    def spy(prompt, params=None, *, request_id=None, on_output=None, **kwargs):
        rec = sampled[request_id] = {"prompt": list(prompt), "ids": [], "logprobs": []}

        def out(o):
            rec["ids"] += list(o.token_ids)
            rec["logprobs"] += list(o.logprobs)
            on_output(o)
        return add_request(prompt, params, request_id=request_id, on_output=out, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    task = load_task("sum_pair")
    settings = HarnessSettings(model="policy", max_turns=6, max_tokens=160, temperature=1.0)
    episodes, scripts = [], [_script(tok, task.reference), _script(tok, [{"name": "submit"}])]
    for member, script in enumerate(scripts):
        server.policy.queue[:] = script
        episodes.append(run_harness_episode(task, make_harness("smolagents"), runtime, server_url=server.url,
                                            session=f"smol-rows@{member}", trace_dir=traces, settings=settings))
    assert [e.reward for e in episodes] == [1.0, 0.0], episodes[0].error
    calls = list(sampled.values())
    assert [c["ids"] for c in calls] == scripts[0] + scripts[1]
    samples = [episode_sample(e, k, version=0, layer_ids=None) for k, e in enumerate(episodes)]
    rows = samples[0].rows
    assert len(rows) == 3 and len(samples[1].rows) == 1  # one branch per call of the 3-call episode
    trained = []
    for row in rows + samples[1].rows:
        for start, end in row.spans:  # (a) the call whose prompt is this row's context, token for token
            # (both episodes' first calls share their prompt: the opening chat)
            (call,) = [c for c in calls if c["prompt"] == row.tokens[:start] and c["ids"] == row.tokens[start:end]]
            assert np.allclose(row.logprobs[start:end], call["logprobs"], atol=1e-6)
            trained.append(call["ids"])
    assert sorted(trained) == sorted(scripts[0] + scripts[1])  # (b) every call once
    for k, row in enumerate(rows[1:], 1):  # (c) earlier calls come back re-rendered, masked
        start = row.spans[0][0]
        assert row.spans == [(start, start + len(scripts[0][k]))]
        context = tok.decode(row.tokens[:start])  # smolagents' memory: "Calling tools:\n[{... 'function': {...}}]"
        assert all(f"'name': {c['name']!r}, 'arguments': {c['arguments']!r}" in context for c in task.reference[:k])
        for earlier in scripts[0][:k]:
            assert not any(row.tokens[i:i + len(earlier)] == earlier for i in range(start))
    mbs = build_micro_batches(samples, [1.0, -1.0], seq_length=max(len(r.tokens) for r in rows), micro_batch_size=2,
                              dp_rank=0, dp_size=1, pad_id=0, loss_config=LossConfig(aggregation="token_mean"))
    mask = np.concatenate([mb["loss_mask"].numpy().ravel() for mb in mbs])
    weights = np.concatenate([mb["weights"].numpy().ravel() for mb in mbs])
    assert mask.sum() == sum(len(ids) for ids in trained) and np.isclose(weights.sum(), 1.0)


@pytest.mark.slow
def test_smolagents_out_of_context_is_a_context_limit_stop_not_a_harness_error(server, traces, loaded,  # noqa: F811
                                                                              runtime):
    """The gateway refuses a call that no longer fits the context (400 "maximum context length");
    smolagents wraps that in its ``AgentGenerationError`` and re-raises it. The episode must end as
    a context-limit stop — a deterministic annotation (walkthrough Ch. 7: its last segment weighted
    as a limit stop) — not as ``harness_error``. The first call's prompt (smolagents' own ~5k-token
    opening) is measured, then ``max_tokens`` is set so that exactly that call fits and the second,
    one observation longer, does not."""
    tok = loaded[1]
    task = load_task("sum_pair")
    max_model_len = server.state.max_model_len
    server.policy.queue[:] = _script(tok, [{"name": "submit"}])
    seen = len(server.log.requests)
    run_harness_episode(task, make_harness("smolagents"), runtime, server_url=server.url, session="smol-ctx@0",
                        trace_dir=traces, settings=HarnessSettings(max_turns=2, max_tokens=16))
    first = list(server.log.requests.values())[seen]
    opening = len(first.tokens) - len(first.output_ids)  # smolagents' opening chat, in tokens
    script = _script(tok, task.reference)
    server.policy.queue[:] = list(script)
    seen = len(server.log.requests)
    settings = HarnessSettings(max_turns=4, max_tokens=max_model_len - opening)  # the first call fits, exactly
    episode = run_harness_episode(task, make_harness("smolagents"), runtime, server_url=server.url,
                                  session="smol-ctx@1", trace_dir=traces, settings=settings)
    server.policy.queue.clear()
    assert [r.output_ids for r in list(server.log.requests.values())[seen:]] == script[:1]  # one call ran
    assert episode.stop_reason == "context_limit", episode.error
    assert episode.error == "" and episode.categories == ["limit_stop"]
    assert episode.transcript[-1].stop == "context_limit"


@pytest.mark.slow
def test_runner_and_harness_give_the_same_labels_and_weights(server, traces, loaded, runtime):  # noqa: F811
    """The in-process runner (a ``messages -> text`` policy reading the one format) and a harness
    through the gateway, on one scripted session with a malformed answer, a failing call and its
    repetition: the same calls reach the sandbox and the annotator gives the same weights."""
    tok = loaded[1]
    task = load_task("sum_pair")
    answers = [format_call("read_file", {"path": "nope.py"}),
               format_call("bash", {"command": "ls"}).replace('"ls"}', '"ls"'),  # arguments are not JSON
               format_call("read_file", {"path": "nope.py"}), format_call("submit", {})]
    runner = run_episode(task, lambda messages: answers[sum(m["role"] == "assistant" for m in messages)], runtime)
    server.policy.queue[:] = [tok.encode(a + EOS) for a in answers]
    harness = run_harness_episode(task, make_harness("builtin"), runtime, server_url=server.url,
                                  session="same-labels", trace_dir=traces, settings=HarnessSettings(max_turns=6))
    assert runner.categories == harness.categories == ["clean", "malformed", "repeated_failed_call", "clean"]
    assert runner.weights == harness.weights
    (sample,) = harness.samples
    spans = [sample.token_ids[s.start:s.end].tolist() for s in sample.segments if s.trainable]
    assert spans == [tok.encode(a + EOS) for a in answers]
    assert TraceStore(traces).session_calls("same-labels")[-1].finish_reason == "stop"


@pytest.mark.slow
def test_play_command_serves_a_checkpoint_to_a_harness(run_dir, tmp_path, capsys):  # noqa: F811
    """``python -m megatron_s2.posttrain.agentic play``: the (untrained) checkpoint served in-process,
    our loop playing two turns against it, captured and graded; a missing checkpoint is exit 2."""
    import json

    from megatron_s2.posttrain.agentic.__main__ import main as agentic_cli

    args = ["play", "sum_pair", "--checkpoint", str(run_dir), "--harness", "builtin", "--max-turns", "2",
            "--max-tokens", "6", "--max-model-len", "2048", "--traces", str(tmp_path / "traces"), "--json"]
    assert agentic_cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["reward"], out["status"], out["stop_reason"], out["branches"]) == (0.0, "failed", "turn_limit", 1)
    assert 2 <= out["trainable_tokens"] <= 12 and len(out["weights"]) == 2 == len(out["categories"])
    assert (tmp_path / "traces" / out["session"].split("@")[0] / "trace.jsonl").is_file()
    assert agentic_cli(["play", "sum_pair", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "checkpoint:" in capsys.readouterr().err
