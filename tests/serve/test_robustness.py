"""Robustness of the server: a full queue answers 429, a client that disconnects (streaming or
not) frees its request in the engine, a dead engine driver turns into 503 answers (in flight,
mid-stream and afterwards) instead of hangs, and bad command-line input exits 2 with one line.
The engine is paused where a test needs requests to stay in flight deterministically."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from megatron_s2.cli import main
from tests.serve.conftest import start_server

LONG = {"model": "tiny", "prompt": "x", "max_tokens": 240, "ignore_eos": True, "temperature": 1.0}


def stats(server) -> dict:
    return httpx.get(f"{server.url}/stats", timeout=10).json()


def wait_until(server, check, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        if check(s):
            return s
        assert time.monotonic() < deadline, f"timed out; last stats {s}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, max_num_seqs=2, max_waiting=2)
    yield srv
    srv.stop()


def test_a_full_queue_answers_429_and_leaving_clients_free_their_requests(server):
    engine = server.state.backend.engine
    pages = stats(server)["free_pages"]
    engine.pause()  # requests are accepted into the queue but not started
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as a, \
                    http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as b:
                assert a.status_code == b.status_code == 200
                wait_until(server, lambda s: s["waiting"] == 2)
                full = http.post("/v1/completions", json=LONG)
                assert full.status_code == 429 and full.json()["error"]["type"] == "RateLimitError"
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError, match="queue is full"):
                    client.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"})
            # both streaming clients left while queued: their requests are aborted and freed
            s = wait_until(server, lambda s: s["open_requests"] == 0)
            assert s["aborted"] == 2 and s["waiting"] == 0 and s["refused_queue_full"] == 2
    finally:
        engine.resume()
    assert stats(server)["free_pages"] == pages


def test_a_streaming_client_that_leaves_mid_generation_is_aborted(server):
    before = stats(server)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()  # (leaving this iterator early would close the connection)
            assert next(line for line in lines if line).startswith("data: {")  # a token arrived
            assert stats(server)["running"] == 1  # still generating; now the client leaves
    s = wait_until(server, lambda s: s["open_requests"] == 0 and s["running"] == 0)
    assert s["aborted"] == before["aborted"] + 1 and s["free_pages"] == before["free_pages"]


def test_a_plain_client_that_times_out_is_aborted(server):
    before = stats(server)
    server.state.backend.engine.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=1.0)
        s = wait_until(server, lambda s: s["open_requests"] == 0)
        assert s["aborted"] == before["aborted"] + 1 and s["waiting"] == 0
    finally:
        server.state.backend.engine.resume()
    # the same for the token endpoint, while the request is generating
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/inference/v1/generate", timeout=1.0,
                   json={"token_ids": [1, 5, 6], "sampling_params": {"max_tokens": 240, "ignore_eos": True}})
    s = wait_until(server, lambda s: s["open_requests"] == 0 and s["running"] == 0)
    assert s["aborted"] == before["aborted"] + 2 and s["free_pages"] == before["free_pages"]


def test_a_request_that_fails_alone_gets_500_and_the_server_goes_on(loaded, monkeypatch):
    """A request whose own stop check raises (the detokenizer fails on its text) is answered
    500 naming the error; a request beside it is unaffected and /health stays 200."""
    srv = start_server(loaded)
    try:
        engine = srv.state.backend.engine

        def detokenize(ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        monkeypatch.setattr(engine, "detokenize", detokenize)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            bad = http.post("/v1/completions", json={**body, "stop": ["zz"]})
            good = http.post("/v1/completions", json=body)
            assert bad.status_code == 500 and "UnicodeDecodeError" in bad.json()["error"]["message"]
            assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
            assert http.get("/health").status_code == 200
        s = wait_until(srv, lambda s: s["open_requests"] == 0 and s["running"] == 0)
        assert s["failed"] == 1
    finally:
        srv.stop()


def test_a_dead_engine_driver_turns_into_503s(loaded, monkeypatch):
    srv = start_server(loaded)
    try:
        engine = srv.state.backend.engine
        assert httpx.get(f"{srv.url}/health").status_code == 200
        engine.pause()
        answers = {}
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as streamed:
                worker = threading.Thread(target=lambda: answers.update(
                    plain=httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=60)))
                worker.start()
                wait_until(srv, lambda s: s["waiting"] == 2)

                def broken(*args, **kwargs):
                    raise RuntimeError("device lost")

                monkeypatch.setattr(engine.executor, "forward", broken)
                engine.resume()
                worker.join(timeout=60)
                events = streamed.read().decode().split("\n\n")
        plain = answers["plain"]
        assert plain.status_code == 503 and "device lost" in plain.json()["error"]["message"]
        assert '"code":503' in events[-3] and "device lost" in events[-3] and events[-2] == "data: [DONE]"
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]
        again = httpx.post(f"{srv.url}/inference/v1/generate", json={"token_ids": [1, 2]}, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        srv.stop()


def test_bad_command_line_input_exits_2_with_one_line(run_dir, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    cases = [
        (["/does/not/exist"], "checkpoint"),
        ([str(run_dir), "--port", str(port)], f"--port: {port} is already in use"),
        ([str(run_dir), "--host", "203.0.113.7"], "--host: 203.0.113.7 is not an address of this machine"),
        ([str(run_dir), "--port", "70000"], "--port"),
        ([str(run_dir), "--max-model-len", "0"], "--max-model-len"),
        ([str(run_dir), "--max-model-len", "1000000000"], "--max-model-len"),  # KV larger than memory
        ([str(run_dir), "--allowed-local-media-path", "/does/not/exist"],
         "--allowed-local-media-path: /does/not/exist is not a directory"),
        ([str(run_dir), "--max-images-per-request", "-1"], "--max-images-per-request: must be >= 0"),
        ([str(run_dir), "--gateway-traces", __file__], "--gateway-traces: "),
        # a store that cannot be created or written: refused at start, not a 500 on every session call
        ([str(run_dir), "--gateway-traces", f"{__file__}/traces"], "--gateway-traces: "),
        ([str(run_dir), "--gateway-traces", "/proc/megatron-s2-traces"], "--gateway-traces: "),
    ]
    try:
        for args, words in cases:
            assert main(["serve", *args]) == 2, args
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err
    finally:
        taken.close()


@pytest.mark.slow
def test_console_script_serves_a_converted_checkpoint_until_interrupted(run_dir, tmp_path):
    """A researcher's path: export to Hugging Face format, serve the export, chat with it; the
    served model id is the export directory, from which renderers loads the tokenizer."""
    from renderers.base import load_tokenizer

    export = tmp_path / "hf"
    assert main(["checkpoint", "export", str(run_dir), str(export), "--no-progress", "--no-verify"]) == 0
    exe = Path(sys.executable).with_name("megatron-s2")
    proc = subprocess.Popen([str(exe), "serve", str(export), "--port", "0", "--log-level", "warning",
                             "--device", "cpu"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url, lines = None, []
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"server exited: {''.join(lines)}"
            lines.append(line)
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        assert model == str(export)
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           extra_body={"return_token_ids": True})
        prompt = r.model_extra["prompt_token_ids"]
        assert load_tokenizer(model).apply_chat_template([{"role": "user", "content": "Hi"}],
                                                         add_generation_prompt=True, tokenize=True,
                                                         return_dict=False) == prompt
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode in (0, 130) and "Traceback" not in rest, rest


def test_a_request_larger_than_the_queue_can_ever_hold_is_a_400(server):
    """max_waiting=2: three choices could never be queued at once, so a 429 ("retry later")
    would be answered to every retry."""
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "a", "n": 3}, timeout=30)
    assert r.status_code == 400 and "exceed the 2 this server queues" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/inference/v1/generate", json={"token_ids": [1], "sampling_params": {"n": 3}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.n", r.text
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ["a", "b"], "n": 1},
                      timeout=60).status_code == 200
