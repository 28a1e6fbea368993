"""The agent gateway (Intern-S2 walkthrough Ch. 6) through the real ``openai`` and ``anthropic``
clients: OpenAI Responses, Anthropic Messages and Chat Completions with tools, streaming and not,
per-session endpoints, token-in / token-out capture and the PrefixTree trace store (worked
example 19 on stored traces).

A tiny random model does not write tool calls, so the tests that need one steer the engine's
logits towards a scripted answer (:class:`ScriptedPolicy`: the real engine, sampler, server and
tokenizer; only the next-token choice is dictated) — everything else is the model's own output.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch

from megatron_s2.serve import ServeConfig
from megatron_s2.serve.gateway.tool_format import OutputParser, TextDelta, ToolCall
from megatron_s2.serve.gateway.traces import TraceStore, read_samples, worked_example_19, flat_and_tree_tokens
from tests.serve.conftest import start_server

TOOLS_CHAT = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                 "parameters": {"type": "object",
                                                                "properties": {"path": {"type": "string"}}}}}]
TOOL_ANSWER = ("<think>hm</think>Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>"
               '{"path":"a"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')


class ScriptedPolicy:
    """Steers the engine towards the next scripted answer: the logits of each request that starts
    while a script is queued get +1e4 on the script's next token until it is spelled out."""

    def __init__(self, engine):
        self.queue: list[list[int]] = []
        self.active: dict[str, list[int]] = {}
        real = engine.executor.forward

        def forward(chunks, **kw):
            results = real(chunks, **kw)
            for chunk, res in zip(chunks, results):
                req = chunk.request
                if res.logits is None:
                    continue
                if req.num_generated == 0 and req.request_id not in self.active and self.queue:
                    self.active[req.request_id] = self.queue.pop(0)
                script = self.active.get(req.request_id)
                if script is not None and req.num_generated < len(script):
                    res.logits[script[req.num_generated]] += 1e4
            return results

        engine.executor.forward = forward


def record_calls(engine, setattr=setattr) -> list[dict]:
    """Record every request the engine serves from now on: its prompt ids and the ids and
    log-probs it generated (``setattr``: e.g. ``monkeypatch.setattr`` to undo it after the test)."""
    calls: list[dict] = []
    add_request = engine.add_request

    def spy(prompt, params=None, *, request_id=None, on_output=None, **kwargs):
        rec = {"prompt": list(prompt), "ids": [], "logprobs": []}
        calls.append(rec)

        def out(o):
            rec["ids"] += list(o.token_ids)
            rec["logprobs"] += list(o.logprobs)
            on_output(o)
        return add_request(prompt, params, request_id=request_id, on_output=out, **kwargs)

    setattr(engine, "add_request", spy)
    return calls


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


def start_scripted_server(loaded, **serve):
    """A server over the trained checkpoint whose engine follows a :class:`ScriptedPolicy` (``.policy``)."""
    srv = start_server(loaded, serve=ServeConfig(disconnect_poll_s=0.05, **serve), max_model_len=512)
    srv.policy = ScriptedPolicy(srv.state.backend.engine)
    return srv


@pytest.fixture(scope="module")
def server(loaded, traces):
    srv = start_scripted_server(loaded, gateway_traces=str(traces))
    yield srv
    srv.stop()


def oa(server, session=None):
    base = f"{server.url}/sessions/{session}/v1" if session else f"{server.url}/v1"
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def an(server, session=None):
    base = f"{server.url}/sessions/{session}" if session else server.url
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


# ---- pure pieces -------------------------------------------------------------------------------
def test_worked_example_19_arithmetic():
    numbers = worked_example_19()
    assert numbers["flat"] == 768_000 and numbers["tree"] == 3_000 + 2_400 + 8 * 9_600 == 82_200
    assert numbers["one_session_flat"] == 96_000 and numbers["one_session_tree"] == 15_000
    assert numbers["one_session_saving"] == pytest.approx(6.4)
    assert numbers["saving"] == pytest.approx(768_000 / 82_200)


def test_a_forgotten_group_leaves_memory_and_disk(tmp_path):
    """A trainer that consumed a session's trace drops its tree (the agentic rollout back end)."""
    store = TraceStore(tmp_path)
    node = store.add_node("ep7", -1, "context", "hello", [1, 2, 3])
    assert store.groups() == ["ep7"] and store.tree("ep7").nodes[node].text == "hello"
    store.forget("ep7")
    assert store.groups() == [] and not (tmp_path / "ep7").exists() and not store.tree("ep7").nodes
    store.forget("never-seen")  # nothing to drop: no error


