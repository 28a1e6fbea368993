"""``POST /v1/chat/completions`` as OpenAI (and vLLM) answer it.

The conversation is rendered with the tokenizer's own chat template (:mod:`megatron_s2.serve.chat`,
including vLLM's ``continue_final_message`` and ``add_special_tokens``). The request takes ``n``,
``stream`` (a first chunk per choice with the role, then one per generated step; ``stream_options``
adds usage), ``logprobs: true`` + ``top_logprobs: N``, the sampling fields of
:mod:`megatron_s2.serve.sampling` and vLLM's fields:

* ``echo: true``: when the last message is the assistant's (``continue_final_message``), the
  answer's content starts with that message's content, as vLLM returns it;
* ``prompt_logprobs: k`` adds the top-level ``prompt_logprobs`` of the rendered prompt
  (:mod:`megatron_s2.serve.prompt_logprobs`; not when streaming);
* ``return_token_ids`` adds the top-level ``prompt_token_ids`` and each choice's ``token_ids`` and
  our ``policy_versions``; ``return_tokens_as_token_ids`` names tokens ``token_id:N``;
* ``truncate_prompt_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``logprob_token_ids`` (:mod:`megatron_s2.serve.options`).

Images: user messages may carry ``image_url`` parts (:mod:`megatron_s2.serve.chat`,
:mod:`megatron_s2.serve.media`); such a prompt is not truncated (``truncate_prompt_tokens`` would
cut an image's span) and gets no ``prompt_logprobs`` (they are scored without the images).
Series: ``time_series`` parts likewise, and the ``forecast`` extension returns the forecasting
branch's numbers as a top-level ``forecast`` list (:mod:`megatron_s2.serve.series`, Intern-S2 §2.2.2).

Tools: a request with ``tools`` is answered by the gateway's Chat Completions
(:mod:`megatron_s2.serve.gateway.chat_protocol`: tool schemas rendered by the chat template, tool
calls and reasoning parsed from the sampled ids, ``message.tool_calls``); a ``tool_choice`` other
than ``"none"`` without tools is refused (vLLM's rule). A request's own ``chat_template`` is refused
as vLLM refuses it by default, and ``documents`` (RAG input to a template) is refused too.
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.chat import chat_prompt_ids
from megatron_s2.serve.fields import Fields, read_json_object
from megatron_s2.serve.gateway.routes import gateway_chat
from megatron_s2.serve.options import OutputOptions, read_truncation, refuse_unsupported_fields
from megatron_s2.serve.prompt_logprobs import prompt_logprobs, read_prompt_logprobs
from megatron_s2.serve.responses import build_choices, collect, event_stream, finish_reasons, submit, usage
from megatron_s2.serve.sampling import refuse_unsupported_sampling
from megatron_s2.serve.series import forecast_entries, last_user_text
from megatron_s2.serve.state import SSE_DONE, ServerState, new_id, sse
from megatron_s2.serve.text import TextStream, chat_logprobs

__all__ = ["chat_completions"]

_FIELDS_REFUSED_HERE = {
    "chat_template": (None, "a request's own chat template is refused, as vLLM refuses it without "
                            "--trust-request-chat-template; the model's template is used"),
    "documents": (None, "this model's chat template takes no documents; put them in a message"),
}


def _refuse_tool_fields(f: Fields) -> None:
    choice = f.raw("tool_choice")
    if choice is not None and choice != "none":  # vLLM: any other tool_choice needs tools
        f.fail("tool_choice", "needs tools; declare them, or leave it out or send \"none\"")


def _echoed_content(f: Fields) -> str:
    """With ``echo``, the content the answer starts with: the last message's, if the assistant's."""
    messages = f.raw("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def chat_completions(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    if f.raw("tools") is not None:
        return await gateway_chat(state, request, f)
    state.check_model(f)
    opts = OutputOptions(f, state, chat=True)
    refuse_unsupported_sampling(f)
    refuse_unsupported_fields(f, _FIELDS_REFUSED_HERE)
    _refuse_tool_fields(f)
    reasons_of = finish_reasons(state, f)
    truncation = read_truncation(f, state.max_model_len)
    asked = read_prompt_logprobs(f, state.max_logprobs, state.vocab_size)
    if asked is not None and opts.stream:
        f.fail("prompt_logprobs", "not returned when streaming; set stream: false")
    messages = f.raw("messages")
    if truncation is None and isinstance(messages, list) and len(messages) >= state.max_model_len:
        f.fail("messages", f"{len(messages)} messages cannot fit this model's maximum context length of "
                           f"{state.max_model_len} tokens; send fewer")  # each renders at least a role marker
    # rendering and tokenising run on a worker thread, off the event loop every client shares; a
    # truncated prompt fits whatever its length (vLLM tokenises it whole)
    refuse_overlong = state.refuse_overlong_text if truncation is None else (lambda texts, field: None)
    series_spans: list = []
    prompt, images = await run_in_threadpool(chat_prompt_ids, state.tokenizer, f, refuse_overlong, state.images,
                                             state.series, series_spans)
    horizons = state.series.horizons(f.raw("forecast"), last_user_text(messages), [s.data for s in series_spans])
    if horizons is not None and opts.stream:
        f.fail("forecast", "not returned when streaming; set stream: false")
    if series_spans and truncation is not None:
        f.fail("truncate_prompt_tokens", "cannot be combined with time_series parts (it would cut a series' span); "
                                         "leave it out")
    if series_spans and asked is not None:
        f.fail("prompt_logprobs", "not computed for prompts with time_series parts; leave it out")
    if images and truncation is not None:
        f.fail("truncate_prompt_tokens", "cannot be combined with image parts (it would cut an image's span); "
                                         "leave it out")
    if images and asked is not None:
        f.fail("prompt_logprobs", "not computed for prompts with image parts; leave it out")
    if truncation is not None:
        prompt = truncation.apply(prompt)
    choices = build_choices(state, f, [prompt], opts, "messages", ("max_completion_tokens", "max_tokens"))
    scored = (await prompt_logprobs(state, [prompt], asked))[0] if asked is not None else None
    echoed = _echoed_content(f) if opts.echo else ""
    rid, created = new_id("chatcmpl"), int(time.time())
    gen = Generation(state.backend, rid, request, state.config.disconnect_poll_s)
    submit(gen, choices, images, series=series_spans, forecast=horizons)
    tags = list(range(opts.n))
    base = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    stop = f.strings("stop")
    tok = state.tokenizer

    def text_stream() -> TextStream:
        return TextStream(tok, stop, include_stop=opts.include_stop, keep_special=opts.keep_special)

    def logprobs_of(out):
        if opts.logprobs is None:
            return None
        return chat_logprobs(tok, out.token_ids, out.logprobs, out.top_logprobs, opts.num_top, opts.as_ids)

    if not opts.stream:
        try:
            done = await collect(gen, tags, [prompt], opts.n)
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)
        answers = []
        for tag in tags:
            result = done[tag]
            text = text_stream()
            text.push(result.token_ids)
            reason, why = reasons_of(result)
            answer = {"index": tag, "message": {"role": "assistant", "content": echoed + text.final_text()},
                      "logprobs": logprobs_of(result), "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                answer.update(token_ids=result.token_ids, policy_versions=result.versions)
            answers.append(answer)
        body = {**base, "choices": answers,
                "usage": usage(len(prompt), sum(len(done[tag].token_ids) for tag in tags))}
        if opts.token_ids:
            body["prompt_token_ids"] = prompt
        if scored is not None:
            body["prompt_logprobs"] = scored
        if horizons is not None:  # the forecasting branch's numbers (the choices share the prompt)
            body["forecast"] = forecast_entries(done[tags[0]].forecast or [], horizons)
        return JSONResponse(body)

    chunk_base = {**base, "object": "chat.completion.chunk"}

    async def events():
        streams = {tag: text_stream() for tag in tags}
        generated = dict.fromkeys(tags, 0)

        def chunk(tag: int, choice: dict, **extra) -> str:
            body = {**chunk_base, "choices": [choice], **extra}
            if opts.usage.continuous:
                body["usage"] = usage(len(prompt), generated[tag])
            return sse(body)

        for tag in tags:  # the role comes first, once per choice (then vLLM's echoed content)
            head = {"index": tag, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield chunk(tag, head, **({"prompt_token_ids": prompt} if opts.token_ids and tag == 0 else {}))
            if echoed:
                yield chunk(tag, {"index": tag, "delta": {"content": echoed}, "logprobs": None,
                                  "finish_reason": None})
        async for tag, out in gen.events():
            delta = streams[tag].push(out.token_ids, last=out.finished)
            generated[tag] += len(out.token_ids)
            if not (delta or out.finished or opts.token_ids or opts.logprobs is not None):
                continue
            reason, why = reasons_of(out)
            choice = {"index": tag, "delta": {"content": delta} if delta else {}, "logprobs": logprobs_of(out),
                      "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                choice.update(token_ids=out.token_ids, policy_versions=out.versions)
            yield chunk(tag, choice)
        if opts.usage.final:
            yield sse({**chunk_base, "choices": [], "usage": usage(len(prompt), sum(generated.values()))})
        yield SSE_DONE

    return event_stream(gen, events())
