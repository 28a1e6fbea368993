"""``POST /inference/v1/generate``: vLLM's token-in / token-out endpoint, as RL clients call it.

This is what ``renderers.client.generate`` (and through it the ``verifiers`` training client,
``verifiers.v1.clients.train.TrainClient``) POSTs after rendering a chat to token ids
client-side. Request::

    {"model": str?, "token_ids": [int, ...],
     "sampling_params": {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                         "stop_token_ids", "ignore_eos", "logprobs": N,
                         "routed_experts_prompt_start": int, "return_routed_experts": bool,
                         "banned_token_ids": [int]?, "required_token_id": int?,
                         "skip_special_tokens", ... (vLLM names; see _SAMPLING_FIELDS)},
     "request_id": str?, "cache_salt": str?, "priority": 0, "stream": false,
     "stream_options": {"include_usage", "continuous_usage_stats"}?}

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

``stream: true`` answers with server-sent events as vLLM does: ``data: {"request_id", "choices":
[{"index", "token_ids", "logprobs", "finish_reason", "routed_experts", "policy_versions"}]}`` per
step (a choice's new tokens; ``finish_reason`` and the choice's whole ``routed_experts`` on its
last event), a final ``{"request_id", "choices": [], "usage"}`` with
``stream_options.include_usage``, then ``data: [DONE]``; ``prompt_logprobs`` is not streamed.
``sampling_params.truncate_prompt_tokens`` keeps the prompt's last (``truncation_side: "right"``:
first) k tokens, as vLLM does. ``banned_token_ids`` / ``required_token_id`` (our extension, the
engine's masks of :func:`megatron_s2.inference.sampling.constrain_logits`): tokens never sampled,
and a token before which end-of-sequence and stop tokens are banned — how the agent gateway of a
disaggregated run sends a call's ``tool_choice`` ``none`` / ``required``
(:mod:`megatron_s2.serve.gateway.tool_choice`); the log-probs are then those of the masked
distribution sampled from, as in process.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
from fastapi.responses import JSONResponse

from megatron_s2.inference.request import CompletedRequest
from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.fields import Fields, read_json_object
from megatron_s2.serve.options import StreamUsage, read_stream_usage, read_truncation
from megatron_s2.serve.prompt_logprobs import prompt_logprobs, read_prompt_logprobs
from megatron_s2.serve.responses import event_stream, usage
from megatron_s2.serve.sampling import build_sampling, refuse_unsupported_sampling
from megatron_s2.serve.state import SSE_DONE, ServerState, new_id, sse
from megatron_s2.serve.text import chat_logprobs

__all__ = ["generate", "encode_routed_experts", "decode_routed_experts"]

# vLLM SamplingParams fields this endpoint understands (honoured, or checked to be neutral);
# any other key is refused by name.
_SAMPLING_FIELDS = {
    "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    "logprob_token_ids", "routed_experts_prompt_start", "return_routed_experts", "prompt_logprobs",
    "banned_token_ids", "required_token_id",  # our extension (module docstring): tool_choice masks
    "prompt_logprobs_temperature", "truncate_prompt_tokens", "truncation_side",
    # neutral values only (refuse_unsupported_sampling)
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "bad_words",
    "allowed_token_ids",
    # text-only options, neutral here: this endpoint returns token ids, no text
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
    "output_kind",
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


def decode_routed_experts(routed: dict) -> np.ndarray:
    """A choice's ``routed_experts`` object back as int32 rows [positions, layers, top-k] (the
    first row is position ``routed["start"]``): what a client of this endpoint reads."""
    rows = np.frombuffer(base64.b64decode(routed["data"]), dtype=np.dtype(routed["dtype"]))
    return rows.reshape(routed["shape"]).astype(np.int32)


def _token_logprobs(tokenizer, ids: list[int], values: list[float], tops, num_top: int) -> dict:
    """vLLM's token-endpoint log-prob records: chat records naming tokens by id, without bytes."""
    records = chat_logprobs(tokenizer, ids, values, tops, num_top, as_ids=True)
    for entry in records["content"]:
        del entry["bytes"]
        for top in entry["top_logprobs"]:
            del top["bytes"]
    return records


def _label_set(sp: Fields, state: ServerState, logprobs: int | None) -> tuple[int, ...]:
    """``sampling_params.logprob_token_ids`` (vLLM): these tokens' values instead of the top-N."""
    if sp.raw("logprob_token_ids") is None:
        return ()
    ids = sp.token_ids("logprob_token_ids", state.vocab_size)
    if not ids or len(ids) > state.max_logprobs:
        sp.fail("logprob_token_ids", f"must hold 1..{state.max_logprobs} token ids, got {len(ids)}")
    if logprobs is None:
        sp.fail("logprob_token_ids", "needs logprobs (an integer)")
    return tuple(ids)


def _token_masks(sp: Fields, vocab_size: int) -> dict:
    """``banned_token_ids`` / ``required_token_id`` (module docstring) as SamplingParams fields."""
    masks = {}
    banned = set()
    if sp.raw("banned_token_ids") is not None:
        masks["banned_token_ids"] = tuple(sp.token_ids("banned_token_ids", vocab_size))
        banned = set(masks["banned_token_ids"])
        if len(banned) >= vocab_size:  # nothing left to sample (greedy would pick a banned id)
            sp.fail("banned_token_ids", f"bans every one of the {vocab_size} token ids; leave at least one")
    required = sp.int("required_token_id", None, minimum=0, maximum=vocab_size - 1)
    if required is not None:
        if required in banned:  # the request could never end: EOS waits for a token that cannot come
            sp.fail("required_token_id", f"{required} is also in banned_token_ids")
        masks["required_token_id"] = required
    return masks


