"""What both OpenAI endpoints build their answers from: the engine requests of a request's
choices, usage, finish reasons, collected results and the server-sent event stream."""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from megatron_s2.inference.request import CompletedRequest
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.errors import HTTPError
from megatron_s2.serve.fields import Fields
from megatron_s2.serve.options import OutputOptions
from megatron_s2.serve.sampling import build_sampling
from megatron_s2.serve.state import SSE_DONE, ServerState, sse

__all__ = ["Choice", "build_choices", "submit", "usage", "finish_reasons", "collect", "event_stream"]

Choice = tuple[int, list[int], SamplingParams]
"""One engine request of an HTTP request: (choice index, prompt ids, sampling parameters)."""


def build_choices(state: ServerState, f: Fields, prompts: list[list[int]], opts: OutputOptions, prompt_field: str,
                  max_tokens_keys=("max_tokens",), default_max_tokens: int | None = None) -> list[Choice]:
    """Every choice's sampling parameters, validated (context length, limits) before the request
    costs anything: choice ``p * n + j`` is sample ``j`` of prompt ``p``."""
    state.refuse_unqueueable(len(prompts) * opts.n, "n" if len(prompts) == 1 else prompt_field)
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(opts.n):
            params = build_sampling(f, prompt_len=len(prompt), max_model_len=state.max_model_len,
                                    vocab_size=state.vocab_size, logprobs=opts.num_top, strict_total=True,
                                    prompt_field=prompt_field, seed_offset=sample, max_tokens_keys=max_tokens_keys,
                                    default_max_tokens=default_max_tokens, max_stops=state.config.max_stops,
                                    logprobs_mode=state.config.logprobs_mode,
                                    logprob_token_ids=opts.logprob_token_ids)
            choices.append((prompt_index * opts.n + sample, prompt, params))
    return choices


def submit(gen: Generation, choices: list[Choice], images: list | None = None, *, series: list | None = None,
           forecast: list[int] | None = None) -> None:
    """Queue every choice; ``images``: the prompt's image spans, shared by its choices (each
    image is embedded once however many choices read it); ``series`` / ``forecast``: its series
    spans and the horizons asked for (:mod:`megatron_s2.serve.series`)."""
    for tag, prompt, params in choices:
        gen.add(tag, prompt, params, images, series=series, forecast=forecast)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's usage object (a prompt is counted once, however many choices share it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reasons(state: ServerState, f: Fields):
    """``(finish_reason, stop_reason)`` of an output, as vLLM reports them: ``stop_reason`` is
    the stop string or requested stop token that ended the choice, None for end-of-sequence."""
    requested = set(f.token_ids("stop_token_ids", state.vocab_size))

    def reasons(out) -> tuple[str | None, str | int | None]:
        reason, why = getattr(out, "finish_reason", None), getattr(out, "stop_reason", None)
        if isinstance(why, int) and why == state.eos_token_id and why not in requested:
            why = None
        return (reason.value if reason is not None else None), why

    return reasons


async def collect(gen: Generation, tags: list[int], prompts: list[list[int]], n: int) -> dict[int, CompletedRequest]:
    """The finished result of every choice (choice ``tag`` belongs to prompt ``tag // n``)."""
    done = {tag: CompletedRequest(f"{gen.request_id}-{tag}", prompts[tag // n]) for tag in tags}
    async for tag, out in gen.events():
        done[tag].add(out)
    return done


def event_stream(gen: Generation, chunks, error_event=None) -> StreamingResponse:
    """Server-sent events from ``chunks``; an engine error becomes an error event (OpenAI's error
    object and ``[DONE]``, or ``error_event(exc)`` for protocols that name their events), a client
    that left ends the stream, and a cancelled stream frees its engine requests."""

    async def events():
        try:
            async for part in chunks:
                yield part
        except ClientDisconnected:
            return
        except HTTPError as exc:
            yield error_event(exc) if error_event is not None else sse(exc.body()) + SSE_DONE
        finally:
            gen.abort()

    return StreamingResponse(events(), media_type="text/event-stream")
