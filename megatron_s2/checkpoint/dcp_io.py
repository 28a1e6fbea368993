"""torch.distributed.checkpoint (DCP) glue: global shards, a writer, a safe reader, planners.

:class:`GlobalShard` is how a rank tells DCP "this local tensor is the slice at ``offsets``
of a global tensor of shape ``global_shape``". It implements DCP's checkpointable protocol
(``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``, the
hooks DTensor uses), so DCP's own planners produce one chunk per distinct slice when saving
— replicas of the same slice are written once (DCP deduplicates identical chunks across
ranks, balancing bytes per rank) and the global plan is validated to cover every tensor
exactly — and, when loading, read requests for exactly the overlap between each stored chunk
and the slice this rank wants, whatever layout wrote the chunks. No process group or device
mesh is needed to describe a shard: the :class:`~megatron_s2.parallel.sharding.ShardSpec` of
a parameter already says where its slice sits.

Reading is restricted to tensors: the index goes through :mod:`.safe_pickle`, payloads
through ``torch.load(weights_only=True)`` (DCP's reader), file references must stay inside
the step directory, and a request for a pickled (``BYTE_IO``) object is refused.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.futures import Future

from megatron_s2.checkpoint.faults import crash_point, fail_point, fault_armed
from megatron_s2.checkpoint.format import DCP_METADATA, CheckpointError
from megatron_s2.checkpoint.safe_pickle import load_dcp_index
from megatron_s2.parallel.sharding import ShardSpec

__all__ = ["GlobalShard", "load_shards", "read_index", "save_shards"]

# Single-process saves and loads (group=None) are intended, not a misconfigured process group.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


class GlobalShard:
    """This rank's slice of a global tensor, as DCP sees it."""

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...], offsets: tuple[int, ...]):
        if len(global_shape) != local.dim() or len(offsets) != local.dim():
            raise ValueError(f"shard of rank {local.dim()} cannot sit at {offsets} in a tensor of shape {global_shape}")
        for size, off, full in zip(local.shape, offsets, global_shape):
            if off < 0 or off + size > full:
                raise ValueError(f"shard {tuple(local.shape)} at {offsets} exceeds the global shape {global_shape}")
        self.local = local
        self.global_shape = torch.Size(global_shape)
        self.offsets = torch.Size(offsets)

    @classmethod
    def from_spec(cls, local: torch.Tensor, spec: ShardSpec) -> GlobalShard:
        if tuple(local.shape) != spec.local_shape():
            raise ValueError(f"tensor of shape {tuple(local.shape)} is not the {spec.local_shape()} slice of "
                             f"{spec.full_shape} that its ShardSpec {spec.splits} describes")
        return cls(local, spec.full_shape, tuple(s.start for s in spec.slices()))

    def size(self) -> torch.Size:
        return self.global_shape

    # ---- DCP checkpointable protocol -------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk,
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.global_shape))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> torch.Tensor:
    obj = state_dict.get(index.fqn)
    if isinstance(obj, GlobalShard):
        return obj.local
    return find_state_dict_object(state_dict, index)


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        for fqn, md in metadata.state_dict_metadata.items():  # DCP checks overlaps; we also check coverage
            stored = sum(math.prod(c.sizes) for c in md.chunks)
            if stored != math.prod(md.size):
                raise CheckpointError(f"'{fqn}': the ranks' shards cover {stored} of its {math.prod(md.size)} "
                                      f"elements (global shape {tuple(md.size)}); a ShardSpec is wrong")
        return plans, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            raise CheckpointError(f"'{write_item.index.fqn}': only tensors are stored in checkpoints "
                                  "(non-tensor state belongs in the manifest)")
        return object


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner would first map every leaf through _init_state_dict, which turns
        # objects that are not tensors (our GlobalShards) into None; targets are never meta.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        for fqn in self.state_dict:
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is not None and not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"'{fqn}' is stored as a pickled object, not a tensor; refused")
        return super().create_local_plan()

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"'{read_item.dest_index.fqn}': refusing to unpickle an object from a checkpoint")


