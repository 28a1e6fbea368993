"""Text of generated tokens for the OpenAI endpoints: incremental detokenisation, stop
strings cut from the text, and the log-prob records of both APIs.

The text comes from the engine's one incremental detokenizer and stop-string scanner
(:mod:`megatron_s2.inference.detokenizer`), so a choice costs work linear in its length.
Streaming sends only text that can no longer change: a trailing U+FFFD (a multi-byte
character whose remaining bytes are still to come) and, when the request has stop strings,
the last ``len(longest stop) - 1`` characters (which may become the start of a stop string)
are held back until the next token or the end. The text of a request that ended on a stop
string stops before it (the token ids still include the tokens that completed it), as OpenAI
and vLLM do, or after it with vLLM's ``include_stop_str_in_output``. Special tokens are left out
of the text unless ``skip_special_tokens: false``.
"""

from __future__ import annotations

import math
from typing import Iterable

from megatron_s2.inference.detokenizer import IncrementalDetokenizer, StopStrings

__all__ = ["TextStream", "token_text", "chat_logprobs", "completion_logprobs", "finite_logprob"]


def _decode(tokenizer, ids: Iterable[int], keep_special: bool = False) -> str:
    try:
        return tokenizer.decode(list(ids), keep_special=keep_special)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode(list(ids))


class TextStream:
    """The growing text of one choice."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, include_stop: bool = False,
                 keep_special: bool = False):
        self.detokenizer = IncrementalDetokenizer(lambda ids: _decode(tokenizer, ids, keep_special))
        self.stops = StopStrings(stop)
        self.include_stop = include_stop
        self.sent = ""
        self._end: int | None = None  # where the text ends once a stop string was found

    @property
    def ids(self) -> list[int]:
        return self.detokenizer.ids

    def push(self, new_ids: Iterable[int], last: bool = False) -> str:
        """Add tokens; the text that can be sent now (everything left, cut before a stop
        string, when ``last``)."""
        self.detokenizer.push(new_ids)
        if last:
            return self.finish()
        return self._send(hold=self.stops.overlap)

    def finish(self) -> str:
        """The rest of the text, cut before the first stop string."""
        self.detokenizer.flush()
        return self._send(hold=0)

    def final_text(self) -> str:
        """All the text, cut before the first stop string (after it with ``include_stop``)."""
        self.finish()
        return self.sent

    def _send(self, hold: int) -> str:
        text = self.detokenizer.text
        if self._end is None and self.stops.stops:
            found = self.stops.find(text)
            if found is not None:
                stop, at = found
                self._end = at + len(stop) if self.include_stop else at
        end = self._end if self._end is not None else len(text) - hold
        if end <= len(self.sent):
            return ""
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta


def finite_logprob(value: float) -> float:
    """JSON has no -inf: a log-prob of an impossible token is reported as -9999.0 (vLLM's floor)."""
    return float(value) if math.isfinite(value) else -9999.0


def token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    """How a token is named in log-prob records: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, what token-level clients parse)."""
    return f"token_id:{token_id}" if as_ids else _decode(tokenizer, [token_id], keep_special=True)


def chat_logprobs(tokenizer, ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]],
                  num_top: int, as_ids: bool) -> dict:
    """``choices[i].logprobs`` of a chat completion: ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``."""

    def entry(token_id: int, value: float) -> dict:
        text = token_text(tokenizer, token_id, as_ids)
        return {"token": text, "logprob": finite_logprob(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, value, top in zip(ids, logprobs, tops):
        content.append({**entry(token_id, value), "top_logprobs": [entry(t, v) for t, v in top[:num_top]]})
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], logprobs: list[float | None],
                        tops: list[list[tuple[int, float]] | None], num_top: int, as_ids: bool,
                        offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a (legacy) completion: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` and ``text_offset`` (character offset of each token, counted from
    ``offset``). Each ``top_logprobs`` entry maps the token itself and the ``num_top`` most
    likely ones to their log-probs (up to ``num_top + 1`` entries, as OpenAI and vLLM report
    them); a position without a value (an echoed prompt's first token) is ``None`` in both."""
    tokens = [token_text(tokenizer, t, as_ids) for t in ids]
    offsets, at = [], offset
    for token_id in ids:
        offsets.append(at)
        at += len(_decode(tokenizer, [token_id]))
    top_maps: list[dict | None] = []
    for token, value, top in zip(tokens, logprobs, tops):
        if value is None:
            top_maps.append(None)
            continue
        entry = {token: finite_logprob(value)}
        entry.update((token_text(tokenizer, t, as_ids), finite_logprob(v)) for t, v in (top or [])[:num_top])
        top_maps.append(entry)
    return {"tokens": tokens, "token_logprobs": [None if v is None else finite_logprob(v) for v in logprobs],
            "top_logprobs": top_maps, "text_offset": offsets}
