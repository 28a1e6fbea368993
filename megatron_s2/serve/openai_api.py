"""``/v1/completions`` and ``/v1/chat/completions`` as OpenAI (and vLLM) answer them.

Both accept ``n``, ``stream`` (server-sent events: one ``data: {chunk}`` per generated step,
then ``data: [DONE]``; ``stream_options.include_usage`` adds a final usage chunk with no
choices), ``logprobs`` (completions: an integer top-N; chat: ``logprobs: true`` and
``top_logprobs: N``) and the sampling fields of :mod:`megatron_s2.serve.sampling`.

Token-in / token-out, so a trainer never re-tokenises text:

* ``/v1/completions`` takes ``prompt`` as text, a list of texts, a list of token ids or a list
  of token-id lists (text is encoded with the run's tokenizer after ``<bos>``; token ids are
  used verbatim);
* ``return_token_ids: true`` (vLLM's field) adds the completion's ``token_ids`` to every
  choice (every chunk when streaming), the ``prompt_token_ids`` (per choice for completions,
  at the top for chat, as vLLM places them) and our extension ``policy_versions``: the policy
  version of the weights that produced each token (report §5.2.3);
* ``return_tokens_as_token_ids: true`` names tokens ``token_id:N`` in log-prob records;
* ``prompt_logprobs: k`` (vLLM's extra field; completions, not streamed) adds
  ``choices[i].prompt_logprobs`` (:mod:`megatron_s2.serve.prompt_logprobs`).

The log-prob values of sampled tokens follow ``ServeConfig.logprobs_mode`` (vLLM's
``--logprobs-mode``, default ``raw_logprobs``: the model's distribution before temperature, top-k
and top-p; ``processed_logprobs``: the distribution the token was drawn from).
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from megatron_s2.inference.request import CompletedRequest
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.chat import chat_prompt_ids
from megatron_s2.serve.errors import HTTPError
from megatron_s2.serve.fields import Fields, check_token_ids, read_json_object
from megatron_s2.serve.prompt_logprobs import prompt_logprobs, read_prompt_logprobs
from megatron_s2.serve.sampling import build_sampling, refuse_unsupported_sampling
from megatron_s2.serve.state import SSE_DONE, ServerState, new_id, sse
from megatron_s2.serve.text import TextStream, chat_logprobs, completion_logprobs

__all__ = ["completions", "chat_completions"]


class _Options:
    """The per-request output options shared by both endpoints."""

    def __init__(self, f: Fields, state: ServerState, chat: bool):
        self.n = f.int("n", 1, minimum=1, maximum=state.config.max_n)
        self.stream = f.bool("stream")
        if chat:
            wants = f.bool("logprobs")
            top = f.int("top_logprobs", 0, minimum=0, maximum=state.config.max_logprobs)
            if top and not wants:
                f.fail("top_logprobs", "needs logprobs: true")
            self.logprobs = top if wants else None
        else:
            self.logprobs = f.int("logprobs", None, minimum=0, maximum=state.config.max_logprobs)
        self.token_ids = f.bool("return_token_ids")
        self.as_ids = f.bool("return_tokens_as_token_ids")
        self.usage_chunk = self.stream and f.object("stream_options").bool("include_usage")
        best_of = f.int("best_of", None)
        if best_of is not None and best_of != self.n:
            f.fail("best_of", "not supported by this server (set it equal to n or leave it out)")
        refuse_unsupported_sampling(f)


Choice = tuple[int, list[int], SamplingParams]
"""One engine request of an HTTP request: (choice index, prompt ids, sampling parameters)."""


def _choices(state: ServerState, f: Fields, prompts: list[list[int]], opts: _Options, prompt_field: str,
             max_tokens_keys=("max_tokens",), default_max_tokens: int | None = None) -> list[Choice]:
    """Every choice's sampling parameters, validated (context length, limits) before the request
    costs anything: choice ``p * n + j`` is sample ``j`` of prompt ``p``."""
    state.refuse_unqueueable(len(prompts) * opts.n, "n" if len(prompts) == 1 else prompt_field)
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(opts.n):
            params = build_sampling(f, prompt_len=len(prompt), max_model_len=state.max_model_len,
                                    vocab_size=state.vocab_size, logprobs=opts.logprobs or 0, strict_total=True,
                                    prompt_field=prompt_field, seed_offset=sample, max_tokens_keys=max_tokens_keys,
                                    default_max_tokens=default_max_tokens, max_stops=state.config.max_stops,
                                    logprobs_mode=state.config.logprobs_mode)
            choices.append((prompt_index * opts.n + sample, prompt, params))
    return choices


def _submit(gen: Generation, choices: list[Choice]) -> None:
    for tag, prompt, params in choices:
        gen.add(tag, prompt, params)


def _usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    """vLLM's usage: each prompt counted once, however many choices share it."""
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _reasons(state: ServerState, f: Fields):
    """``(finish_reason, stop_reason)`` of an output, as vLLM reports them: ``stop_reason`` is
    the stop string or requested stop token that ended the choice, None for end-of-sequence."""
    requested = set(f.token_ids("stop_token_ids", state.vocab_size))

    def reasons(out) -> tuple[str | None, str | int | None]:
        reason, why = getattr(out, "finish_reason", None), getattr(out, "stop_reason", None)
        if isinstance(why, int) and why == state.eos_token_id and why not in requested:
            why = None
        return (reason.value if reason is not None else None), why

    return reasons