def test_output_parser_splits_reasoning_text_and_calls(tok):
    ids = tok.encode(TOOL_ANSWER)
    whole = OutputParser(tok)
    whole.push(ids, last=True)
    assert whole.text == {"text": "Ok.", "reasoning": "hm"}
    assert [(c.name, c.input) for c in whole.calls] == [("read_file", {"path": "a"})]
    streamed, events = OutputParser(tok), []  # one token at a time: the same events
    for i, token in enumerate(ids):
        events += streamed.push([token], last=i == len(ids) - 1)
    assert "".join(e.text for e in events if isinstance(e, TextDelta) and e.kind == "text") == "Ok."
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["read_file"]
    bad = OutputParser(tok)  # arguments that are not a JSON object: relayed as text, not a call
    bad.push(tok.encode("<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"), last=True)
    assert bad.calls == [] and bad.text["text"] == "f[1]"


# ---- protocols ---------------------------------------------------------------------------------
def test_responses_plain_and_streamed_agree(server):
    client = oa(server)
    kw = dict(model="tiny", input="Say something.", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**kw)
    assert plain.status in ("completed", "incomplete") and plain.usage.output_tokens >= 1
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.output_text == plain.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text


def test_messages_plain_and_streamed_agree(server):
    client = an(server)
    kw = dict(model="tiny", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": "Say something."}])
    plain = client.messages.create(**kw)
    assert plain.type == "message" and plain.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in plain.content if b.type == "text")
    assert final.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_tool_calls_are_relayed_natively(server, tok, protocol):
    server.policy.queue.append(tok.encode(TOOL_ANSWER))
    if protocol == "chat":
        chat = oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Read a"}],
                                                  tools=TOOLS_CHAT, max_tokens=40)
        (choice,) = chat.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Ok."
        assert choice.message.model_extra["reasoning_content"] == "hm"
        (call,) = choice.message.tool_calls
        assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a"}
    elif protocol == "responses":
        tools = [{"type": "function", "name": "read_file", "description": "Read a file",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
        resp = oa(server).responses.create(model="tiny", input="Read a", tools=tools, max_output_tokens=40)
        assert [item.type for item in resp.output] == ["reasoning", "message", "function_call"]
        assert resp.output[0].content[0].text == "hm" and resp.output_text == "Ok."
        assert resp.output[2].name == "read_file" and json.loads(resp.output[2].arguments) == {"path": "a"}
    else:
        tools = [{"name": "read_file", "description": "Read a file",
                  "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
        msg = an(server).messages.create(model="tiny", max_tokens=40, tools=tools,
                                         messages=[{"role": "user", "content": "Read a"}])
        assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
        assert msg.content[0].thinking == "hm" and msg.content[2].input == {"path": "a"}


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_tool_calls_stream_natively(server, tok, protocol):
    server.policy.queue.append(tok.encode(TOOL_ANSWER))
    if protocol == "chat":
        chunks = list(oa(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Read a"}], tools=TOOLS_CHAT, max_tokens=40,
            stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Ok."
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "hm"
        (call,) = [t for d in deltas for t in d.tool_calls or []]
        assert call.function.name == "read_file" and chunks[-1].choices[0].finish_reason == "tool_calls"
    elif protocol == "responses":
        tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
        events = list(oa(server).responses.create(model="tiny", input="Read a", tools=tools, max_output_tokens=40,
                                                  stream=True))
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hm"
        assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == ['{"path": "a"}']
    else:
        with an(server).messages.stream(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "Read"}],
                                        tools=[{"name": "read_file", "input_schema": {"type": "object"}}]) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[2].input == {"path": "a"} and final.stop_reason == "tool_use"


def test_client_errors_are_4xx_in_each_protocols_shape_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oa(server).responses.create(model="tiny", input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].type"):
        oa(server).responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        oa(server).responses.create(model="other", input="x")
    with pytest.raises(anthropic.BadRequestError) as err:
        an(server).messages.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    body = err.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages[0].role")
    raw = httpx.post(f"{server.url}/v1/messages", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    # max_tokens is required by the Messages API (else the call would run to the context's end)
    raw = httpx.post(f"{server.url}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("max_tokens: required"), raw.text
    with pytest.raises(openai.NotFoundError, match="session id"):
        oa(server, "..bad").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert oa(server).responses.create(model="tiny", input="still here", max_output_tokens=2).usage.output_tokens


# ---- sessions, TITO, PrefixTree ----------------------------------------------------------------
def test_session_turns_reuse_the_sampled_ids_never_retokenised(server, tok, traces):
    """Turn k+1's prompt starts with exactly turn k's prompt + sampled ids, where re-tokenising
    the decoded text gives other ids (found among the model's own samples)."""
    client, messages, seen, differs = oa(server, "tito-1"), [{"role": "user", "content": "Go."}], [], 0
    for turn in range(4):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=1.0,
                                           seed=turn, extra_body={"ignore_eos": True})
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Again {turn}."}]
    calls = TraceStore(traces).session_calls("tito-1")
    assert len(calls) == 4
    samples = list(read_samples(traces, ["tito-1"]))
    (sample,) = samples
    tree = TraceStore(traces).tree("tito-1")
    for before, after in zip(calls, calls[1:]):
        prompt = [t for n in tree.path(before.context) for t in tree.nodes[n].token_ids]
        sampled = tree.nodes[before.response].token_ids
        later = [t for n in tree.path(after.context) for t in tree.nodes[n].token_ids]
        assert later[:len(prompt) + len(sampled)] == prompt + sampled
        differs += tok.encode(tok.decode(sampled)) != sampled
    assert differs >= 1, "no sample whose text re-tokenises differently: the check proved nothing"
    assert sample.calls == 4 and sample.loss_mask.sum() == sum(c.output_tokens for c in calls)


def _agent_loop(client_for, protocol: str, script_ids, policy, session: str) -> None:
    """Two model calls of a harness in ``protocol``: a scripted tool call, its result, an answer."""
    policy.queue.append(script_ids)
    if protocol == "messages":
        client = client_for(session)
        tools = [{"name": "read_file", "description": "Read a file",
                  "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
        history = [{"role": "user", "content": "Read a"}]
        first = client.messages.create(model="tiny", max_tokens=40, tools=tools, messages=history)
        use = next(b for b in first.content if b.type == "tool_use")
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hello"}]}]
        client.messages.create(model="tiny", max_tokens=3, tools=tools, messages=history,
                               extra_body={"temperature": 0})
    elif protocol == "responses":
        client = client_for(session)
        tools = [{"type": "function", "name": "read_file", "description": "Read a file",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
        first = client.responses.create(model="tiny", input="Read a", tools=tools, max_output_tokens=40)
        call = next(item for item in first.output if item.type == "function_call")
        history = [{"role": "user", "content": "Read a"}, *[item.model_dump(exclude_none=True)
                                                               for item in first.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": "hello"}]
        client.responses.create(model="tiny", input=history, tools=tools, max_output_tokens=3, temperature=0)
    else:
        client = client_for(session)
        history = [{"role": "user", "content": "Read a"}]
        first = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS_CHAT, max_tokens=40)
        message = first.choices[0].message
        history += [message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "hello"}]
        client.chat.completions.create(model="tiny", messages=history, tools=TOOLS_CHAT, max_tokens=3, temperature=0)


@pytest.mark.slow
def test_three_protocols_render_one_conversation_to_the_same_tokens(server, tok, traces):
    """A tool call and its result, through each protocol's session endpoint: the second call's
    prompt ids are the same, and they hold the first call's sampled ids verbatim."""
    script = tok.encode(TOOL_ANSWER)
    clients = {"chat": lambda s: oa(server, s), "responses": lambda s: oa(server, s), "messages": lambda s: an(server, s)}
    prompts = {}
    for protocol, client_for in clients.items():
        _agent_loop(client_for, protocol, script, server.policy, f"same-{protocol}")
        store = TraceStore(traces)
        first, second = store.session_calls(f"same-{protocol}")
        tree = store.tree(f"same-{protocol}")
        prompt = [t for n in tree.path(second.context) for t in tree.nodes[n].token_ids]
        assert tree.path(second.context)[:2] == [first.context, first.response]  # the trunk is reused
        assert tree.nodes[first.response].token_ids == script
        prompts[protocol] = prompt
    assert prompts["chat"] == prompts["responses"] == prompts["messages"]


@pytest.mark.parametrize("sessions, turns, shared", [(2, 3, 1), pytest.param(8, 10, 2, marks=pytest.mark.slow)])
def test_worked_example_19_on_stored_traces(server, tok, traces, sessions, turns, shared):
    """G sessions x T turns through the gateway (the example's shape at small token sizes): the
    first ``shared`` turns agree (same seeds), later ones diverge. Flat vs tree token counts of
    the stored traces equal the example's arithmetic with the measured sizes."""
    group, R = f"ex19-{sessions}x{turns}", 4
    for s in range(sessions):
        client = oa(server, f"{group}@{s}")
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Task 19."}]
        for t in range(turns):
            seed = t if t < shared else 1000 * (s + 1) + t
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=R, seed=seed,
                                               temperature=1.0, extra_body={"ignore_eos": True})
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Observation: ok."}]
    store = TraceStore(traces)
    tree = store.tree(group)
    calls = tree.calls
    assert len(calls) == sessions * turns and all(c.output_tokens == R for c in calls)
    header = len(tree.nodes[tree.roots[0]].token_ids)
    assert len(tree.roots) == 1
    observation = {len(n.token_ids) for n in tree.nodes.values()
                   if n.kind == "context" and n.parent != -1 and n.text != tok.decode([tok.eos_id], keep_special=True)}
    (d,) = observation  # every observation delta has one length
    per_turn = R + 1 + d  # response, the closing end-of-message token (a length stop), the observation
    flat, stored = store.token_counts(group)
    formula_flat, formula_tree = flat_and_tree_tokens(sessions, turns, header, per_turn, shared)
    # the formula counts turn t's observation in call t and an observation after the last turn
    assert flat == formula_flat - sessions * turns * (1 + d)
    assert stored == formula_tree - sessions * d
    branching = [n for n in tree.nodes.values() if len(n.children) > 1]
    assert len(branching) == 1 and len(branching[0].children) == sessions
    print(f"worked example 19 on stored traces ({sessions} x {turns}): flat {flat}, tree {stored}, "
          f"saving {flat / stored:.2f}x")
    samples = list(read_samples(traces, [group]))
    assert len(samples) == sessions and all(s.calls == turns for s in samples)
    assert all(s.loss_mask.sum() == turns * R for s in samples)


def test_skip_keeps_a_step_in_context_and_out_of_the_loss(server, tok, traces):
    client = oa(server, "curate-1")
    messages = [{"role": "user", "content": "Do it."}]
    for t in range(3):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=t,
                                           extra_body={"ignore_eos": True})
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    store = TraceStore(traces)
    node = store.mark_skip("curate-1", 1)
    (sample,) = read_samples(traces, ["curate-1"])
    (seg,) = [s for s in sample.segments if s.node == node]
    assert seg.skip and not sample.loss_mask[seg.start:seg.end].any()
    assert sample.loss_mask.sum() == 2 * 5  # the other two responses stay trainable
    assert np.isfinite(sample.logprobs[sample.loss_mask]).all() and np.isnan(sample.logprobs[:seg.start][
        ~sample.loss_mask[:seg.start]]).all()
    trainable = [s for s in sample.segments if s.kind == "response"]
    assert [s.trainable for s in trainable] == [True, False, True]
    # R3: every fed position has its routed experts (a response's last token from the next call's
    # forward); only the session's very last sampled token was never fed
    assert sample.experts is not None and sample.experts.shape[0] == len(sample.token_ids)
    assert (sample.experts[:-1] >= 0).all() and (sample.experts[-1] == -1).all()


def test_store_survives_a_torn_write(server, traces, tmp_path):
    """A crash mid-append leaves a torn last line and maybe an orphan array: both are skipped."""
    import shutil

    # its own session: the test must not depend on what an earlier test left in the store
    oa(server, "torn-1").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go."}],
                                                 max_tokens=4, seed=0, extra_body={"ignore_eos": True})
    copy = tmp_path / "copy"
    shutil.copytree(traces / "torn-1", copy / "torn-1")
    with open(copy / "torn-1" / "trace.jsonl", "a") as handle:
        handle.write('{"event": "node", "id": 999, "par')
    (copy / "torn-1" / "nodes" / "998.npz").write_bytes(b"partial")
    (sample,) = read_samples(copy)
    (again,) = read_samples(traces, ["torn-1"])
    assert np.array_equal(sample.token_ids, again.token_ids) and np.array_equal(sample.loss_mask, again.loss_mask)
    with np.load(next((copy / "torn-1" / "nodes").glob("0.npz")), allow_pickle=False) as data:
        assert set(data.files) >= {"token_ids", "logprobs"}


@pytest.mark.slow
def test_serve_command_with_gateway_traces_captures_a_session(run_dir, tmp_path):
    """``megatron-s2 serve --gateway-traces DIR`` as a user starts it: an Anthropic client on a
    session base URL leaves a readable trace."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "serve", str(run_dir), "--port", "0",
                             "--device", "cpu", "--max-model-len", "256", "--gateway-traces", str(tmp_path / "t"),
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:
            found = re.search(r"listening on http://[^:]+:(\d+)", line)
            if found:
                break
        url = f"http://127.0.0.1:{found.group(1)}"
        for _ in range(600):  # the port is printed once bound; uvicorn listens a moment later
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = anthropic.Anthropic(base_url=f"{url}/sessions/cli-1", api_key="x",
                                     max_retries=0, timeout=60)
        reply = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.output_tokens >= 1
        (sample,) = read_samples(tmp_path / "t")
        assert sample.session == "cli-1" and sample.loss_mask.sum() == reply.usage.output_tokens
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_runs_a_tool_loop_through_a_session(server, tok, traces, api):
    """An unmodified harness, the OpenAI Agents SDK, on a session base URL: it calls the tool the
    policy asked for, sends the result back, and gets the final answer; the trace holds the
    policy's exact ids and the second call reuses them."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        seen.append(path)
        return "hello"

    session = f"agents-{api}"
    client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{session}/v1", api_key="unused", max_retries=0)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
        model="tiny", openai_client=client)
    agent = agents.Agent(name="reader", instructions="Use the tools.", tools=[read_file], model=model,
                         model_settings=agents.ModelSettings(max_tokens=40))
    first, final = tok.encode(TOOL_ANSWER), tok.encode("Done.<｜end▁of▁sentence｜>")
    server.policy.queue += [first, final]
    result = agents.Runner.run_sync(agent, "Read a")
    assert seen == ["a"] and result.final_output == "Done."
    store = TraceStore(traces)
    one, two = store.session_calls(session)
    tree = store.tree(session)
    assert tree.nodes[one.response].token_ids == first and tree.nodes[two.response].token_ids == final
    assert tree.path(two.context)[:2] == [one.context, one.response]


def test_concurrent_sessions_of_one_group_share_their_trunk(server, traces):
    """Four rollouts of one task at once (the engine batches them): one tree, the shared first
    answer stored once, each session's sample its own calls' exact ids."""
    from concurrent.futures import ThreadPoolExecutor

    def rollout(member: int) -> list[list[int]]:
        client, messages, prompts = oa(server, f"together@{member}"), [{"role": "user", "content": "Task."}], []
        for turn in range(2):
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                               seed=turn if turn == 0 else 100 + member,
                                               extra_body={"ignore_eos": True})
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Next."}]
        return messages

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rollout, range(4)))
    store = TraceStore(traces)
    tree = store.tree("together")
    assert len(tree.roots) == 1 and len(tree.calls) == 8
    firsts = {c.response for c in tree.calls if c.call == 0}
    assert len(firsts) == 1  # the same first answer (same seed, same prompt): one node for all four
    samples = list(read_samples(traces, ["together"]))
    assert sorted(s.session for s in samples) == [f"together@{m}" for m in range(4)]
    for sample in samples:
        (last,) = [c for c in store.session_calls(sample.session) if c.call == 1]
        assert len(sample.token_ids) == last.prompt_tokens + last.output_tokens  # its last call, whole
        assert sample.loss_mask.sum() == 8


def test_sessions_sharing_part_of_a_context_share_its_tokens(server, traces):
    """Two sessions of one group whose first messages differ only at the end: the stored context
    node is split between two tokens, both sessions' prompts hold the same stored front ids, and
    the first session's sample reads back unchanged from disk."""
    task = "You are an agent. Sort the list [3, 1, 2] and then"
    r = oa(server, "split@0").chat.completions.create(model="tiny", max_tokens=3, messages=[
        {"role": "user", "content": task + " report the result."}])
    (before,) = read_samples(traces, ["split"])
    oa(server, "split@1").chat.completions.create(model="tiny", max_tokens=3, messages=[
        {"role": "user", "content": task + " explain each step."}])
    tree = TraceStore(traces).tree("split")
    (root,) = tree.roots
    front = tree.nodes[root]
    assert front.kind == "context" and len(front.children) == 2 and "Sort the list" in front.text
    samples = {s.session: s for s in read_samples(traces, ["split"])}
    assert np.array_equal(samples["split@0"].token_ids, before.token_ids)
    assert np.array_equal(samples["split@0"].loss_mask, before.loss_mask)
    n = len(front.token_ids)
    assert list(samples["split@1"].token_ids[:n]) == front.token_ids == list(before.token_ids[:n])
    flat, stored = TraceStore(traces).token_counts("split")
    closing = sum(len(node.token_ids) for node in tree.nodes.values() if node.parent in tree.nodes
                  and tree.nodes[node.parent].kind == "response")  # end-of-message after a length stop
    # the shared front once; the model may end its answer early (a sampled end-of-sentence), so the
    # answer's length is only bounded by max_tokens
    assert stored == flat - n + closing and 1 <= r.usage.completion_tokens <= 3


def test_a_split_interrupted_before_its_arrays_were_rewritten_reads_back_whole(tmp_path):
    store = TraceStore(tmp_path)
    node = store.add_node("g", -1, "context", "abcdef", [1, 2, 3])
    saved = (tmp_path / "g" / "nodes" / f"{node}.npz").read_bytes()  # the arrays before the split
    front = store.split("g", node, 1, 2, -1)
    (tmp_path / "g" / "nodes" / f"{node}.npz").write_bytes(saved)  # a crash before the rewrite
    for reread in (TraceStore(tmp_path).tree("g"), store.tree("g")):
        assert reread.roots == [front] and reread.nodes[front].children == [node]
        assert (reread.nodes[front].text, reread.nodes[front].token_ids) == ("ab", [1])
        assert (reread.nodes[node].text, reread.nodes[node].token_ids) == ("cdef", [2, 3])


def test_session_endpoints_without_a_trace_store_say_how_to_get_one(loaded):
    srv = start_server(loaded)
    try:
        with pytest.raises(anthropic.NotFoundError) as err:
            an(srv, "s1").messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert err.value.response.json()["error"]["type"] == "not_found_error"
        assert "--gateway-traces" in err.value.response.json()["error"]["message"]
        assert an(srv).messages.create(model="tiny", max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}]).usage.output_tokens >= 1
    finally:
        srv.stop()


