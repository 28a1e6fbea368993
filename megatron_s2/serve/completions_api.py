"""``POST /v1/completions`` as OpenAI (and vLLM) answer it.

``prompt`` is a text, a list of texts, a list of token ids or a list of token-id lists (text is
encoded with the run's tokenizer after ``<bos>`` unless ``add_special_tokens: false``; token ids
are used verbatim). The request takes ``n``, ``stream`` (server-sent events, one
``data: {chunk}`` per generated step, then ``data: [DONE]``; ``stream_options`` adds usage at
the end or in every chunk), ``logprobs: N`` (each record holds the token and its N most likely
alternatives) and the sampling fields of :mod:`megatron_s2.serve.sampling`. vLLM's fields:

* ``echo: true`` puts the prompt before the completion in ``text`` and, with ``logprobs``, the
  prompt tokens' log-probs before the completion's (the first prompt token has none:
  ``null``). With ``max_tokens: 0`` nothing is generated — how evaluation harnesses (lm-eval's
  ``local-completions``) score the log-likelihood of a text;
* ``prompt_logprobs: k`` adds ``choices[i].prompt_logprobs``
  (:mod:`megatron_s2.serve.prompt_logprobs`; not when streaming);
* ``return_token_ids`` adds ``prompt_token_ids``, ``token_ids`` and our ``policy_versions`` (the
  weights' policy version of each token, report §5.2.3) to every choice (every chunk when
  streaming; the prompt in the first); ``return_tokens_as_token_ids`` names tokens
  ``token_id:N``;
* ``truncate_prompt_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``logprob_token_ids`` (:mod:`megatron_s2.serve.options`).

The log-prob values of sampled tokens follow ``ServeConfig.logprobs_mode`` (vLLM's
``--logprobs-mode``, default ``raw_logprobs``: the model's distribution before temperature, top-k
and top-p; ``processed_logprobs``: the distribution the token was drawn from).
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.fields import Fields, check_token_ids, read_json_object
from megatron_s2.serve.options import OutputOptions, Truncation, read_truncation, refuse_unsupported_fields
from megatron_s2.serve.prompt_logprobs import (PromptLogprobs, ScoredPrompt, format_prompt_logprobs,
                                                read_prompt_logprobs, score_prompts)
from megatron_s2.serve.responses import build_choices, collect, event_stream, finish_reasons, submit, usage
from megatron_s2.serve.sampling import check_prompt_length, refuse_unsupported_sampling
from megatron_s2.serve.state import SSE_DONE, ServerState, new_id, sse
from megatron_s2.serve.text import TextStream, completion_logprobs

__all__ = ["completions"]

_FIELDS_REFUSED_HERE = {"suffix": ("", "insertion (fill-in-the-middle) is not implemented")}


def _prompts(f: Fields, state: ServerState, truncation: Truncation | None) -> tuple[list[list[int]], list[str | None]]:
    """The prompts' token ids, and the text each was given as (None: token ids, or truncated)."""
    value = f.raw("prompt")
    if value is None or value == "" or value == []:
        f.fail("prompt", "required: a text, a list of texts, a list of token ids or a list of token-id lists")
    add_bos = f.bool("add_special_tokens", True)
    bos = [state.tokenizer.bos_id] if add_bos and getattr(state.tokenizer, "bos_id", None) is not None else []
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        texts = [value] if isinstance(value, str) else value
        for index, text in enumerate(texts):
            if truncation is None:  # truncation makes any length fit: vLLM tokenises it whole
                state.refuse_overlong_text([text], "prompt" if isinstance(value, str) else f"prompt[{index}]")
        ids = [bos + state.tokenizer.encode(text) for text in texts]
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids, texts = [check_token_ids(value, state.vocab_size, "prompt")], [None]
    elif isinstance(value, list) and all(isinstance(v, list) for v in value):
        ids = [check_token_ids(v, state.vocab_size, f"prompt[{i}]") for i, v in enumerate(value)]
        if any(not prompt for prompt in ids):
            f.fail("prompt", "a token-id prompt must not be empty")
        texts = [None] * len(ids)
    else:
        f.fail("prompt", "must be a text, a list of texts, a list of token ids or a list of token-id lists")
    if truncation is not None:
        truncated = [truncation.apply(prompt) for prompt in ids]
        texts = [text if len(cut) == len(prompt) else None for text, prompt, cut in zip(texts, ids, truncated)]
        ids = truncated
    return ids, texts


