"""Hostile and careless requests found by trying the server as a user would (review 13): each
one must be answered with a 4xx OpenAI error naming the problem — never a 500, never an engine
that stops serving every other client — and the server must stay healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, serve=ServeConfig(disconnect_poll_s=0.05, max_body_bytes=1 << 20))
    yield srv
    srv.stop()


def post(server, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=data, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def healthy(server) -> bool:
    ok = post(server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
    return ok.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"temperature": 1e-45, "top_p": 1e-300},
                                   {"temperature": 1e300}])
def test_extreme_sampling_values_do_not_kill_the_engine(server, extra):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "The cat", "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text
    assert healthy(server)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", '{"model": "tiny", "prompt": "caf\\udc80", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\udc80"], "max_tokens": 2}', "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, field):
    r = post(server, path, body.encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{field}: ") and "UTF-8" in error["message"], error
    assert healthy(server)


def test_deeply_nested_json_is_a_400(server):
    r = post(server, "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body"), r.text
    assert healthy(server)


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    big = {"model": "tiny", "prompt": "a " * (1 << 20), "max_tokens": 2}  # 2 MiB > the 1 MiB limit
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413, r.text
    assert "max_body_bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(4):
            yield b" " * (1 << 19)
    r = httpx.post(f"{server.url}/inference/v1/generate", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert healthy(server)


def test_an_export_whose_tokenizer_was_swapped_is_refused(run_dir, tmp_path, capsys):
    """The export's config.json states engram_compressed_vocab_size; `checkpoint import` checks
    it against the tokenizer beside the weights, and `generate` / `serve` must too (they served
    a swapped tokenizer silently: other token ids and other Engram hashes)."""
    from megatron_s2.cli import main
    from megatron_s2.data.bpe_training import synthetic_texts, train_bpe

    export = tmp_path / "hf"
    assert main(["checkpoint", "export", str(run_dir), str(export), "--no-progress", "--no-verify"]) == 0
    other = tmp_path / "other"
    train_bpe(synthetic_texts(100, 3), 400, other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (export / name).write_bytes((other / name).read_bytes())
    capsys.readouterr()
    assert main(["generate", str(export), "--prompt", "x", "--max-tokens", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engram_compressed_vocab_size" in err[0], err


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, "stop": [f"s{i}" for i in range(20000)]},
     "stop"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [5] * 200000}},
     "sampling_params.stop_token_ids"),
])
def test_absurd_stop_lists_are_refused(server, path, body, field):
    """Every stop entry is checked after every token on the engine thread all clients share:
    20,000 stop strings made one request take 50 s for 400 tokens."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{field}: at most 128 entries")


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenised(server):
    """A 15 MB prompt (under the body limit) was tokenised on the event loop: /health waited 44 s.
    A text longer than max_model_len tokens of the longest token's bytes cannot fit, whatever
    its tokenisation, and is refused at once; a shorter one is still counted exactly."""
    state = server.state
    assert state.max_token_bytes >= 1
    huge = "ab " * 200_000
    for path, body, field in [("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/completions", {"prompt": ["ok", huge]}, "prompt[1]"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")]:
        r = post(server, path, {"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: This model's maximum context length is 256 tokens") and "at least" in message
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 1000})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: 1000 messages cannot fit")
    near = "word " * 300  # over 256 tokens, under the byte bound: the exact count
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": near, "max_tokens": 2})
    assert r.status_code == 400 and "at least" not in r.json()["error"]["message"]
    assert len(near.encode()) <= state.max_model_len * state.max_token_bytes
    assert healthy(server)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hello"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_tokenising_a_request_does_not_stall_the_event_loop(server, monkeypatch, path, body):
    """Tokenisation ran on the event loop: while one request's text was being encoded (44 s for
    15 MB) /health and every stream waited. Here the tokenizer is held until /health answers,
    which it can only do if the encoding runs off the loop."""
    import threading

    tokenizer = server.state.tokenizer
    entered, release = threading.Event(), threading.Event()
    for name in ("encode", "apply_chat_template"):
        original = getattr(tokenizer, name)

        def held(*args, _original=original, **kwargs):
            entered.set()
            release.wait(30)
            return _original(*args, **kwargs)
        monkeypatch.setattr(tokenizer, name, held)
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(r=post(server, path, {"model": "tiny", "max_tokens": 2,
                                                                                   **body})))
    worker.start()
    try:
        assert entered.wait(30)  # the request is being tokenised now
        health = httpx.get(f"{server.url}/health", timeout=10)
    finally:
        release.set()
        worker.join(60)
    assert health.status_code == 200
    assert answer["r"].status_code == 200, answer["r"].text


# ---- review 14: a hostile run against `megatron-s2 serve` ----------------------------------------
BEYOND_FLOAT = "1" + "0" * 400  # a JSON integer no float can hold


@pytest.mark.parametrize("path,field,body", [
    ("/v1/completions", "temperature", '{"prompt": "a", "max_tokens": 2, "temperature": %s}'),
    ("/v1/completions", "top_p", '{"prompt": "a", "max_tokens": 2, "top_p": %s}'),
    ("/v1/completions", "prompt_logprobs_temperature",
     '{"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0, "prompt_logprobs_temperature": %s}'),
    ("/inference/v1/generate", "sampling_params.temperature",
     '{"token_ids": [1, 2], "sampling_params": {"temperature": %s}}'),
])
def test_an_integer_beyond_float_range_is_a_400_on_a_connection_that_stays_open(server, path, field, body):
    """``1`` followed by 400 zeros was a 500 OverflowError, and the keep-alive connection was
    then closed without ``Connection: close``: the client's next pooled request failed."""
    with httpx.Client(base_url=server.url, timeout=60) as http:  # one pooled keep-alive connection
        r = http.post(path, content=(body % BEYOND_FLOAT).encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: must be a finite number, got an integer of 401 digits"), message
        assert http.get("/health").status_code == 200  # the same connection serves the next request


def test_an_unexpected_error_is_a_500_that_keeps_the_connection_open(server, monkeypatch):
    """A 500 is the OpenAI error object, and the connection serves the next request (Starlette's
    catch-all handler re-raised after answering, and uvicorn then dropped the connection)."""
    import megatron_s2.serve.app as app_module

    async def broken(state, request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "completions", broken)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {"message": "internal error: RuntimeError: a bug", "type": "InternalServerError",
                                     "param": None, "code": 500}
        assert r.headers.get("connection") != "close"
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nope", 404), ("POST", "/completions", 404),
                                                ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)])