async def generate(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    prompt = f.token_ids("token_ids", state.vocab_size, required=True)
    if not prompt:
        f.fail("token_ids", "the prompt is empty")
    stream = f.bool("stream")
    stream_usage = read_stream_usage(f, stream)
    f.refuse_unless_default("priority", 0, "requests are served in arrival order; there is no priority scheduling")
    for key in ("features", "content_parts"):
        f.refuse_unless_default(key, None, "multimodal inputs are not supported")
    f.str("cache_salt")  # accepted: the prefix cache (off by default) is per server
    sp = f.object("sampling_params")
    sp.only(_SAMPLING_FIELDS)
    refuse_unsupported_sampling(sp)
    truncation = read_truncation(sp, state.max_model_len)
    if truncation is not None:
        prompt = truncation.apply(prompt)
    n = sp.int("n", 1, minimum=1, maximum=state.config.max_n)
    state.refuse_unqueueable(n, "sampling_params.n")
    logprobs = sp.int("logprobs", None, minimum=0, maximum=state.max_logprobs)
    label_set = _label_set(sp, state, logprobs)
    num_top = len(label_set) or (logprobs or 0)
    start = sp.int("routed_experts_prompt_start", 0, minimum=0)
    if start >= len(prompt):
        sp.fail("routed_experts_prompt_start", f"must be smaller than the prompt length {len(prompt)}")
    routing = state.config.return_routed_experts or sp.bool("return_routed_experts")
    scoring = read_prompt_logprobs(sp, state.max_logprobs, state.vocab_size)
    if scoring is not None and stream:
        sp.fail("prompt_logprobs", "not returned when streaming; set stream: false")
    rid = f.str("request_id") or new_id("gen")
    # every choice checked (context length, limits) before the prompt is scored
    choices = [build_sampling(sp, prompt_len=len(prompt), max_model_len=state.max_model_len,
                              vocab_size=state.vocab_size, logprobs=num_top, strict_total=False,
                              prompt_field="token_ids", seed_offset=sample, record_routing=routing,
                              max_stops=state.config.max_stops, logprobs_mode=state.config.logprobs_mode,
                              logprob_token_ids=label_set)
               for sample in range(n)]
    masks = _token_masks(sp, state.vocab_size)
    if masks:
        choices = [dataclasses.replace(params, **masks) for params in choices]
    scored = None if scoring is None else (await prompt_logprobs(state, [prompt], scoring))[0]
    gen = Generation(state.backend, new_id(rid), request, state.config.disconnect_poll_s)
    for sample, params in enumerate(choices):
        gen.add(sample, prompt, params)
    done = {sample: CompletedRequest(f"{rid}-{sample}", prompt) for sample in range(n)}

    def routed_experts_of(result: CompletedRequest) -> dict | None:
        if not routing or result.routed_experts is None:
            return None
        return encode_routed_experts(result.routed_experts[start:].cpu().numpy(), start)

    def logprobs_of(ids, values, tops) -> dict | None:
        return None if logprobs is None else _token_logprobs(state.tokenizer, ids, values, tops, num_top)

    if stream:
        return event_stream(gen, _stream(gen, done, rid, len(prompt), stream_usage, routed_experts_of, logprobs_of))
    try:
        async for tag, out in gen.events():
            done[tag].add(out)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    answers = []
    for sample in range(n):
        result = done[sample]
        answers.append({"index": sample, "token_ids": result.token_ids,
                        "finish_reason": result.finish_reason.value if result.finish_reason is not None else None,
                        "logprobs": logprobs_of(result.token_ids, result.logprobs, result.top_logprobs),
                        "routed_experts": routed_experts_of(result), "policy_versions": result.versions})
    completion = sum(len(answer["token_ids"]) for answer in answers)
    return JSONResponse({"request_id": rid, "prompt_token_ids": prompt, "choices": answers,
                         "usage": usage(len(prompt), completion), "prompt_logprobs": scored,
                         "kv_transfer_params": None})


async def _stream(gen: Generation, done: dict[int, CompletedRequest], rid: str, prompt_tokens: int,
                  stream_usage: StreamUsage, routed_experts_of, logprobs_of):
    """vLLM's streamed answer: one ``{"request_id", "choices": [one choice's delta]}`` event per
    step with new tokens (``finish_reason`` on a choice's last; our ``routed_experts`` of the
    whole choice there too), usage as ``stream_options`` asks, then ``[DONE]``."""
    generated = dict.fromkeys(done, 0)
    async for tag, out in gen.events():
        done[tag].add(out)
        generated[tag] += len(out.token_ids)
        if not out.token_ids and not out.finished:
            continue
        choice = {"index": tag, "logprobs": logprobs_of(out.token_ids, out.logprobs, out.top_logprobs),
                  "finish_reason": out.finish_reason.value if out.finish_reason is not None else None,
                  "token_ids": out.token_ids, "routed_experts": routed_experts_of(done[tag]) if out.finished else None,
                  "policy_versions": out.versions}
        event = {"request_id": rid, "choices": [choice]}
        if stream_usage.continuous:
            event["usage"] = usage(prompt_tokens, generated[tag])
        yield sse(event)
    if stream_usage.final:
        yield sse({"request_id": rid, "choices": [], "usage": usage(prompt_tokens, sum(generated.values()))})
    yield SSE_DONE
