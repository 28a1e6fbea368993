"""Disk space for a save: the bytes it will write and the bytes free to take them.

Before a save writes anything, :class:`~megatron_s2.checkpoint.manager.CheckpointManager`
compares :func:`save_size` with :func:`free_bytes` of the checkpoints' file system, so a full
disk is named up front instead of being discovered as a truncated shard. The estimate counts
what DCP really writes, not just the tensors' bytes:

* each distinct chunk once: a chunk held by several ranks (a data-parallel replica) is written
  by one of them (DCP deduplicates by tensor name and offsets);
* per chunk, the ``torch.save`` record DCP wraps it in (measured once in this process, about
  1.5 KiB: a zip entry, a pickle and 64-byte alignment) and its entry in the ``.metadata``
  index; plus the manifest;
* never less than the newest committed checkpoint of the same layout: the same state saved
  before, whose file sizes its manifest records.

On the tiny recipe the tensors are 5.5 MiB but the shard file is 6.4 MiB: an estimate of tensor
bytes alone let a save start on a disk that could not hold it.
"""

from __future__ import annotations

import functools
import io
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from megatron_s2.checkpoint.format import CheckpointError, Manifest

if TYPE_CHECKING:
    from megatron_s2.checkpoint.dcp_io import GlobalShard

__all__ = ["ChunkSizes", "chunk_sizes", "committed_size", "free_bytes", "mib", "save_size"]

ChunkSizes = dict[tuple[str, tuple[int, ...]], int]
"""Bytes of each chunk a rank saves, by (tensor name, offsets in the global tensor)."""

_INDEX_BYTES_PER_CHUNK = 256
"""``.metadata`` bytes per chunk besides its name (pickled index entries: ~175 on the tiny recipe)."""
_MANIFEST_BYTES = 64 * 1024
"""``checkpoint.json`` (config, data state) and ``COMMITTED``; plus one file entry per rank."""
_MANIFEST_BYTES_PER_FILE = 256


def chunk_sizes(shards: dict[str, GlobalShard]) -> ChunkSizes:
    """What this rank would write: tensor bytes per chunk."""
    return {(fqn, tuple(shard.offsets)): shard.local.numel() * shard.local.element_size()
            for fqn, shard in shards.items()}


@functools.cache
def _record_overhead() -> int:
    """Bytes ``torch.save`` adds around one tensor's data, as DCP writes each chunk: measured
    on a one-element tensor, plus the up-to-64-byte alignment of the data record."""
    import torch

    buffer = io.BytesIO()
    torch.save(torch.zeros(1, device="cpu"), buffer)
    return len(buffer.getvalue()) - 4 + 64


def save_size(reports: Iterable[ChunkSizes], previous: int = 0) -> int:
    """Bytes a save of every rank's ``reports`` (:func:`chunk_sizes`) will write, at least
    ``previous`` (the size of the same state saved before, :func:`committed_size`)."""
    chunks: ChunkSizes = {}
    writers = 0
    for report in reports:
        chunks.update(report)  # a replicated chunk is written once
        writers += 1
    per_chunk = _record_overhead() + _INDEX_BYTES_PER_CHUNK
    estimate = (sum(chunks.values()) + sum(per_chunk + len(name) for name, _ in chunks)
                + _MANIFEST_BYTES + _MANIFEST_BYTES_PER_FILE * writers)
    return max(estimate, previous)


def committed_size(step_dir: Path, like: Manifest) -> int:
    """Bytes of a committed checkpoint's files, when it holds the same kind of state as ``like``
    (layout, writers, optimiser state); 0 otherwise or when its manifest is unreadable."""
    from megatron_s2.checkpoint.store import read_manifest

    try:
        manifest = read_manifest(step_dir)
    except CheckpointError:
        return 0
    same = (manifest.layout, manifest.world_size, manifest.has_optimizer) == (like.layout, like.world_size,
                                                                             like.has_optimizer)
    return sum(int(entry.get("bytes", 0)) for entry in manifest.files.values()) if same else 0


def free_bytes(path: Path) -> int | None:
    """Free bytes of the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
