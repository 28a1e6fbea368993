"""Reading DCP's ``.metadata`` index without unpickling arbitrary objects.

``torch.distributed.checkpoint`` stores its index (tensor shapes, chunk offsets, file offsets)
as a pickle and reads it back with a bare ``pickle.load``, which runs whatever callable a
crafted file names. Checkpoints are data that travels between people and clusters, so this
module reads the index with an unpickler that resolves only the handful of classes the index
is made of (DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and refuses
everything else by name — the "restricting globals" recipe of the ``pickle`` documentation.
Tensor payloads are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from megatron_s2.checkpoint.format import CheckpointError

__all__ = ["load_dcp_index"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle '{module}.{name}' (not part of a checkpoint index)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing persistent references in a checkpoint index")


def load_dcp_index(path: Path):
    """The ``Metadata`` object of DCP's index file ``path``; CheckpointError naming the file
    when it holds anything else (or cannot be read)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = Path(path).read_bytes()
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the tensor index of the checkpoint)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise CheckpointError(f"{path}: unsafe or unreadable checkpoint index, refused ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint index; refused")
    return metadata
