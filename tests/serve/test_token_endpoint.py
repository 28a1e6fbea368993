"""vLLM's token endpoint ``POST /inference/v1/generate`` on the wire: the response shape RL
clients parse, log-probs equal to the model's own, routed experts equal to the routing a
training forward records (from ``routed_experts_prompt_start`` on), ``n`` choices, the
context-length rule of the token endpoint, and refusals naming the field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay
from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server

PROMPT = [0, 30, 31, 32, 33, 34, 35, 36]


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, serve=ServeConfig(return_routed_experts=True, disconnect_poll_s=0.05))
    yield srv
    srv.stop()


def post(server, body, status=200):
    r = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_response_shape_log_probs_and_routed_experts(server, loaded):
    model, _, _ = loaded
    body = {"model": "tiny", "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 7, "temperature": 1.0, "seed": 4, "logprobs": 1,
                                "skip_special_tokens": False, "stop_token_ids": [3]}}
    out = post(server, body)
    assert set(out) == {"request_id", "prompt_token_ids", "choices", "usage", "prompt_logprobs", "kv_transfer_params"}
    assert out["prompt_token_ids"] == PROMPT
    (choice,) = out["choices"]
    ids = choice["token_ids"]
    assert choice["finish_reason"] in ("stop", "length") and choice["policy_versions"] == [0] * len(ids)
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(len(e["top_logprobs"]) == 1 for e in content)
    fed = PROMPT + ids[:-1]
    record = RoutingReplay(RoutingMode.RECORD)
    with torch.no_grad():
        logits = model(torch.tensor([fed]), ForwardContext.create(torch.tensor([fed]), model.config.plan,
                                                                   routing=record))[0]
    ref = torch.log_softmax(logits[len(PROMPT) - 1:].double(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e["logprob"] for e in content], dtype=torch.float64), ref, atol=1e-4)
    routed = choice["routed_experts"]
    assert list(routed)[0] == "data" and routed["start"] == 0 and routed["dtype"] == "uint8"
    rows = np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"]).reshape(routed["shape"])
    expected = torch.stack([record.records()[layer][0][0] for layer in model.layer_ids], dim=1)
    assert rows.shape == (len(fed), len(model.layer_ids), model.config.moe_topk)
    assert np.array_equal(rows, expected.numpy())
    # the same request asking for routes from position 5 on gets the tail rows
    tail = post(server, {**body, "sampling_params": {**body["sampling_params"], "routed_experts_prompt_start": 5}})
    routed = tail["choices"][0]["routed_experts"]
    assert tail["choices"][0]["token_ids"] == ids and routed["start"] == 5
    assert np.array_equal(np.frombuffer(base64.b64decode(routed["data"]), np.uint8).reshape(routed["shape"]), rows[5:])


def test_n_choices_and_the_context_end(server):
    out = post(server, {"token_ids": PROMPT, "sampling_params": {"n": 2, "max_tokens": 4, "seed": 1,
                                                                 "ignore_eos": True}})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None and len(c["token_ids"]) == 4 for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 8, "total_tokens": len(PROMPT) + 8}
    # unlike the OpenAI endpoints, a max_tokens past the context end stops there
    long = post(server, {"token_ids": [5] * 250, "sampling_params": {"max_tokens": 100, "ignore_eos": True}})
    assert len(long["choices"][0]["token_ids"]) == 6 and long["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, words", [
    ({}, "token_ids: required"),
    ({"token_ids": []}, "token_ids: the prompt is empty"),
    ({"token_ids": [1, "a"]}, "token_ids: must be a list of integer token ids"),
    ({"token_ids": [5] * 256}, "token_ids: This model's maximum context length is 256 tokens"),
    ({"token_ids": [1, 2], "sampling_params": {"temprature": 1.0}}, "sampling_params.temprature: unknown field"),
    ({"token_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p: must be in (0, 1]"),
    ({"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 2}},
     "sampling_params.routed_experts_prompt_start: must be smaller than the prompt length 2"),
    ({"token_ids": [1, 2], "sampling_params": {"min_tokens": 3}}, "sampling_params.min_tokens: not supported"),
    ({"token_ids": [1, 2], "stream": "yes"}, "stream: must be true or false"),
    ({"token_ids": [1, 2], "sampling_params": "greedy"}, "sampling_params: must be an object"),
])
def test_refusals_name_the_field(server, body, words):
    error = post(server, body, status=400)["error"]
    assert error["message"].startswith(words), error


def test_banned_and_required_tokens_are_the_engines_masks(server, loaded):
    """``banned_token_ids`` / ``required_token_id`` (our extension: how a disaggregated run's
    agent gateway sends ``tool_choice`` none / required): a banned token is never sampled and the
    log-probs are those of the masked distribution; end-of-sequence and stop tokens wait for the
    required token."""
    model, tok, _ = loaded
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    free = post(server, {"token_ids": PROMPT, "sampling_params": greedy})["choices"][0]["token_ids"]
    banned = sorted(set(free))
    out = post(server, {"token_ids": PROMPT, "sampling_params": {**greedy, "banned_token_ids": banned}})["choices"][0]
    assert not set(out["token_ids"]) & set(banned) and len(out["token_ids"]) == 6
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), ForwardContext.create(torch.tensor([PROMPT]), model.config.plan))[0, -1]
    masked = logits.double().clone()
    masked[banned] = float("-inf")
    first = out["token_ids"][0]
    assert first == int(masked.argmax()) and np.isclose(out["logprobs"]["content"][0]["logprob"],
                                                        float(torch.log_softmax(masked, -1)[first]), atol=1e-4)
    # the first greedy token is the end: with another token required, the answer cannot stop before it
    eos = free[0]
    required = next(t for t in range(10, 500) if t not in free)
    out = post(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0.0,
                                                                 "stop_token_ids": [eos],
                                                                 "required_token_id": required}})["choices"][0]
    assert eos not in out["token_ids"][:-1] and (out["finish_reason"] == "length" or required in out["token_ids"])
    assert post(server, {"token_ids": PROMPT, "sampling_params": {"required_token_id": 10 ** 6}},
                status=400)["error"]["message"].startswith("sampling_params.required_token_id")


def test_masks_that_leave_nothing_to_sample_are_refused(server, loaded):
    """Found by a hostile try-out: banning every id gave a 500 (sampling) or banned tokens at
    log-prob -9999 (greedy), and a required token that is also banned never let the request end.
    Both are a 400 naming the field; the server keeps serving."""
    model, _, _ = loaded
    vocab = model.config.vocab_size
    for temperature in (1.0, 0.0):
        error = post(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": temperature,
                                                                       "banned_token_ids": list(range(vocab))}},
                     status=400)["error"]
        assert error["param"] == "sampling_params.banned_token_ids" and "every one" in error["message"], error
    error = post(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "required_token_id": 9,
                                                                   "banned_token_ids": [9]}}, status=400)["error"]
    assert error["param"] == "sampling_params.required_token_id" and "also in banned_token_ids" in error["message"]
    ok = post(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0,
                                                                "banned_token_ids": list(range(vocab - 1))}})
    assert ok["choices"][0]["token_ids"] == [vocab - 1, vocab - 1]
