"""vLLM's ``logprobs_mode`` (``--logprobs-mode``): what the log-prob values of sampled tokens
are. The default is vLLM's, ``raw_logprobs`` — the model's own distribution, before temperature,
top-k and top-p; ``processed_logprobs`` is the distribution the token was drawn from (what an RL
trainer's importance weights need: the co-located rollout server pins it); the two ``*_logits``
modes report unnormalised values. Prompt log-probs (``prompt_logprobs``, ``echo``) are the raw
values in the logprob modes and the logits in the logits modes, as in vLLM."""

from __future__ import annotations

import httpx
import pytest
import torch

from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server

PROMPT = [0, 20, 21, 22, 23, 24]
SAMPLING = {"max_tokens": 6, "temperature": 0.7, "top_k": 5, "seed": 3, "logprobs": 2}


def expected_values(model, ids: list[int], mode: str) -> torch.Tensor:
    """[positions, vocab] values of ``mode`` for the completion ``ids`` after ``PROMPT``."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids]))[0, len(PROMPT) - 1:-1].double()
    if mode.startswith("raw"):
        return torch.log_softmax(logits, -1) if mode == "raw_logprobs" else logits
    scaled = logits / SAMPLING["temperature"]
    kth = scaled.topk(SAMPLING["top_k"], dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.log_softmax(scaled, -1) if mode == "processed_logprobs" else scaled


@pytest.mark.parametrize("mode", [None, "raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_sampled_token_values_follow_the_servers_logprobs_mode(loaded, mode):
    model, _, _ = loaded
    config = ServeConfig(disconnect_poll_s=0.05) if mode is None else ServeConfig(disconnect_poll_s=0.05,
                                                                                   logprobs_mode=mode)
    srv = start_server(loaded, serve=config)
    try:
        r = httpx.post(f"{srv.url}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": SAMPLING},
                       timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = choice["token_ids"]
        values = expected_values(model, ids, mode or "raw_logprobs")
        got = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]], dtype=torch.float64)
        want = values.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (mode, got, want)
        top = [int(t["token"].removeprefix("token_id:")) for t in choice["logprobs"]["content"][0]["top_logprobs"]]
        assert top == values[0].topk(2).indices.tolist()
        # prompt values: raw log-probs, or raw logits in the logits modes (temperature never applies)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0,
                                                         "temperature": 0.7}, timeout=120)
        entries = r.json()["choices"][0]["prompt_logprobs"]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT]))[0, :-1].double()
        raw = logits if (mode or "").endswith("logits") else torch.log_softmax(logits, -1)
        got = torch.tensor([entries[p][str(PROMPT[p])]["logprob"] for p in range(1, len(PROMPT))], dtype=torch.float64)
        assert torch.allclose(got, raw.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0], atol=1e-4)
    finally:
        srv.stop()


def test_serve_takes_logprobs_mode_from_the_command_line():
    from megatron_s2.cli import build_parser

    args = build_parser().parse_args(["serve", "ckpt"])
    assert args.logprobs_mode == "raw_logprobs"
    args = build_parser().parse_args(["serve", "ckpt", "--logprobs-mode", "processed_logprobs"])
    assert args.logprobs_mode == "processed_logprobs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "ckpt", "--logprobs-mode", "logits"])