def test_a_store_reopened_after_a_torn_line_keeps_what_it_writes_next(tmp_path):
    """kill -9 mid-append leaves a torn last line; the restarted server's next event must not be
    glued onto it (it, and every node under it, would be unreadable)."""
    store = TraceStore(tmp_path)
    first = store.add_node("g", -1, "context", "ab", [1, 2])
    with open(tmp_path / "g" / "trace.jsonl", "a") as handle:
        handle.write('{"event": "node", "id": 7, "par')  # the crash
    reopened = TraceStore(tmp_path)
    second = reopened.add_node("g", first, "response", "cd", [3, 4])
    third = reopened.add_node("g", second, "context", "ef", [5])
    tree = TraceStore(tmp_path).tree("g")
    assert sorted(tree.nodes) == [first, second, third]
    assert tree.path(third) == [first, second, third]


def test_a_write_that_fails_mid_line_leaves_no_torn_line_or_temporary_file(tmp_path):
    """A full disk (here: the file-size limit) mid-write: the call fails, the store stays readable
    and what is written once space is back reads back."""
    import resource
    import signal

    store = TraceStore(tmp_path)
    first = store.add_node("g", -1, "context", "ab" * 2000, [1, 2])  # a long line: the next arrays fit
    log = tmp_path / "g" / "trace.jsonl"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        store_size = log.stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (store_size + 20, hard))
        with pytest.raises(OSError):  # the arrays fit, the event line does not
            store.add_node("g", first, "response", "cd" * 100, list(range(10)))
        assert log.read_text().endswith("\n")  # no torn line for the next event to be glued onto
        with pytest.raises(OSError):  # the arrays themselves do not fit
            store.add_node("g", first, "response", "x", list(range(10_000)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert log.read_text().endswith("\n")
    assert not [p.name for p in (tmp_path / "g" / "nodes").iterdir() if p.name.endswith(".tmp")]
    second = store.add_node("g", first, "response", "cd" * 100, list(range(10)))
    tree = TraceStore(tmp_path).tree("g")
    assert tree.path(second) == [first, second] and len(tree.nodes[second].token_ids) == 10


def test_a_trace_store_that_cannot_write_answers_in_the_protocols_shape(server):
    """A full disk under --gateway-traces (here: the file-size limit) is the protocol's own error
    — Anthropic's object, an error event mid-stream —, not an OpenAI-shaped 500 or a dropped
    connection; once space is back the session records again."""
    import resource
    import signal

    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "disk full?"}]}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
        plain = httpx.post(f"{server.url}/sessions/full-1/v1/messages", json=body, timeout=60)
        with httpx.stream("POST", f"{server.url}/sessions/full-1/v1/messages", json={**body, "stream": True},
                          timeout=60) as streamed:
            lines = list(streamed.iter_lines())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert plain.status_code == 503 and plain.json()["type"] == "error", plain.text
    assert "trace store" in plain.json()["error"]["message"]
    assert "event: error" in lines and "trace store" in lines[lines.index("event: error") + 1], lines[-3:]
    again = httpx.post(f"{server.url}/sessions/full-1/v1/messages", json=body, timeout=60)
    assert again.status_code == 200 and len(TraceStore(server.state.config.gateway_traces).session_calls("full-1")) == 1


