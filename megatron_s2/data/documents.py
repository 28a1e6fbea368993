"""Documents as token ids: rendering rules and the in-memory document store.

A *document* is one training example rendered to token ids:

* prompt/answer pairs (synthetic tasks, SFT jsonl): ``bos + prompt + sep + answer + eos``;
* plain text (pretraining jsonl): ``bos + text + eos``.

Each document carries a *prompt length*: the number of leading tokens that are never
training targets in SFT (``bos + prompt + sep``; 0 for plain text). Pretraining ignores it
and trains on every token that has a predecessor in its document.

A :class:`DocumentStore` is anything with ``sizes``, ``prompt_lengths`` and ``tokens(i)``;
:class:`InMemoryDocuments` (synthetic data) and
:class:`~megatron_s2.data.indexed_dataset.IndexedDataset` (files) both are.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from megatron_s2.data.errors import DataError
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["DocumentStore", "InMemoryDocuments", "render_prompt_answer", "render_text"]


class DocumentStore(Protocol):
    """Random access to tokenised documents."""

    @property
    def sizes(self) -> np.ndarray:
        """Token count of every document (int64, one entry per document)."""

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Leading non-target tokens of every document in SFT (int64; zeros for plain text)."""

    def tokens(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Token ids (int64) of document ``index``, optionally only ``length`` from ``start``."""

    def __len__(self) -> int: ...


def render_prompt_answer(tokenizer: Tokenizer, prompt: str, answer: str) -> tuple[np.ndarray, int]:
    """``bos + prompt + sep + answer + eos`` and its prompt length (``bos + prompt + sep``)."""
    prompt_ids = tokenizer.encode(prompt)
    ids = [tokenizer.bos_id, *prompt_ids, tokenizer.sep_id, *tokenizer.encode(answer), tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64), len(prompt_ids) + 2


def render_text(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, int]:
    """``bos + text + eos`` with prompt length 0 (every token is a target)."""
    ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64), 0


class InMemoryDocuments:
    """Documents held as one flat token array plus offsets (the in-memory twin of .bin/.idx)."""

    def __init__(self, flat_tokens: np.ndarray, sizes: np.ndarray, prompt_lengths: np.ndarray) -> None:
        sizes = np.asarray(sizes, dtype=np.int64)
        prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)
        if sizes.ndim != 1 or prompt_lengths.shape != sizes.shape:
            raise DataError(f"documents: sizes {sizes.shape} and prompt_lengths {prompt_lengths.shape} must be "
                            "1-D arrays of equal length")
        if int(sizes.sum()) != len(flat_tokens):
            raise DataError(f"documents: sizes add up to {int(sizes.sum())} tokens but {len(flat_tokens)} were given")
        if np.any(sizes < 1) or np.any(prompt_lengths < 0) or np.any(prompt_lengths > sizes):
            raise DataError("documents: every document needs >= 1 token and 0 <= prompt length <= size")
        self._flat = np.asarray(flat_tokens, dtype=np.int64)
        self._sizes = sizes
        self._prompt_lengths = prompt_lengths
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])

    @classmethod
    def from_documents(cls, documents: Iterable[tuple[np.ndarray, int]]) -> "InMemoryDocuments":
        """Build from ``(token_ids, prompt_length)`` pairs."""
        token_arrays, prompt_lengths = [], []
        for ids, prompt_length in documents:
            token_arrays.append(np.asarray(ids, dtype=np.int64))
            prompt_lengths.append(prompt_length)
        if not token_arrays:
            raise DataError("documents: no documents given; a dataset needs at least one")
        sizes = np.fromiter((len(a) for a in token_arrays), dtype=np.int64, count=len(token_arrays))
        return cls(np.concatenate(token_arrays), sizes, np.asarray(prompt_lengths, dtype=np.int64))

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self._prompt_lengths

    def tokens(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        begin = int(self._offsets[index]) + start
        end = int(self._offsets[index + 1]) if length is None else begin + length
        return self._flat[begin:end]

    def __len__(self) -> int:
        return len(self._sizes)
