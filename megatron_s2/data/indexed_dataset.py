"""Megatron-style indexed dataset: our own ``.bin`` + ``.idx`` writer and memory-mapped reader.

A dataset with path prefix ``P`` is two files (all integers little-endian):

``P.bin`` — the token ids of every document back to back, as ``uint16`` when the vocabulary
has fewer than 65,536 ids, else ``int32``. No header.

``P.idx`` — a 32-byte header followed by per-document arrays::

    offset  bytes  field
    0       8      magic b"MS2IDX\\x00\\x00"
    8       4      format version, uint32 (currently 1)
    12      1      dtype code, uint8: 1 = uint16, 2 = int32 (token ids in .bin)
    13      1      flags, uint8: bit 0 set = prompt lengths present
    14      2      reserved, zero
    16      4      vocab_size, uint32 (of the tokenizer that wrote the data)
    20      4      reserved, zero
    24      8      document count N, uint64
    32      8N     pointers, int64: byte offset of each document in .bin
    32+8N   4N     sizes, int32: tokens per document
    32+12N  4N     prompt lengths, int32 (only when flag bit 0): leading tokens
                   (bos + prompt + sep) that carry no SFT loss; 0 for plain text

The pointer array comes first so that both int64 and int32 arrays stay naturally aligned.
The layout follows Megatron-LM's ``MMIDIDX`` idea (separate token and index files, memory
mapped) but is not byte-compatible with it. Files are written to temporary names and renamed
on :meth:`IndexedDatasetWriter.finalize`, so a crashed writer never leaves a valid-looking
pair. The reader checks magic, version, dtype, exact file sizes and pointer consistency, and
raises :class:`~megatron_s2.data.errors.DataError` naming the file and the fix.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from megatron_s2.data.errors import DataError

__all__ = ["IndexedDataset", "IndexedDatasetWriter", "INDEX_MAGIC", "INDEX_VERSION"]

INDEX_MAGIC = b"MS2IDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<8sIBBHIIQ")
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_FLAG_PROMPT_LENGTHS = 1
_FIX = "regenerate it with `python tools/preprocess_data.py --input DATA.jsonl --output-prefix {prefix}`"


def _dtype_code(vocab_size: int) -> int:
    return 1 if vocab_size < 65536 else 2


class IndexedDatasetWriter:
    """Streams documents into ``prefix.bin`` / ``prefix.idx`` (see module docstring)."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int) -> None:
        if not 0 < vocab_size < 2**31:
            raise DataError(f"vocab_size: must be in 1..2^31-1, got {vocab_size}")
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self._code = _dtype_code(vocab_size)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._idx_tmp = Path(f"{self.prefix}.idx.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []
        self._prompt_lengths: list[int] = []

    def add_document(self, token_ids: np.ndarray, prompt_length: int = 0) -> None:
        """Append one document; ``prompt_length`` leading tokens carry no SFT loss."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or len(ids) == 0:
            raise DataError(f"document {len(self._sizes)}: expected a non-empty 1-D array of token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise DataError(f"document {len(self._sizes)}: token ids must lie in 0..{self.vocab_size - 1}, "
                            f"got {int(ids.min())}..{int(ids.max())}")
        if not 0 <= prompt_length <= len(ids):
            raise DataError(f"document {len(self._sizes)}: prompt_length {prompt_length} outside 0..{len(ids)}")
        self._bin.write(ids.astype(_DTYPES[self._code], copy=False).tobytes())
        self._sizes.append(len(ids))
        self._prompt_lengths.append(prompt_length)

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        if not self._sizes:
            self.discard()
            raise DataError(f"{self.prefix}: no documents were written; an indexed dataset needs at least one")
        sizes = np.asarray(self._sizes, dtype=np.int64)
        pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * _DTYPES[self._code].itemsize
        with_prompts = any(self._prompt_lengths)
        header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, self._code,
                              _FLAG_PROMPT_LENGTHS if with_prompts else 0, 0, self.vocab_size, 0, len(sizes))
        with open(self._idx_tmp, "wb") as index:
            index.write(header)
            index.write(pointers.astype("<i8").tobytes())
            index.write(sizes.astype("<i4").tobytes())
            if with_prompts:
                index.write(np.asarray(self._prompt_lengths, dtype="<i4").tobytes())
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(self._idx_tmp, f"{self.prefix}.idx")

    def discard(self) -> None:
        """Close and delete the temporary files (after an error)."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


class IndexedDataset:
    """Memory-mapped reader of ``prefix.bin`` / ``prefix.idx`` (a :class:`DocumentStore`)."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        fix = _FIX.format(prefix=self.prefix)
        if not idx_path.is_file():
            raise DataError(f"{idx_path}: index file not found; check data.paths (give the prefix without "
                            f".bin/.idx) or {fix}")
        if not bin_path.is_file():
            raise DataError(f"{bin_path}: token file not found next to {idx_path.name}; {fix}")
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as index:
            raw = index.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            raise DataError(f"{idx_path}: truncated index ({idx_size} bytes, header needs {_HEADER.size}); {fix}")
        magic, version, code, flags, _, vocab_size, _, count = _HEADER.unpack(raw)
        if magic != INDEX_MAGIC:
            raise DataError(f"{idx_path}: not a megatron_s2 index (magic {magic!r}, expected {INDEX_MAGIC!r}); {fix}")
        if version != INDEX_VERSION:
            raise DataError(f"{idx_path}: index format version {version}, this build reads {INDEX_VERSION}; {fix}")
        if code not in _DTYPES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (valid: {sorted(_DTYPES)}); {fix}")
        has_prompts = bool(flags & _FLAG_PROMPT_LENGTHS)
        expected = _HEADER.size + count * (12 + (4 if has_prompts else 0))
        if idx_size != expected:
            raise DataError(f"{idx_path}: {idx_size} bytes but a {count}-document index has {expected}; "
                            f"the file is truncated or corrupt; {fix}")
        if count == 0:
            raise DataError(f"{idx_path}: the dataset holds no documents; {fix}")
        self.vocab_size = vocab_size
        self.dtype = _DTYPES[code]
        self._pointers = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(count,))
        sizes_offset = _HEADER.size + 8 * count
        self._sizes = np.array(np.memmap(idx_path, dtype="<i4", mode="r", offset=sizes_offset, shape=(count,)),
                               dtype=np.int64)
        if has_prompts:
            prompts = np.memmap(idx_path, dtype="<i4", mode="r", offset=sizes_offset + 4 * count, shape=(count,))
            self._prompt_lengths = np.array(prompts, dtype=np.int64)
        else:
            self._prompt_lengths = np.zeros(count, dtype=np.int64)
        self._check_consistency(idx_path, bin_path, fix)
        self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")

    def _check_consistency(self, idx_path: Path, bin_path: Path, fix: str) -> None:
        if np.any(self._sizes < 1) or np.any(self._prompt_lengths < 0) or np.any(self._prompt_lengths > self._sizes):
            raise DataError(f"{idx_path}: corrupt sizes or prompt lengths; {fix}")
        expected_pointers = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]) * self.dtype.itemsize
        if not np.array_equal(self._pointers, expected_pointers):
            raise DataError(f"{idx_path}: document pointers disagree with document sizes (corrupt index); {fix}")
        bin_size = bin_path.stat().st_size
        expected_bin = int(self._sizes.sum()) * self.dtype.itemsize
        if bin_size != expected_bin:
            raise DataError(f"{bin_path}: {bin_size} bytes but {idx_path.name} describes {expected_bin}; "
                            f"the pair does not match or the file is truncated; {fix}")

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self._prompt_lengths

    def tokens(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Token ids (int64) of document ``index``, optionally only ``length`` from ``start``;
        only the requested span is read from the memory map."""
        begin = int(self._pointers[index]) // self.dtype.itemsize + start
        end = begin - start + int(self._sizes[index]) if length is None else begin + length
        return np.asarray(self._tokens[begin:end], dtype=np.int64)

    def targets(self, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """SFT target flags: the tokens from the document's prompt length on."""
        from megatron_s2.data.documents import prompt_targets

        size = int(self._sizes[index])
        return prompt_targets(int(self._prompt_lengths[index]), start, size - start if length is None else length)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens(index)

    def __len__(self) -> int:
        return len(self._sizes)
