"""Sampling fields of a request -> :class:`SamplingParams`, and the context-length rules.

The OpenAI endpoints and the token endpoint's ``sampling_params`` share the vLLM field names
(``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``logprobs``, ``logprob_token_ids``, ``n``; ``prompt_logprobs`` is read by
:mod:`megatron_s2.serve.prompt_logprobs`). Context length, as vLLM: a prompt of ``max_model_len``
tokens or more is refused with "This model's maximum context length is N tokens ..."; without
``max_tokens`` a legacy completion generates 16 tokens (OpenAI's default) and a chat or token
request up to the end of the context; on the OpenAI endpoints a
``max_tokens`` that does not fit after the prompt is refused, while the token endpoint stops
such a request at the context end (finish reason "length"). With ``n > 1`` and a ``seed``,
choice ``j`` samples with ``seed + j`` (vLLM's child requests do the same), so the choices
differ but the whole response is reproducible (a ``seed`` is a signed 64-bit integer, as vLLM
takes it).
"""

from __future__ import annotations

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields

__all__ = ["check_prompt_length", "build_sampling", "refuse_unsupported_sampling"]


def check_prompt_length(prompt_len: int, max_model_len: int, field: str) -> int:
    """Tokens left to generate after the prompt (>= 1), or a 400 naming ``field``."""
    if prompt_len >= max_model_len:
        raise BadRequest(f"{field}: This model's maximum context length is {max_model_len} tokens. However, your "
                         f"request has {prompt_len} input tokens, which leaves no room to generate. Please reduce "
                         "the length of the input.", param=field)
    return max_model_len - prompt_len


def refuse_unsupported_sampling(f: Fields) -> None:
    """Fields that would change the samples but that the engine does not implement."""
    f.refuse_unless_default("presence_penalty", 0, "penalties are not implemented; leave it at 0")
    f.refuse_unless_default("frequency_penalty", 0, "penalties are not implemented; leave it at 0")
    f.refuse_unless_default("repetition_penalty", 1, "penalties are not implemented; leave it at 1")
    f.refuse_unless_default("min_p", 0, "min-p filtering is not implemented; use top_p / top_k")
    f.refuse_unless_default("min_tokens", 0, "a minimum length is not implemented")
    f.refuse_unless_default("logit_bias", {}, "logit biases are not implemented")
    f.refuse_unless_default("bad_words", [], "banned words are not implemented")
    f.refuse_unless_default("allowed_token_ids", [], "restricting the vocabulary is not implemented")


def build_sampling(f: Fields, *, prompt_len: int, max_model_len: int, vocab_size: int, logprobs: int,
                   strict_total: bool, prompt_field: str, seed_offset: int = 0, record_routing: bool = False,
                   max_tokens_keys: tuple[str, ...] = ("max_tokens",),
                   default_max_tokens: int | None = None, max_stops: int = 128,
                   logprobs_mode: str = "raw_logprobs", logprob_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The engine's sampling parameters of one choice; without ``max_tokens`` it generates
    ``default_max_tokens`` (None = to the end of the context)."""
    room = check_prompt_length(prompt_len, max_model_len, prompt_field)
    key = next((k for k in max_tokens_keys if f.has(k)), max_tokens_keys[0])
    max_tokens = f.int(key, None, minimum=1)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        if strict_total:
            raise BadRequest(f"{f.name(key)}: This model's maximum context length is {max_model_len} tokens. However, "
                             f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} "
                             f"in the completion). Please reduce the length of the input or of {key}.",
                             param=f.name(key))
        max_tokens = room
    top_k = f.int("top_k", 0, minimum=-1)
    seed = f.int("seed", None, minimum=-(1 << 63), maximum=(1 << 63) - 1)  # vLLM's range: a C long
    if seed is not None:
        seed = (seed + seed_offset) & ((1 << 63) - 1)
    stop_ids = f.token_ids("stop_token_ids", vocab_size)
    stop = f.strings("stop")
    for key, entries in (("stop", stop), ("stop_token_ids", stop_ids)):
        if len(entries) > max_stops:
            f.fail(key, f"at most {max_stops} entries (every one is checked after each generated token), got "
                        f"{len(entries)}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=f.float("temperature", 1.0, minimum=0.0),
            top_p=f.float("top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=f.bool("ignore_eos"),
            logprobs=logprobs,
            logprob_token_ids=logprob_token_ids,
            logprobs_mode=logprobs_mode,
            record_routing=record_routing,
        )
    except ConfigError as exc:  # messages start with the field name
        field = str(exc).split(":", 1)[0]
        raise BadRequest(f"{f.prefix}{exc}", param=f.name(field)) from None