def test_a_plain_gateway_client_that_leaves_is_aborted_without_an_error(server, caplog):
    """A non-streaming /v1/messages or /v1/responses client that times out: its request is
    aborted, and the server logs no failure (it was logged as a 500 with a traceback)."""
    import logging

    engine = server.state.backend.engine
    body = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "x"}]}
    with caplog.at_level(logging.INFO, logger="megatron_s2.serve"):
        for path, payload in (("/v1/messages", body), ("/sessions/left-1/v1/responses",
                                                       {"model": "tiny", "input": "x", "max_output_tokens": 200})):
            engine.pause()
            try:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{server.url}{path}", json=payload, timeout=1.0)
                deadline = time.monotonic() + 30
                while httpx.get(f"{server.url}/stats", timeout=10).json()["open_requests"]:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            finally:
                engine.resume()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert TraceStore(server.state.config.gateway_traces).session_calls("left-1") == []


def test_responses_structured_output_is_refused_not_ignored():
    """``text.format`` json_schema / json_object asks for structured output, which the engine does
    not constrain: a 400 naming it (as ``response_format`` on chat), never a free-text answer."""
    from megatron_s2.serve.errors import BadRequest
    from megatron_s2.serve.fields import Fields
    from megatron_s2.serve.gateway.responses_protocol import responses_turn

    for fmt in ({"type": "json_schema", "name": "x", "schema": {"type": "object"}}, {"type": "json_object"}):
        with pytest.raises(BadRequest, match=r"^text.format"):
            responses_turn(Fields({"input": "x", "text": {"format": fmt}}))
    with pytest.raises(BadRequest, match=r"^text"):
        responses_turn(Fields({"input": "x", "text": "json"}))
    assert responses_turn(Fields({"input": "x", "text": {"format": {"type": "text"}}})).messages
    assert responses_turn(Fields({"input": "x", "text": {"verbosity": "low"}})).messages


