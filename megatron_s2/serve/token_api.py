"""``POST /inference/v1/generate``: vLLM's token-in / token-out endpoint, as RL clients call it.

This is what ``renderers.client.generate`` (and through it the ``verifiers`` training client,
``verifiers.v1.clients.train.TrainClient``) POSTs after rendering a chat to token ids
client-side. Request::

    {"model": str?, "token_ids": [int, ...],
     "sampling_params": {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                         "stop_token_ids", "ignore_eos", "logprobs": N,
                         "routed_experts_prompt_start": int, "return_routed_experts": bool,
                         "skip_special_tokens", ... (vLLM names; see _SAMPLING_FIELDS)},
     "request_id": str?, "cache_salt": str?, "priority": 0, "stream": false}

Response::

    {"request_id": str, "prompt_token_ids": [...],
     "choices": [{"index": i, "token_ids": [...], "finish_reason": "stop" | "length" | "abort",
                  "logprobs": {"content": [{"token": "token_id:N", "logprob": float,
                                            "top_logprobs": [{"token", "logprob"}, ...]}, ...]} | null,
                  "routed_experts": {"data": base64, "shape": [rows, layers, topk], "dtype": "uint8",
                                     "start": int} | null,
                  "policy_versions": [int, ...]}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
     "prompt_logprobs": [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...] | null,
     "kv_transfer_params": null}

``logprobs`` is present when ``sampling_params.logprobs`` is given (renderers always sends 1):
one entry per completion token, named ``token_id:<id>`` as renderers checks. ``routed_experts``
(Rollout Routing Replay, report §5.2.1) is the expert ids every MoE layer chose for every token
the model was fed — prompt and completion except the last sampled token, which no forward has
seen yet — from position ``routed_experts_prompt_start`` on: row ``i`` is position ``start + i``.
The bytes are the C-order array, little-endian, of the smallest unsigned type that holds the
expert ids (``dtype``; ``int16`` when a position has no record, -1: a decoder-bounded-replay or
prefix-cache position); ``"data"`` is the object's first key, as renderers' fast parser expects.
It is returned when the server runs with ``--enable-return-routed-experts`` or the request sets
``return_routed_experts``. ``policy_versions`` (our extension) is the policy version of the
weights that produced each token (§5.2.3). ``prompt_logprobs`` is returned when
``sampling_params.prompt_logprobs`` is given (:mod:`megatron_s2.serve.prompt_logprobs`; with
``max_tokens: 1`` a request scores a whole sequence, as a remote OPD teacher does).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from megatron_s2.inference.request import CompletedRequest
from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.fields import Fields, read_json_object
from megatron_s2.serve.prompt_logprobs import prompt_logprobs, read_prompt_logprobs
from megatron_s2.serve.sampling import build_sampling, refuse_unsupported_sampling
from megatron_s2.serve.state import ServerState, new_id
from megatron_s2.serve.text import chat_logprobs

__all__ = ["generate", "encode_routed_experts"]

# vLLM SamplingParams fields this endpoint understands (honoured, or checked to be neutral).
_SAMPLING_FIELDS = {
    "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "routed_experts_prompt_start", "return_routed_experts", "prompt_logprobs", "prompt_logprobs_temperature",
    # neutral values only (refuse_unsupported_sampling)
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "bad_words",
    "allowed_token_ids",
    # text-only options: the token endpoint returns no text
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
    "output_kind", "truncate_prompt_tokens",
}


def encode_routed_experts(rows: np.ndarray, start: int) -> dict:
    """The ``routed_experts`` object of a choice (module docstring)."""
    if rows.size and rows.min() < 0:
        dtype = np.dtype("<i2")
    elif not rows.size or rows.max() < 256:
        dtype = np.dtype("u1")
    else:
        dtype = np.dtype("<u2")
    data = np.ascontiguousarray(rows.astype(dtype))
    return {"data": base64.b64encode(data.tobytes()).decode("ascii"), "shape": list(data.shape),
            "dtype": dtype.name, "start": int(start)}


async def generate(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    prompt = f.token_ids("token_ids", state.vocab_size, required=True)
    if not prompt:
        f.fail("token_ids", "the prompt is empty")
    if f.bool("stream"):
        f.fail("stream", "this endpoint answers with one response; stream with /v1/completions and a token-id prompt")
    f.refuse_unless_default("priority", 0, "requests are served in arrival order")
    for key in ("features", "content_parts"):
        f.refuse_unless_default(key, None, "multimodal inputs are not supported")
    f.str("cache_salt")  # accepted: the prefix cache (off by default) is per server
    sp = f.object("sampling_params")
    sp.only(_SAMPLING_FIELDS)
    refuse_unsupported_sampling(sp)
    n = sp.int("n", 1, minimum=1, maximum=state.config.max_n)
    state.refuse_unqueueable(n, "sampling_params.n")
    logprobs = sp.int("logprobs", None, minimum=0, maximum=state.config.max_logprobs)
    start = sp.int("routed_experts_prompt_start", 0, minimum=0)
    if start >= len(prompt):
        sp.fail("routed_experts_prompt_start", f"must be smaller than the prompt length {len(prompt)}")
    routing = state.config.return_routed_experts or sp.bool("return_routed_experts")
    scoring = read_prompt_logprobs(sp, state.config.max_logprobs)
    rid = f.str("request_id") or new_id("gen")
    choices = [build_sampling(sp, prompt_len=len(prompt), max_model_len=state.max_model_len, vocab_size=state.vocab_size,
                              logprobs=logprobs or 0, strict_total=False, prompt_field="token_ids", seed_offset=sample,
                              record_routing=routing, max_stops=state.config.max_stops,
                              logprobs_mode=state.config.logprobs_mode)
               for sample in range(n)]  # checked (context length, limits) before the prompt is scored
    scored = None if scoring is None else (await prompt_logprobs(state, [prompt], scoring))[0]
    gen = Generation(state.backend, new_id(rid), request, state.config.disconnect_poll_s)
    for sample, params in enumerate(choices):
        gen.add(sample, prompt, params)
    done = {j: CompletedRequest(f"{rid}-{j}", prompt) for j in range(n)}
    try:
        async for tag, out in gen.events():
            done[tag].add(out)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    choices = []
    for j in range(n):
        r = done[j]
        choice = {"index": j, "token_ids": r.token_ids,
                  "finish_reason": r.finish_reason.value if r.finish_reason is not None else None,
                  "logprobs": None if logprobs is None else chat_logprobs(state.tokenizer, r.token_ids, r.logprobs,
                                                                          r.top_logprobs, logprobs, as_ids=True),
                  "routed_experts": None, "policy_versions": r.versions}
        if routing and r.routed_experts is not None:
            choice["routed_experts"] = encode_routed_experts(r.routed_experts[start:].cpu().numpy(), start)
        for entry in choice["logprobs"]["content"] if choice["logprobs"] else ():
            del entry["bytes"]  # vLLM's token endpoint names tokens by id only
            for top in entry["top_logprobs"]:
                del top["bytes"]
        choices.append(choice)
    completion = sum(len(c["token_ids"]) for c in choices)
    return JSONResponse({"request_id": rid, "prompt_token_ids": prompt, "choices": choices,
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                                   "total_tokens": len(prompt) + completion},
                         "prompt_logprobs": scored, "kv_transfer_params": None})
