"""Text of a growing token sequence, and stop strings found in it — linear in the output length.

:class:`IncrementalDetokenizer` decodes only the tokens since the last emitted character, plus
a few before them for context (vLLM's ``detokenize_incrementally`` scheme): with
``prefix`` / ``read`` offsets into the ids, the new text of a step is ``decode(ids[prefix:])``
minus ``decode(ids[prefix:read])``. Text ending in U+FFFD (a multi-byte character whose
remaining bytes are in tokens still to come) is held back until it completes; a step's work is
proportional to the tokens it adds, whatever the length of the output so far.

:class:`StopStrings` finds the earliest stop string in that text, looking at each step only at
the new characters and the ``len(longest stop) - 1`` characters before them.

One implementation for every consumer: the engine's stop-string check
(:class:`~megatron_s2.inference.engine.InferenceEngine`), the server's text streams
(:class:`~megatron_s2.serve.text.TextStream`) and ``megatron-s2 generate``.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["IncrementalDetokenizer", "StopStrings", "PENDING"]

PENDING = "\ufffd"
"""What a decoder renders for bytes of a character not complete yet (and for invalid ids)."""

_CONTEXT = 5
"""Tokens decoded before the new ones: some decoders render a token differently at the start of
a sequence (a leading space marker), so the new text is taken as a difference of two decodes."""


class IncrementalDetokenizer:
    """The text of ``ids`` as they arrive (module docstring). ``decode(ids) -> str``."""

    def __init__(self, decode: Callable[[list[int]], str], context: Iterable[int] = ()):
        """``context``: ids that precede the decoded ones (e.g. the prompt's tail), decoded only to
        render the first new tokens as they read after it; they are not part of :attr:`text`."""
        self.decode = decode
        self.ids: list[int] = list(context)[-_CONTEXT:]
        self.prefix = 0                # first id of the decoding window
        self.read = len(self.ids)      # ids up to here have been emitted as text
        self.text = ""                 # final text so far (no held-back characters)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append tokens; return the text that became final (possibly empty)."""
        self.ids.extend(int(t) for t in new_ids)
        if len(self.ids) == self.read:
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(PENDING):
            return ""  # an incomplete character: wait for its remaining bytes
        delta = after[len(before):]
        self.prefix, self.read = max(self.read - _CONTEXT, 0), len(self.ids)
        self.text += delta
        return delta

    def pending(self) -> str:
        """The text of the tokens not emitted yet, as it reads now (incomplete characters as U+FFFD)."""
        if len(self.ids) == self.read:
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        return after[len(before):]

    def flush(self) -> str:
        """At the end: the remaining text, incomplete characters included; nothing is held back."""
        rest = self.pending()
        self.text += rest
        self.prefix = self.read = len(self.ids)
        return rest


class StopStrings:
    """The earliest of ``stops`` in a growing text, scanning only what each step can complete."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self.overlap = max((len(s) for s in self.stops), default=1) - 1
        self.scanned = 0  # text before this offset can no longer start a stop string

    def find(self, text: str) -> tuple[str, int] | None:
        """(stop string, its offset in ``text``) of the earliest stop string that ends in text not
        scanned before, or None. ``text`` only grows between calls."""
        start = max(0, self.scanned - self.overlap)
        hits = [(at, stop) for stop in self.stops if (at := text.find(stop, start)) >= 0]
        self.scanned = len(text)
        if not hits:
            return None
        at, stop = min(hits)
        return stop, at