class _CrashingStream:
    """A shard file that dies (``mid_shard``) or runs out of space (``enospc_mid_shard``)
    half-way through its first write."""

    def __init__(self, stream, rank: int, path):
        self._stream, self._rank, self._path = stream, rank, str(path)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._stream.write(view[: max(1, len(view) // 2)])
        self._stream.flush()
        os.fsync(self._stream.fileno())
        crash_point("mid_shard", self._rank)
        fail_point("enospc_mid_shard", self._rank, self._path)
        return self._stream.write(view[max(1, len(view) // 2):])

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _CrashingFileSystem(FileSystem):
    def __init__(self, rank: int):
        super().__init__()
        self._rank = rank

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _CrashingStream(stream, self._rank, path) if str(path).endswith(".distcp") else stream


class _Writer(FileSystemWriter):
    def __init__(self, path: Path, rank: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        if fault_armed("mid_shard", rank) or fault_armed("enospc_mid_shard", rank):
            self.fs = _CrashingFileSystem(rank)


class _Reader(FileSystemReader):
    """DCP's file reader, minus pickles and paths outside the step directory."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = load_dcp_index(Path(self.path) / DCP_METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for index, info in self.storage_data.items():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
                raise CheckpointError(f"{Path(self.path) / DCP_METADATA}: tensor '{index.fqn}' points at "
                                      f"{name!r}, outside the checkpoint directory; refused")

    def read_data(self, plan: LoadPlan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"'{item.dest_index.fqn}': refusing to unpickle an object from a checkpoint")
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            try:
                super().read_data(LoadPlan(items), planner).wait()
            except CheckpointError:
                raise
            except Exception as exc:  # torch.load(weights_only=True) refusals, truncation, bad zip data
                raise CheckpointError(f"{Path(self.path) / name}: cannot be read safely "
                                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        done: Future = Future()
        done.set_result(None)
        return done


def save_shards(state: dict[str, GlobalShard], directory: Path, group, rank: int) -> None:
    """Collective over ``group`` (or single-process when None): write ``state`` into ``directory``.
    A rank's full disk is raised as its ``OSError`` (ENOSPC), other failures as CheckpointError."""
    group, no_dist = _dcp_group(group)
    try:
        dcp.save(state, storage_writer=_Writer(directory, rank), planner=_SavePlanner(), process_group=group,
                 no_dist=no_dist)
    except CheckpointException as exc:  # DCP's per-rank failures (a BaseException): surface the first
        full = _disk_full(exc)
        if full is not None:
            raise full from None
        raise CheckpointError(_first_failure(exc, directory)) from None


def load_shards(state: dict[str, GlobalShard], directory: Path, group) -> None:
    """Collective over ``group``: fill every shard of ``state`` from the checkpoint in ``directory``."""
    group, no_dist = _dcp_group(group)
    try:
        dcp.load(state, storage_reader=_Reader(directory), planner=_LoadPlanner(), process_group=group,
                 no_dist=no_dist)
    except CheckpointException as exc:  # DCP's per-rank failures (a BaseException): surface the first
        raise CheckpointError(_first_failure(exc, directory)) from None


def read_index(directory: Path):
    """DCP's index of a step directory (safe: see :mod:`.safe_pickle`)."""
    return load_dcp_index(Path(directory) / DCP_METADATA)


def _distributed(group) -> bool:
    """``group=None`` is a single process even inside a distributed job (offline tools)."""
    return group is not None and dist.get_world_size(group) > 1


_LOCAL_GROUP = None


def _dcp_group(group):
    """(group, no_dist) for DCP. Inside a distributed job, a single-process read or write
    (offline tools, conversions) must not touch the default group, or it waits for ranks that
    never join: it gets a process-local group instead."""
    global _LOCAL_GROUP
    if group is None and dist.is_available() and dist.is_initialized():
        if _LOCAL_GROUP is None:
            _LOCAL_GROUP = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return _LOCAL_GROUP, False
    return group, not _distributed(group)


def _disk_full(exc: Exception) -> OSError | None:
    """The ENOSPC error of any rank in DCP's collected failures, if one ran out of space."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError) and inner.errno == errno.ENOSPC:
            return inner
    return None


def _first_failure(exc: Exception, directory: Path) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = min(failures.items(), key=lambda kv: kv[0])
        inner_exc = inner[0] if isinstance(inner, tuple) else inner
        return str(inner_exc) if isinstance(inner_exc, CheckpointError) else f"{directory}: rank {rank}: {inner_exc}"
    return f"{directory}: {type(exc).__name__}: {exc}"
