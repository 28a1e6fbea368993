"""Long documents split into overlapping chunks (Intern-S2 walkthrough Ch. 3, §3.2 and Worked
example 9).

"Filtered pages are concatenated in document order and split into chunks suitable for
long-context VLM pre-training, with each chunk capped at 256k tokens and sharing a 512-token
overlap." The rule, for a document of ``length`` tokens, a cap ``max_len`` and an ``overlap``:

* a document that fits is one chunk;
* otherwise chunk ``k`` starts at ``k * stride`` with ``stride = max_len - overlap`` and is
  ``max_len`` long, except the last, which ends at the document's end — so consecutive chunks
  share exactly ``overlap`` tokens, every chunk after the first brings new tokens, and no chunk
  is empty or longer than the cap.

The overlap is a seam repair: any window of up to ``overlap + 1`` tokens (a dependency reaching
back ``overlap`` tokens or less) lies whole inside at least one chunk. The cost is the
duplicated ``overlap`` tokens per seam: about ``overlap / stride`` of the corpus (512 / 255,488,
"two tokens in a thousand").
"""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["chunk_spans", "chunk_count", "duplicated_tokens", "split_document"]

T = TypeVar("T")


def _check(max_len: int, overlap: int) -> int:
    if max_len < 1:
        raise ValueError(f"chunk cap must be positive, got {max_len}")
    if not 0 <= overlap < max_len:
        raise ValueError(f"chunk overlap must be in [0, cap={max_len}), got {overlap}: a chunk must bring new tokens")
    return max_len - overlap


def chunk_count(length: int, max_len: int, overlap: int) -> int:
    """How many chunks a document of ``length`` tokens becomes (0 for an empty document)."""
    stride = _check(max_len, overlap)
    if length <= max_len:
        return 1 if length > 0 else 0
    return 1 + -(-(length - max_len) // stride)  # ceil: the chunks after the first each add <= stride


def chunk_spans(length: int, max_len: int, overlap: int) -> list[tuple[int, int]]:
    """The chunks of a document of ``length`` tokens as ``[start, end)`` spans (module docstring)."""
    stride = _check(max_len, overlap)
    n = chunk_count(length, max_len, overlap)
    return [(k * stride, min(k * stride + max_len, length)) for k in range(n)]


def duplicated_tokens(length: int, max_len: int, overlap: int) -> int:
    """Tokens a document's chunks hold twice: ``overlap`` per seam."""
    return max(chunk_count(length, max_len, overlap) - 1, 0) * overlap


def split_document(tokens: Sequence[T], max_len: int, overlap: int) -> list[Sequence[T]]:
    """``tokens`` cut into its chunks (slices of the input)."""
    return [tokens[start:end] for start, end in chunk_spans(len(tokens), max_len, overlap)]
