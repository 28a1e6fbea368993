"""The on-disk vocabulary of a checkpoint: names, the manifest, checksums, durable writes.

A committed step directory holds::

    step_00000010/
        __0_0.distcp ...   tensor shards written by torch.distributed.checkpoint (one file per writer rank)
        .metadata          DCP's index: every tensor's global shape, dtype and the chunks that cover it
        checkpoint.json    the manifest (:class:`Manifest`): format version, step, layout, resolved
                           config, data-iterator state, and the sha256 + size of every file above
        COMMITTED          the commit marker, written last: the sha256 of checkpoint.json

Tensor keys (DCP "fully qualified names") are layout-independent:

* ``model/<parameter or buffer name>`` — global names (``layers.<i>...``), global shapes;
* ``optim/<kind>/<parameter name>/<state key>`` — optimiser state of a parameter (``kind`` is
  the sub-optimiser: muon, sinkhorn, adamw); tensors shaped like the parameter share its
  ShardSpec, others (Adam's ``step``) are stored whole;
* ``rng/<rank>/<key>`` — per-rank RNG state, restored only at an unchanged layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COMMIT",
    "DCP_METADATA",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "RNG_PREFIX",
    "LOCAL_PREFIX",
    "CheckpointError",
    "Manifest",
    "fsync_dir",
    "parse_step_name",
    "sha256_file",
    "step_name",
    "write_durable",
]

FORMAT_NAME = "megatron_s2.sharded"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
COMMIT = "COMMITTED"
LATEST = "latest"
DCP_METADATA = ".metadata"
MODEL_PREFIX, OPTIM_PREFIX, RNG_PREFIX = "model/", "optim/", "rng/"
LOCAL_PREFIX = "local/"
"""Other per-rank state restored only at the same layout, like the RNG states (a post-training
rank's rollout engine caches of its in-flight samples)."""
_STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: uncommitted, corrupted, unsafe or incompatible.
    The message names the offending file or tensor."""


def step_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def parse_step_name(name: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` directory name, None for anything else."""
    if not name.startswith(_STEP_PREFIX) or not name[len(_STEP_PREFIX):].isdigit():
        return None
    return int(name[len(_STEP_PREFIX):])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``path`` so that after return it exists with exactly ``data`` or not at all
    (temporary file, fsync, atomic rename, fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass
class Manifest:
    """Everything about a checkpoint that is not a tensor (stored as ``checkpoint.json``)."""

    step: int
    """Optimiser steps taken; also the learning-rate schedule's position."""
    world_size: int
    """Ranks of the layout the checkpoint was written for."""
    layout: str
    """``ParallelLayout.describe()`` of that layout (RNG states are restored only when equal)."""
    config: dict[str, Any]
    """The resolved recipe (``RecipeConfig.to_mapping()``)."""
    data: dict[str, Any] | None = None
    """Data-iterator state (layout-independent: a global sample count plus the stream's identity)."""
    has_optimizer: bool = False
    """Whether optimiser state tensors are stored."""
    rng_ranks: int = 0
    """Ranks whose RNG state is stored (0: none, e.g. after an offline reshard)."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every data file of the step directory: {name: {"sha256": hex, "bytes": size}}."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance: model name, torch version, writer, source of a reshard or import."""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: Path) -> Manifest:
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise CheckpointError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: not a {FORMAT_NAME} manifest (a JSON object is expected)")
        if raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: format {raw.get('format')!r}, expected {FORMAT_NAME!r}")
        version = raw.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(f"{where}: format version {version!r}; this build reads up to {FORMAT_VERSION} "
                                  "(upgrade megatron_s2 to load it)")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise CheckpointError(f"{where}: unknown manifest keys {sorted(unknown)}")
        try:
            manifest = cls(**raw)
        except TypeError as exc:
            raise CheckpointError(f"{where}: incomplete manifest ({exc})") from None
        types = {"step": int, "world_size": int, "layout": str, "config": dict, "data": (dict, type(None)),
                 "has_optimizer": bool, "rng_ranks": int, "files": dict, "info": dict}
        for key, expected in types.items():
            if not isinstance(getattr(manifest, key), expected):
                raise CheckpointError(f"{where}: '{key}' has the wrong type ({type(getattr(manifest, key)).__name__})")
        for name, entry in manifest.files.items():
            if not _plain_name(name) or not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
                raise CheckpointError(f"{where}: bad file entry {name!r}")
        return manifest


def _plain_name(name: str) -> bool:
    """A file name inside the step directory (no separators, no parent references)."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