class _Echo:
    """The prompt part of each choice when ``echo`` is set: its text, and its log-prob records."""

    def __init__(self, state: ServerState, prompts: list[list[int]], texts: list[str | None],
                 scored: list[ScoredPrompt] | None, opts: OutputOptions):
        """``scored``: the prompts' values when ``logprobs`` is asked (None otherwise)."""
        # a prompt sent as text is echoed as sent (vLLM); token ids are decoded like generated text
        self.texts = [text if text is not None else
                      TextStream(state.tokenizer, keep_special=opts.keep_special).push(prompt, last=True)
                      for prompt, text in zip(prompts, texts)]
        self.records = [score.records() for score in scored] if scored is not None else None

    def text(self, prompt_index: int) -> str:
        return self.texts[prompt_index]

    def values(self, prompt_index: int) -> tuple[list, list]:
        """(values, top pairs) of the prompt's positions (``logprobs`` asked)."""
        return self.records[prompt_index]


async def completions(state: ServerState, request):
    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    opts = OutputOptions(f, state, chat=False)
    refuse_unsupported_sampling(f)
    refuse_unsupported_fields(f, _FIELDS_REFUSED_HERE)
    reasons_of = finish_reasons(state, f)
    truncation = read_truncation(f, state.max_model_len)
    echo_only = opts.echo and f.int("max_tokens", None, minimum=0) == 0  # score the prompt, generate nothing
    batch = f.raw("prompt")
    if isinstance(batch, list) and batch and all(isinstance(v, (str, list)) for v in batch):
        state.refuse_unqueueable(len(batch) * opts.n, "prompt")  # before tokenising every text
    # tokenising runs on a worker thread: the tokenizer releases the GIL, so a long text does not
    # stall the event loop that serves every other client
    prompts, texts = await run_in_threadpool(_prompts, f, state, truncation)
    asked = read_prompt_logprobs(f, state.max_logprobs, state.vocab_size)
    if asked is not None and opts.stream:
        f.fail("prompt_logprobs", "not returned when streaming; set stream: false")
    # every check before any work (the scoring forward, engine requests)
    if echo_only:  # validated as vLLM does, with one token to generate; nothing is submitted
        build_choices(state, Fields({**f.body, "max_tokens": 1}), prompts, opts, "prompt")
        choices = []
    else:
        choices = build_choices(state, f, prompts, opts, "prompt", default_max_tokens=16)  # OpenAI's default
    echo_scoring = PromptLogprobs(opts.num_top, 1.0) if opts.echo and opts.logprobs is not None else None
    scoring = asked or echo_scoring  # vLLM: an echoed prompt's log-probs are its prompt_logprobs
    scored = await score_prompts(state, prompts, scoring) if scoring is not None else None
    echo = _Echo(state, prompts, texts, scored, opts) if opts.echo else None
    rid, created = new_id("cmpl"), int(time.time())
    gen = Generation(state.backend, rid, request, state.config.disconnect_poll_s)
    submit(gen, choices)
    tags = list(range(len(prompts) * opts.n))
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    stop = f.strings("stop")
    tok = state.tokenizer

    def text_stream() -> TextStream:
        return TextStream(tok, stop, include_stop=opts.include_stop, keep_special=opts.keep_special)

    def logprobs_of(prompt_index: int, ids, values, tops, offset: int, with_prompt: bool):
        """A choice's (or chunk's) log-prob records; the echoed prompt's first when ``with_prompt``."""
        if opts.logprobs is None:
            return None
        if with_prompt:
            prompt_values, prompt_tops = echo.values(prompt_index)
            return completion_logprobs(tok, prompts[prompt_index] + list(ids), prompt_values + list(values),
                                       prompt_tops + list(tops), opts.num_top, opts.as_ids, 0)
        return completion_logprobs(tok, ids, values, tops, opts.num_top, opts.as_ids, offset)

    if not opts.stream:
        try:
            done = await collect(gen, tags, prompts, opts.n)
        except ClientDisconnected:
            return JSONResponse({}, status_code=499)
        answers = []
        for tag in tags:
            prompt_index = tag // opts.n
            result = done.get(tag) if not echo_only else None
            ids = result.token_ids if result is not None else []
            text = text_stream()
            text.push(ids)
            reason, why = reasons_of(result) if result is not None else ("length", None)
            answer = {"index": tag, "text": (echo.text(prompt_index) if echo else "") + text.final_text(),
                      "logprobs": logprobs_of(prompt_index, ids, result.logprobs if result else [],
                                              result.top_logprobs if result else [], 0, echo is not None),
                      "finish_reason": reason, "stop_reason": why}
            if opts.token_ids:
                answer.update(prompt_token_ids=prompts[prompt_index], token_ids=ids,
                              policy_versions=result.versions if result else [])
            if asked is not None:
                answer["prompt_logprobs"] = format_prompt_logprobs(tok, prompts[prompt_index], scored[prompt_index],
                                                                   asked.k)
            answers.append(answer)
        generated = 0 if echo_only else sum(len(done[tag].token_ids) for tag in tags)
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        return JSONResponse({**base, "choices": answers, "usage": usage(prompt_tokens, generated)})

    async def events():
        streams = {tag: text_stream() for tag in tags}
        generated = dict.fromkeys(tags, 0)
        first = set(tags)

        def chunk(tag: int, choice: dict) -> str:
            body = {**base, "choices": [choice]}
            if opts.usage.continuous:
                body["usage"] = usage(len(prompts[tag // opts.n]), generated[tag])
            return sse(body)

        if echo_only:
            for tag in tags:
                prompt_index = tag // opts.n
                choice = {"index": tag, "text": echo.text(prompt_index), "finish_reason": "length",
                          "stop_reason": None, "logprobs": logprobs_of(prompt_index, [], [], [], 0, True)}
                if opts.token_ids:
                    choice.update(prompt_token_ids=prompts[prompt_index], token_ids=[], policy_versions=[])
                yield chunk(tag, choice)
        async for tag, out in gen.events():
            prompt_index = tag // opts.n
            stream = streams[tag]
            echoed = echo is not None and tag in first
            offset = len(stream.sent) + (len(echo.text(prompt_index)) if echo else 0)
            delta = stream.push(out.token_ids, last=out.finished)
            generated[tag] += len(out.token_ids)
            if not (delta or echoed or out.finished or opts.token_ids or opts.logprobs is not None):
                continue
            reason, why = reasons_of(out)
            choice = {"index": tag, "text": (echo.text(prompt_index) if echoed else "") + delta,
                      "finish_reason": reason, "stop_reason": why,
                      "logprobs": logprobs_of(prompt_index, out.token_ids, out.logprobs, out.top_logprobs, offset,
                                              echoed)}
            if opts.token_ids:
                if tag in first:
                    choice["prompt_token_ids"] = prompts[prompt_index]
                choice.update(token_ids=out.token_ids, policy_versions=out.versions)
            first.discard(tag)
            yield chunk(tag, choice)
        if opts.usage.final:
            total = sum(generated.values())
            yield sse({**base, "choices": [], "usage": usage(sum(len(prompt) for prompt in prompts), total)})
        yield SSE_DONE

    return event_stream(gen, events())