def test_a_split_between_a_calls_plan_and_record_keeps_its_routing_rows_in_place(server, tok, tmp_path):
    """R3 under concurrent calls of one group: call A is planned, call B splits a context node on
    A's path (B shares only its first part) and is recorded, then A is recorded. Every position of
    A's branch must hold the experts the engine routed for that token; before the fix A filled its
    reused nodes at the offsets of its planned path, which the split had shifted."""
    from megatron_s2.inference.sampling import SamplingParams
    from megatron_s2.serve.fields import Fields
    from megatron_s2.serve.gateway.conversation import Turn, assistant_message
    from megatron_s2.serve.gateway.tito import Capture

    engine, capture = server.state.backend.engine, Capture(TraceStore(tmp_path))

    def turn(messages):
        return Turn("chat", messages, None, Fields({}), ("max_tokens",), False, "messages")

    def plan(messages, session):
        return capture.plan(tok, turn(messages), session, lambda text: None)

    def run(p):
        params = SamplingParams(max_tokens=4, seed=0, ignore_eos=True, record_routing=True)
        return engine.submit(p.ids, params).result()

    def record(messages, p, result):
        message = assistant_message(tok.decode(result.token_ids), "", [])
        return capture.record(tok, turn(messages), p, message, result, "length")

    task = "You are an agent. Sort the list [3, 1, 2] and then"
    first = [{"role": "user", "content": task + " report the result."}]
    p0 = plan(first, "race@0")
    r0 = run(p0)
    record(first, p0, r0)
    second = first + [assistant_message(tok.decode(r0.token_ids), "", []), {"role": "user", "content": "Next."}]
    pa = plan(second, "race@0")  # A: reuses the first prompt's context node and response
    ra = run(pa)
    other = [{"role": "user", "content": task + " explain each step."}]
    pb = plan(other, "race@1")
    assert pb.cut is not None and pb.cut[0] == pa.path[0]  # B shares only the front of A's first node
    record(other, pb, run(pb))
    record(second, pa, ra)

    (sample,) = [s for s in read_samples(tmp_path, ["race"]) if s.session == "race@0"]
    fed = len(ra.prompt_token_ids) + len(ra.token_ids) - 1
    assert list(sample.token_ids) == pa.ids + ra.token_ids
    routed = ra.routed_experts.numpy()
    assert [p for p in range(fed) if not np.array_equal(sample.experts[p], routed[p])] == []
    assert (sample.experts[fed:] == -1).all()  # only the last sampled token was never fed