def test_unknown_paths_and_methods_answer_the_openai_error_object(server, method, path, status):
    """FastAPI's ``{"detail": "Not Found"}`` is not what an OpenAI client parses; vLLM answers
    the error object with the status phrase as its type."""
    from http import HTTPStatus

    r = httpx.request(method, f"{server.url}{path}", timeout=60)
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"}, body
    phrase = HTTPStatus(status).phrase
    assert body["error"]["type"] == phrase and body["error"]["code"] == status
    assert body["error"]["message"].startswith(f"{phrase}: {method} {path}"), body


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "a", "max_tokens": "x" * 500_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": ["x" * 100] * 5000}, "temperature"),
    ("/v1/completions", {"model": "m" * 500_000, "prompt": "a"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "r" * 500_000, "content": "x"}]}, "messages[0].role"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"k" * 500_000: 1}}, "sampling_params."),
])
def test_a_huge_wrongly_typed_value_is_not_echoed_whole(server, path, body, field):
    """A 15 MB wrongly-typed value came back verbatim in the 400 message."""
    r = post(server, path, {"model": "tiny", **body} if "model" not in body else body)
    assert r.status_code in (400, 404), r.text
    message = r.json()["error"]["message"]
    assert message.startswith(field) and len(message) < 1000, message[:1200]


@pytest.mark.parametrize("body,field", [
    ({"presence_penalty": False}, "presence_penalty"), ({"frequency_penalty": False}, "frequency_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"min_p": False}, "min_p"),
    ({"min_tokens": False}, "min_tokens"), ({"best_of": True}, "best_of"), ({"echo": 0}, "echo"),
])
def test_a_boolean_is_not_a_number_and_a_number_is_not_a_boolean(server, body, field):
    """``presence_penalty: false`` passed as the neutral 0 (``False == 0`` in Python)."""
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{field}: must be "), r.text


def test_an_integer_too_long_to_parse_is_a_400(server):
    """Python refuses to convert integers of more than 4,300 digits (a ValueError that is not
    a JSONDecodeError): it was a 500."""
    r = post(server, "/v1/completions", b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body: not valid JSON"), r.text
    assert healthy(server)


def test_a_client_that_leaves_mid_upload_is_not_an_error(server):
    """A client that disconnected while sending its body logged two ERROR tracebacks (ours and
    uvicorn's); it is an INFO line now."""
    import logging
    import socket
    import time

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.DEBUG)
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "megatron_s2.serve")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"prompt\": \"" + b"a" * 1000)
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while not any("left before" in r.getMessage() for r in records) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert any("left before" in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage()[:200] for r in records]
    assert healthy(server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [3 + i % 400 for i in range(300)], "max_tokens": 1, "prompt_logprobs": 0}),
    ("/v1/completions", {"prompt": [[1, 2, 3], [3 + i % 400 for i in range(300)]], "max_tokens": 1,
                         "prompt_logprobs": 0}),
    ("/inference/v1/generate", {"token_ids": [3 + i % 400 for i in range(300)],
                                "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}),
])
def test_prompt_logprobs_check_the_context_length_before_the_forward(server, monkeypatch, path, body):
    """30,000 prompt tokens were scored (111 s in which every client stalled, +1.5 GB) before
    the context-length check answered 400: the check comes first now."""
    import megatron_s2.serve.prompt_logprobs as scoring

    forwards = []
    monkeypatch.setattr(scoring, "_score_batch", lambda *args: forwards.append(args) or [])
    r = post(server, path, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    assert not forwards


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "ok", "reasoning_content": "thinking " * 40_000},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"x": "' + "y" * 400_000 + '"}'}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": {"x": "y" * 400_000}}}]},
])
def test_a_chat_over_the_context_is_refused_before_it_is_tokenised_whatever_field_holds_it(server, monkeypatch,
                                                                                            message):
    """The over-length pre-check counted only ``content``: 8 MB of reasoning or tool-call
    arguments were rendered and tokenised (26 s, +1.4 GB) before the 400."""
    tokenizer = server.state.tokenizer
    encoded = []
    original = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: encoded.append(len(text)) or original(text))
    chat = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "and now?"}]
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": 2})
    assert r.status_code == 400, r.text
    text = r.json()["error"]["message"]
    assert text.startswith("messages: This model's maximum context length is 256 tokens") and "at least" in text
    assert not encoded


def test_usage_counts_the_prompt_once_whatever_n(server):
    """``usage.prompt_tokens`` of /v1/completions was multiplied by ``n``; vLLM counts each
    prompt once (the choices share it)."""
    prompts = [[1, 40, 41], [1, 50, 51, 52, 53]]
    for stream in (False, True):
        body = {"model": "tiny", "prompt": prompts, "max_tokens": 2, "n": 3, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            usage = events[-1]["usage"]
        else:
            usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 3 + 5, usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
