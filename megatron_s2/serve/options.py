"""Request options shared by the endpoints, and the vLLM fields this server does not implement.

vLLM's request models accept many fields; a server that accepts one and ignores it answers
something other than what the client asked for. Every vLLM field is therefore honoured (here:
output options, stream options, prompt truncation; :mod:`megatron_s2.serve.sampling`: sampling)
or refused with a 400 naming it unless it has the value that changes nothing
(:data:`UNSUPPORTED`, :func:`refuse_unsupported_fields`). Fields neither we nor vLLM know are
ignored, as both OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from megatron_s2.serve.fields import Fields, check_token_ids

__all__ = ["UNSUPPORTED", "refuse_unsupported_fields", "OutputOptions", "StreamUsage", "read_stream_usage",
           "Truncation", "read_truncation"]

_STRUCTURED = "structured (guided) decoding is not implemented; validate and retry client-side"
_BEAM = "beam search is not implemented; use n with sampling"

UNSUPPORTED: dict[str, tuple[Any, str]] = {
    # field: (the value that changes nothing, why another value is refused)
    "use_beam_search": (False, _BEAM),
    "length_penalty": (1.0, _BEAM),
    "early_stopping": (False, _BEAM),
    "structured_outputs": (None, _STRUCTURED),
    "response_format": ({"type": "text"}, _STRUCTURED),
    "priority": (0, "requests are served in arrival order; there is no priority scheduling"),
    "watermarking": (False, "watermarking is not implemented"),
    "repetition_detection": (None, "repetition detection is not implemented; use stop strings or max_tokens"),
    "vllm_xargs": ({}, "no extension of this server reads custom arguments"),
    "kv_transfer_params": (None, "disaggregated prefill is not implemented"),
    "prompt_embeds": (None, "prompts are text or token ids"),
}
"""vLLM request fields refused unless neutral (``guided_*`` fields are refused by prefix)."""


def refuse_unsupported_fields(f: Fields, extra: dict[str, tuple[Any, str]] | None = None) -> None:
    """A 400 naming the first field of :data:`UNSUPPORTED` (+ ``extra``) or ``guided_*`` that
    would change the result."""
    for key, (neutral, why) in {**UNSUPPORTED, **(extra or {})}.items():
        f.refuse_unless_default(key, neutral, why)
    for key in f.body:
        if isinstance(key, str) and key.startswith("guided_") and f.has(key):
            f.fail(key, f"not supported by this server ({_STRUCTURED})")


class StreamUsage(NamedTuple):
    """``stream_options``: usage in a final chunk, and (vLLM's ``continuous_usage_stats``) in
    every chunk."""

    final: bool = False
    continuous: bool = False


def read_stream_usage(f: Fields, stream: bool) -> StreamUsage:
    """vLLM's rule: ``stream_options`` only with ``stream: true``."""
    if f.raw("stream_options") in (None, {}):
        return StreamUsage()
    if not stream:
        f.fail("stream_options", "only allowed with stream: true")
    options = f.object("stream_options")
    options.only({"include_usage", "continuous_usage_stats"})
    usage = StreamUsage(options.bool("include_usage"), options.bool("continuous_usage_stats"))
    if usage.continuous and not usage.final:
        options.fail("continuous_usage_stats", "needs include_usage: true (as in vLLM)")
    return usage


class Truncation(NamedTuple):
    """vLLM's ``truncate_prompt_tokens`` (+ ``truncation_side``): keep this many prompt tokens."""

    tokens: int
    keep_end: bool = True
    """``truncation_side: "left"`` (the default) drops the start and keeps the end."""

    def apply(self, ids: list[int]) -> list[int]:
        return ids[-self.tokens:] if self.keep_end else ids[:self.tokens]


def read_truncation(f: Fields, max_model_len: int) -> Truncation | None:
    """``truncate_prompt_tokens``: k >= 1, or -1 for the context length (None: not asked)."""
    tokens = f.int("truncate_prompt_tokens", None, minimum=-1)
    side = f.str("truncation_side")
    if side not in (None, "left", "right"):
        f.fail("truncation_side", f"must be \"left\" (keep the end) or \"right\" (keep the start), got "
                                  f"{side[:20]!r}")
    if tokens is None:
        return None
    if tokens == 0:
        f.fail("truncate_prompt_tokens", "must be >= 1, or -1 for the context length")
    if tokens > max_model_len:
        f.fail("truncate_prompt_tokens", f"{tokens} is more than this model's maximum context length of "
                                         f"{max_model_len} tokens; choose a smaller truncation size")
    return Truncation(max_model_len if tokens == -1 else tokens, side != "right")


class OutputOptions:
    """What a request asks to get back, shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(self, f: Fields, state, chat: bool):
        self.n = f.int("n", 1, minimum=1, maximum=state.config.max_n)
        self.stream = f.bool("stream")
        self.usage = read_stream_usage(f, self.stream)
        if chat:  # logprobs: true + top_logprobs: N
            wants = f.bool("logprobs")
            top = f.int("top_logprobs", 0, minimum=0, maximum=state.max_logprobs)
            if top and not wants:
                f.fail("top_logprobs", "needs logprobs: true")
            self.logprobs = top if wants else None
        else:  # logprobs: N
            self.logprobs = f.int("logprobs", None, minimum=0, maximum=state.max_logprobs)
        self.logprob_token_ids = self._label_set(f, state, "logprobs: true" if chat else "logprobs (an integer)")
        self.token_ids = f.bool("return_token_ids")
        self.as_ids = f.bool("return_tokens_as_token_ids")
        self.echo = f.bool("echo")
        self.include_stop = f.bool("include_stop_str_in_output")
        self.keep_special = not f.bool("skip_special_tokens", True)
        f.bool("spaces_between_special_tokens", True)  # fast tokenizers decode without it (as vLLM's do)
        best_of = f.int("best_of", None)
        if best_of is not None and best_of != self.n:
            f.fail("best_of", "not supported by this server (set it equal to n or leave it out)")

    @property
    def num_top(self) -> int:
        """Alternatives reported per position (the asked label set, or the top-N)."""
        return len(self.logprob_token_ids) or (self.logprobs or 0)

    def _label_set(self, f: Fields, state, needs: str) -> tuple[int, ...]:
        """vLLM's ``logprob_token_ids``: the values of these tokens at every generated position."""
        value = f.raw("logprob_token_ids")
        if value is None:
            return ()
        ids = check_token_ids(value, state.vocab_size, f.name("logprob_token_ids"))
        if not ids:
            f.fail("logprob_token_ids", "must not be empty; leave it out for the top-N")
        if len(ids) > state.max_logprobs:
            f.fail("logprob_token_ids", f"at most {state.max_logprobs} tokens, got {len(ids)}")
        if self.logprobs is None:
            f.fail("logprob_token_ids", f"needs {needs}")
        return tuple(ids)