def test_a_split_while_a_call_is_planned_does_not_drop_prompt_tokens(server, tok, tmp_path):
    """Another call of the group records (and splits a node on this call's matched path) right
    after the match, on its own thread: the prompt must still hold every stored id of the path.
    Before the fix the plan read the nodes' ids after the split, so the split-off front was lost."""
    import threading

    from megatron_s2.inference.sampling import SamplingParams
    from megatron_s2.serve.fields import Fields
    from megatron_s2.serve.gateway.conversation import Turn, assistant_message
    from megatron_s2.serve.gateway.tito import Capture

    engine, store = server.state.backend.engine, TraceStore(tmp_path)
    capture = Capture(store)

    def turn(messages):
        return Turn("chat", messages, None, Fields({}), ("max_tokens",), False, "messages")

    def run(p):
        return engine.submit(p.ids, SamplingParams(max_tokens=3, seed=0, ignore_eos=True, record_routing=True)).result()

    def record(messages, p, result):
        capture.record(tok, turn(messages), p, assistant_message(tok.decode(result.token_ids), "", []), result,
                       "length")

    task = "You are an agent. Sort the list [3, 1, 2] and then"
    first = [{"role": "user", "content": task + " report the result."}]
    p0 = capture.plan(tok, turn(first), "plan@0", lambda text: None)
    r0 = run(p0)
    record(first, p0, r0)
    other = [{"role": "user", "content": task + " explain each step."}]
    pb = capture.plan(tok, turn(other), "plan@1", lambda text: None)
    rb = run(pb)
    b = threading.Thread(target=record, args=(other, pb, rb))
    matched = store.longest_prefix

    def longest_prefix(*args, **kwargs):  # B records from another thread just after A's match
        out = matched(*args, **kwargs)
        if not b.is_alive() and b.ident is None:
            b.start()
            b.join(timeout=2.0)  # a plan holding the store's lock makes B wait for it instead
        return out

    store.longest_prefix = longest_prefix
    second = first + [assistant_message(tok.decode(r0.token_ids), "", []), {"role": "user", "content": "Next."}]
    pa = capture.plan(tok, turn(second), "plan@0", lambda text: None)
    b.join()
    stored = p0.ids + r0.token_ids
    assert pa.ids[:len(stored)] == stored
    assert len(store.tree("plan").roots) == 1 and store.tree("plan").nodes[pb.cut[0]].parent != -1  # B did split


