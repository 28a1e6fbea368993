"""Best-fit packing of documents into fixed-length training rows.

A row holds ``row_length = seq_length + 1`` tokens; the trainer's inputs are ``row[:-1]`` and
its labels ``row[1:]``. Packing proceeds in two deterministic steps:

1. **Chunking.** A document longer than a row is cut into chunks of ``row_length`` tokens
   that overlap by one token (chunk *j* starts at ``j * seq_length``), so every token of the
   document except the first is the label of exactly one position; the shorter last chunk
   joins step 2. A chunk never holds fewer than two tokens.
2. **Best-fit decreasing.** Chunks are taken longest first (ties: document order) and each
   goes into the open row with the *least* free space that still fits it; a new row is opened
   when none fits. Full-length chunks become rows of their own.

Every chunk in a row is a *segment* with its own id (0, 1, ... in row order); padding after
the last segment gets the next id, so the model's document-level attention mask never lets a
position attend across a segment boundary. A label is a training target only inside its
segment (:meth:`PackedRows.materialize`), which also masks the prompt in SFT.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megatron_s2.data.documents import DocumentStore
from megatron_s2.data.errors import DataError

__all__ = ["PackedRows", "split_into_chunks", "best_fit_pack", "PackedRow"]


def split_into_chunks(sizes: np.ndarray, row_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(document, start, length)`` of every chunk; documents up to ``row_length`` are one chunk."""
    if row_length < 2:
        raise DataError(f"row_length: a row needs at least 2 tokens (seq_length >= 1), got {row_length}")
    sizes = np.asarray(sizes, dtype=np.int64)
    stride = row_length - 1
    counts = np.maximum(1, -(-(sizes - 1) // stride))
    documents = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first_chunk = np.repeat(np.cumsum(counts) - counts, counts)
    starts = (np.arange(len(documents), dtype=np.int64) - first_chunk) * stride
    lengths = np.minimum(row_length, sizes[documents] - starts)
    return documents, starts, lengths


@dataclass(frozen=True)
class PackedRow:
    """One materialised row: ``row_length`` tokens, target flags and segment ids."""

    tokens: np.ndarray
    """Token ids (int64), padded with the pad id."""
    is_target: np.ndarray
    """Loss weight (float32; 0 = not a target) of each token when it is predicted from its predecessor."""
    segment_ids: np.ndarray
    """Segment (document chunk) id of each token; padding has the id after the last segment."""


@dataclass(frozen=True)
class PackedRows:
    """The segments of every packed row, as flat arrays indexed through ``row_offsets``."""

    row_length: int
    row_offsets: np.ndarray
    """Row r's segments are entries ``row_offsets[r]:row_offsets[r + 1]`` of the arrays below."""
    segment_document: np.ndarray
    segment_start: np.ndarray
    """Offset of the segment's first token inside its document."""
    segment_length: np.ndarray

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.segment_length.sum())

    @property
    def fill_ratio(self) -> float:
        """Fraction of row slots holding document tokens (the rest is padding)."""
        return self.num_tokens / max(1, len(self) * self.row_length)

    def materialize(self, row: int, store: DocumentStore, *, answer_only: bool, pad_id: int) -> PackedRow:
        """Tokens, target flags and segment ids of row ``row``.

        A token is a target when ``answer_only`` is False, or when its document marks it as
        one (SFT: the answer / the trained roles' tokens, ``DocumentStore.targets``); ``is_target``
        is float32, the documents' loss weights (1.0 for a plain target flag)."""
        tokens = np.full(self.row_length, pad_id, dtype=np.int64)
        is_target = np.zeros(self.row_length, dtype=np.float32)  # loss weights: 0/1 flags or chat weights
        begin, end = self.row_offsets[row], self.row_offsets[row + 1]
        segment_ids = np.full(self.row_length, end - begin, dtype=np.int64)
        cursor = 0
        for segment, index in enumerate(range(begin, end)):
            document = int(self.segment_document[index])
            start, length = int(self.segment_start[index]), int(self.segment_length[index])
            span = slice(cursor, cursor + length)
            tokens[span] = store.tokens(document, start, length)
            segment_ids[span] = segment
            if answer_only:
                is_target[span] = store.targets(document, start, length)
            else:
                is_target[span] = True
            cursor += length
        return PackedRow(tokens=tokens, is_target=is_target, segment_ids=segment_ids)


def best_fit_pack(sizes: np.ndarray, row_length: int) -> PackedRows:
    """Pack documents of the given sizes into rows of ``row_length`` tokens (see module doc)."""
    documents, starts, lengths = split_into_chunks(sizes, row_length)
    if len(documents) == 0:
        raise DataError("packing: the dataset has no documents")
    full = np.flatnonzero(lengths == row_length)
    partial = np.flatnonzero(lengths < row_length)
    rows: list[list[int]] = [[int(c)] for c in full]
    # Longest first; the stable sort keeps document order among equal lengths.
    order = partial[np.argsort(-lengths[partial], kind="stable")]
    smallest = int(lengths[partial].min()) if len(partial) else row_length
    open_rows: list[tuple[int, int]] = []  # sorted (free slots, row index)
    for chunk in order.tolist():
        need = int(lengths[chunk])
        position = bisect.bisect_left(open_rows, (need, -1))
        if position < len(open_rows):
            free, row = open_rows.pop(position)
            rows[row].append(chunk)
        else:
            free, row = row_length, len(rows)
            rows.append([chunk])
        free -= need
        if free >= smallest:
            bisect.insort(open_rows, (free, row))
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    chunk_order = np.fromiter((c for r in rows for c in r), dtype=np.int64, count=int(counts.sum()))
    return PackedRows(
        row_length=row_length,
        row_offsets=np.concatenate([[0], np.cumsum(counts)]),
        segment_document=documents[chunk_order],
        segment_start=starts[chunk_order],
        segment_length=lengths[chunk_order],
    )