async def _collect(gen: Generation, tags: list[int], prompts: list[list[int]], n: int) -> dict[int, CompletedRequest]:
    done = {tag: CompletedRequest(f"{gen.request_id}-{tag}", prompts[tag // n]) for tag in tags}
    async for tag, out in gen.events():
        done[tag].add(out)
    return done


def _error_stream(exc: HTTPError):
    yield sse(exc.body())
    yield SSE_DONE


# ---- /v1/completions --------------------------------------------------------------------------
def _event_stream(gen: Generation, chunks) -> StreamingResponse:
    """Server-sent events from ``chunks``; an engine error becomes an error event, a client that
    left ends the stream, and a cancelled stream frees its engine requests."""

    async def events():
        try:
            async for part in chunks:
                yield part
        except ClientDisconnected:
            return
        except HTTPError as exc:
            for part in _error_stream(exc):
                yield part
        finally:
            gen.abort()

    return StreamingResponse(events(), media_type="text/event-stream")


def _completion_prompts(f: Fields, state: ServerState) -> list[list[int]]:
    value = f.raw("prompt")
    if value is None or value == "" or value == []:
        f.fail("prompt", "required: a text, a list of texts, a list of token ids or a list of token-id lists")
    add_bos = f.bool("add_special_tokens", True)
    bos = [state.tokenizer.bos_id] if add_bos and getattr(state.tokenizer, "bos_id", None) is not None else []
    if isinstance(value, str):
        state.refuse_overlong_text([value], "prompt")
        return [bos + state.tokenizer.encode(value)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        for i, v in enumerate(value):
            state.refuse_overlong_text([v], f"prompt[{i}]")
        return [bos + state.tokenizer.encode(v) for v in value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [check_token_ids(value, state.vocab_size, "prompt")]
    if isinstance(value, list) and all(isinstance(v, list) for v in value):
        out = [check_token_ids(v, state.vocab_size, f"prompt[{i}]") for i, v in enumerate(value)]
        if any(not p for p in out):
            f.fail("prompt", "a token-id prompt must not be empty")
        return out
    f.fail("prompt", "must be a text, a list of texts, a list of token ids or a list of token-id lists")


async def completions(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    opts = _Options(f, state, chat=False)
    reasons_of = _reasons(state, f)
    f.refuse_unless_default("echo", False, "the prompt is not echoed; it is in prompt_token_ids with return_token_ids")
    f.refuse_unless_default("suffix", "", "insertion is not implemented")
    batch = f.raw("prompt")
    if isinstance(batch, list) and batch and all(isinstance(v, (str, list)) for v in batch):
        state.refuse_unqueueable(len(batch) * opts.n, "prompt")  # before tokenising every text
    # tokenising (and template rendering below) runs on a worker thread: the tokenizer releases
    # the GIL, so a long text does not stall the event loop that serves every other client
    prompts = await run_in_threadpool(_completion_prompts, f, state)
    scoring = read_prompt_logprobs(f, state.config.max_logprobs)
    if scoring is not None and opts.stream:
        f.fail("prompt_logprobs", "not returned when streaming; set stream: false")
    choices = _choices(state, f, prompts, opts, "prompt", default_max_tokens=16)  # OpenAI's default for completions
    scored = None
    if scoring is not None:  # after the checks, before any engine request: a failure leaves nothing to abort
        scored = await prompt_logprobs(state, prompts, scoring)
    stop = f.strings("stop")
    rid, created = new_id("cmpl"), int(time.time())
    gen = Generation(state.backend, rid, request, state.config.disconnect_poll_s)
    _submit(gen, choices)
    tags = list(range(len(prompts) * opts.n))
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    tok = state.tokenizer

    def logprobs_of(ids, lps, tops, offset):
        if opts.logprobs is None:
            return None
        return completion_logprobs(tok, ids, lps, tops, opts.logprobs, opts.as_ids, offset)

    if not opts.stream:
        try:
            done = await _collect(gen, tags, prompts, opts.n)
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)
        choices = []
        for tag in tags:
            r = done[tag]
            text = TextStream(tok, stop)
            text.push(r.token_ids)
            reason, why = reasons_of(r)
            choice = {"index": tag, "text": text.final_text(), "logprobs": logprobs_of(r.token_ids, r.logprobs,
                                                                                      r.top_logprobs, 0),
                      "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                choice.update(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids, policy_versions=r.versions)
            if scored is not None:
                choice["prompt_logprobs"] = scored[tag // opts.n]
            choices.append(choice)
        usage = _usage(prompts, sum(len(done[t].token_ids) for t in tags))
        return JSONResponse({**base, "choices": choices, "usage": usage})

    async def events():
        texts = {tag: TextStream(tok, stop) for tag in tags}
        first, generated = set(tags), 0
        async for tag, out in gen.events():
            text = texts[tag]
            offset = len(text.sent)
            delta = text.push(out.token_ids, last=out.finished)
            generated += len(out.token_ids)
            if not (delta or out.finished or opts.token_ids or opts.logprobs is not None):
                continue
            reason, why = reasons_of(out)
            choice = {"index": tag, "text": delta, "finish_reason": reason, "stop_reason": why,
                      "logprobs": logprobs_of(out.token_ids, out.logprobs, out.top_logprobs, offset)}
            if opts.token_ids:
                if tag in first:
                    choice["prompt_token_ids"] = prompts[tag // opts.n]
                choice.update(token_ids=out.token_ids, policy_versions=out.versions)
            first.discard(tag)
            yield sse({**base, "choices": [choice]})
        if opts.usage_chunk:
            yield sse({**base, "choices": [], "usage": _usage(prompts, generated)})
        yield SSE_DONE

    return _event_stream(gen, events())


# ---- /v1/chat/completions ---------------------------------------------------------------------
async def chat_completions(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    opts = _Options(f, state, chat=True)
    reasons_of = _reasons(state, f)
    for key in ("prompt_logprobs", "prompt_logprobs_temperature"):
        if f.has(key):
            f.fail(key, "prompt log-probs are returned by /v1/completions and /inference/v1/generate; send the "
                        "rendered token ids there")
    if f.has("tools") and f.raw("tools") != []:
        f.fail("tools", "tool calls are not parsed by this server; render tools client-side (renderers) and call "
                        "/inference/v1/generate")
    f.refuse_unless_default("response_format", {"type": "text"}, "structured output is not implemented")
    messages = f.raw("messages")
    if isinstance(messages, list) and len(messages) >= state.max_model_len:  # each renders at least a role marker
        f.fail("messages", f"{len(messages)} messages cannot fit this model's maximum context length of "
                           f"{state.max_model_len} tokens; send fewer")
    prompt = await run_in_threadpool(chat_prompt_ids, state.tokenizer, f, state.refuse_overlong_text)
    stop = f.strings("stop")
    rid, created = new_id("chatcmpl"), int(time.time())
    gen = Generation(state.backend, rid, request, state.config.disconnect_poll_s)
    _submit(gen, _choices(state, f, [prompt], opts, "messages", ("max_completion_tokens", "max_tokens")))
    tags = list(range(opts.n))
    base = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    tok = state.tokenizer

    def logprobs_of(out):
        if opts.logprobs is None:
            return None
        return chat_logprobs(tok, out.token_ids, out.logprobs, out.top_logprobs, opts.logprobs, opts.as_ids)

    if not opts.stream:
        try:
            done = await _collect(gen, tags, [prompt], opts.n)
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)
        choices = []
        for tag in tags:
            r = done[tag]
            text = TextStream(tok, stop)
            text.push(r.token_ids)
            reason, why = reasons_of(r)
            choice = {"index": tag, "message": {"role": "assistant", "content": text.final_text()},
                      "logprobs": logprobs_of(r), "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                choice.update(token_ids=r.token_ids, policy_versions=r.versions)
            choices.append(choice)
        body = {**base, "choices": choices,
                "usage": _usage([prompt], sum(len(done[t].token_ids) for t in tags))}
        if opts.token_ids:
            body["prompt_token_ids"] = prompt
        return JSONResponse(body)

    chunk = {**base, "object": "chat.completion.chunk"}

    async def events():
        texts = {tag: TextStream(tok, stop) for tag in tags}
        generated = 0
        for tag in tags:  # the role comes first, once per choice
            head = {**chunk, "choices": [{"index": tag, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if opts.token_ids and tag == 0:
                head["prompt_token_ids"] = prompt
            yield sse(head)
        async for tag, out in gen.events():
            text = texts[tag]
            delta = text.push(out.token_ids, last=out.finished)
            generated += len(out.token_ids)
            if not (delta or out.finished or opts.token_ids or opts.logprobs is not None):
                continue
            reason, why = reasons_of(out)
            choice = {"index": tag, "delta": {"content": delta} if delta else {}, "logprobs": logprobs_of(out),
                      "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                choice.update(token_ids=out.token_ids, policy_versions=out.versions)
            yield sse({**chunk, "choices": [choice]})
        if opts.usage_chunk:
            yield sse({**chunk, "choices": [], "usage": _usage([prompt], generated)})
        yield SSE_DONE

    return _event_stream(gen, events())