def test_a_rollout_session_without_seeds_is_seeded_from_its_episode(server, traces):
    """An RL rollout's session (``ServerState.session_seeds``) whose harness sends no seed: call k
    samples with call_seed(the episode's seed, k) — two episodes of one seed play the same tokens,
    another seed other ones, and a seed the request sends wins."""
    from megatron_s2.serve.gateway.turn import session_call_seed

    def episode(session: str, seed: int | None = None) -> list[list[int]]:
        client, messages = oa(server, session), [{"role": "user", "content": "Seeded."}]
        for _ in range(2):
            extra = {"seed": seed} if seed is not None else {}
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=1.0,
                                               extra_body={"ignore_eos": True}, **extra)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        store = TraceStore(traces)
        tree = store.tree(session.split("@")[0])
        return [tree.nodes[c.response].token_ids for c in store.session_calls(session)]

    seeds = server.state.session_seeds
    seeds.update({"seeded@0": 77, "seeded@1": 77, "seeded@2": 78, "seeded@3": 77})
    try:
        first, again, other = episode("seeded@0"), episode("seeded@1"), episode("seeded@2")
        sent = episode("seeded@3", seed=session_call_seed(78, 0))  # the request's seed, both calls
    finally:
        seeds.clear()
    assert first == again and first != other
    assert sent[0] == other[0] and sent[1] != other[1]
