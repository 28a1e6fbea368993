"""Visual gain: whether a page's pictures carry information (Intern-S2 walkthrough Ch. 3, §3.2 and
Worked example 7).

The interleaved-data filter scores a page by the language model's perplexity on its text twice —
without visual input and with its images, tables and equations — and keeps the pages whose gain
exceeds a domain threshold. Perplexity is the exponential of the mean per-token cross-entropy in
nats (``PPL = e^H``), so the gain in information per text token is ``ln PPL_text - ln
PPL_interleaved`` nats, ``/ ln 2`` bits; times the page's text tokens, the bits the visuals
supplied that the text alone could not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["VisualGain", "visual_gain"]


@dataclass(frozen=True)
class VisualGain:
    nats_per_token: float
    """Delta H = ln PPL_text - ln PPL_interleaved."""
    bits_per_token: float
    page_bits: float
    """bits_per_token times the page's text tokens."""

    def keep(self, threshold_bits_per_token: float) -> bool:
        """The page passes a domain's threshold (the paper pairs thresholds with human review)."""
        return self.bits_per_token > threshold_bits_per_token


def visual_gain(ppl_text: float, ppl_interleaved: float, text_tokens: int) -> VisualGain:
    """The visual gain of a page of ``text_tokens`` tokens from its two perplexities."""
    if not (ppl_text >= 1 and ppl_interleaved >= 1):
        raise ValueError(f"perplexities are >= 1, got {ppl_text} and {ppl_interleaved}")
    if text_tokens < 0:
        raise ValueError(f"text_tokens must be >= 0, got {text_tokens}")
    nats = math.log(ppl_text) - math.log(ppl_interleaved)
    bits = nats / math.log(2)
    return VisualGain(nats, bits, bits * text_tokens)
