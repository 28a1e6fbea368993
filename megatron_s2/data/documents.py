"""Documents as token ids: rendering rules and the in-memory document store.

A *document* is one training example rendered to token ids:

* prompt/answer pairs (synthetic tasks, SFT jsonl): a one-turn chat ``[user: prompt,
  assistant: answer]`` through the tokenizer's chat template — for the character tokenizer
  exactly ``bos + prompt + sep + answer + eos``;
* chat conversations (:mod:`.chat`): the whole conversation, with a per-token target mask;
* plain text (pretraining jsonl): ``bos + text + eos``.

Each document carries a *prompt length*: the number of leading tokens that are never
training targets in SFT (everything before the answer; 0 for plain text); a multi-turn
conversation carries a full per-token *target mask* instead (its trained roles' tokens).
Pretraining ignores both and trains on every token that has a predecessor in its document.

A :class:`DocumentStore` is anything with ``sizes``, ``prompt_lengths``, ``tokens(i)`` and
``targets(i)``; :class:`InMemoryDocuments` (generated or chat data) and
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

    def targets(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """SFT target flags (bool) of the same span: the trained roles' tokens (float32 loss weights
        when a chat message carries a ``weight`` other than 0 or 1, :mod:`megatron_s2.data.chat`)."""

    def __len__(self) -> int: ...


def _flags_or_weights(targets) -> np.ndarray:
    """Target flags as bool, or float32 loss weights when they are weights (chat ``weight``)."""
    targets = np.asarray(targets)
    return targets.astype(np.float32) if np.issubdtype(targets.dtype, np.floating) else targets.astype(bool)


def prompt_targets(prompt_length: int, start: int, length: int) -> np.ndarray:
    """Target flags of ``[start, start + length)`` for a document whose first ``prompt_length``
    tokens are never targets."""
    return np.arange(start, start + length) >= prompt_length


def render_prompt_answer(tokenizer: Tokenizer, prompt: str, answer: str) -> tuple[np.ndarray, int]:
    """One-turn chat ``[user: prompt, assistant: answer]`` and its prompt length (the tokens
    before the answer). Character tokenizer: ``bos + prompt + sep + answer + eos``."""
    from megatron_s2.data.chat import tokenize_conversation

    ids, target = tokenize_conversation(tokenizer, [{"role": "user", "content": prompt},
                                                    {"role": "assistant", "content": answer}])
    return ids, _prompt_length(target)


def render_prompt_answers(tokenizer: Tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[np.ndarray, int]]:
    """:func:`render_prompt_answer` of many pairs; tokenizers with ``encode_batch`` (Hugging
    Face) render the template once around placeholders and encode all documents in one batch,
    checked against the direct rendering of the first pair."""
    if not pairs or not hasattr(tokenizer, "encode_batch"):
        return [render_prompt_answer(tokenizer, p, a) for p, a in pairs]
    marks = ("\ue001", "\ue002")
    text = tokenizer.apply_chat_template([{"role": "user", "content": marks[0]},
                                          {"role": "assistant", "content": marks[1]}], tokenize=False)
    head, rest = text.split(marks[0])
    middle, tail = rest.split(marks[1])
    texts = [head + p + middle + a + tail for p, a in pairs]
    answer_starts = [len(head) + len(p) + len(middle) for p, _ in pairs]
    encodings = tokenizer.encode_batch_with_offsets(texts)
    out = []
    for (ids, offsets), start in zip(encodings, answer_starts):
        prompt_length = next((i for i, (s, _) in enumerate(offsets) if s >= start), len(ids))
        out.append((np.asarray(ids, dtype=np.int64), prompt_length))
    first = render_prompt_answer(tokenizer, *pairs[0])
    if not (np.array_equal(first[0], out[0][0]) and first[1] == out[0][1]):
        return [render_prompt_answer(tokenizer, p, a) for p, a in pairs]
    return out


def _prompt_length(target: np.ndarray) -> int:
    first = int(np.argmax(target)) if target.any() else len(target)
    if not target[first:].all():
        raise DataError("a prompt/answer pair rendered with targets before the answer; the chat template "
                        "must put the answer last")
    return first


def render_text(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, int]:
    """``bos + text + eos`` with prompt length 0 (every token is a target)."""
    ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64), 0


class InMemoryDocuments:
    """Documents held as one flat token array plus offsets (the in-memory twin of .bin/.idx)."""

    def __init__(self, flat_tokens: np.ndarray, sizes: np.ndarray, prompt_lengths: np.ndarray,
                 flat_targets: np.ndarray | None = None) -> None:
        sizes = np.asarray(sizes, dtype=np.int64)
        prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)
        if sizes.ndim != 1 or prompt_lengths.shape != sizes.shape:
            raise DataError(f"documents: sizes {sizes.shape} and prompt_lengths {prompt_lengths.shape} must be "
                            "1-D arrays of equal length")
        if int(sizes.sum()) != len(flat_tokens):
            raise DataError(f"documents: sizes add up to {int(sizes.sum())} tokens but {len(flat_tokens)} were given")
        if np.any(sizes < 1) or np.any(prompt_lengths < 0) or np.any(prompt_lengths > sizes):
            raise DataError("documents: every document needs >= 1 token and 0 <= prompt length <= size")
        if flat_targets is not None and len(flat_targets) != len(flat_tokens):
            raise DataError(f"documents: {len(flat_targets)} target flags for {len(flat_tokens)} tokens")
        self._flat = np.asarray(flat_tokens, dtype=np.int64)
        self._targets = None if flat_targets is None else _flags_or_weights(flat_targets)
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

    @classmethod
    def from_masked(cls, documents: Iterable[tuple[np.ndarray, np.ndarray]]) -> "InMemoryDocuments":
        """Build from ``(token_ids, target_mask)`` pairs (multi-turn chats)."""
        token_arrays, target_arrays = [], []
        for ids, target in documents:
            token_arrays.append(np.asarray(ids, dtype=np.int64))
            target_arrays.append(_flags_or_weights(target))
        if not token_arrays:
            raise DataError("documents: no documents given; a dataset needs at least one")
        sizes = np.fromiter((len(a) for a in token_arrays), dtype=np.int64, count=len(token_arrays))
        prompts = np.fromiter((int(np.argmax(t)) if t.any() else len(t) for t in target_arrays), dtype=np.int64,
                              count=len(target_arrays))
        return cls(np.concatenate(token_arrays), sizes, prompts, np.concatenate(target_arrays))

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

    def targets(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        if self._targets is None:
            size = int(self._sizes[index])
            return prompt_targets(int(self._prompt_lengths[index]), start, size - start if length is None else length)
        begin = int(self._offsets[index]) + start
        end = int(self._offsets[index + 1]) if length is None else begin + length
        return self._targets[begin:end]

    def __len__(self) -> int:
        return len(self._sizes)
