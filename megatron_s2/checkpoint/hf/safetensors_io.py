"""Hugging Face-style sharded safetensors: writing, and a reader that refuses anything else.

Layout written (the ``transformers`` convention)::

    <dir>/model-00001-of-00004.safetensors ...   tensors, at most ``max_shard_bytes`` each
    <dir>/model.safetensors.index.json           {"metadata": {"total_size": N}, "weight_map": {name: file}}

A single shard is still indexed (one format for every size). The reader accepts only
safetensors: a directory holding pickle-based weights (``pytorch_model.bin``, ``*.pt``,
``*.pth``, ``*.ckpt``, ``*.pkl``) and no safetensors is refused, and every ``.safetensors`` file
is checked to start with a safetensors header before it is opened, so a pickle (or a
``torch.save`` zip) renamed to ``.safetensors`` is refused with the file named, instead of
being handed to an unpickler. Unpickling executes code from the file; a downloaded checkpoint
is untrusted input.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["INDEX_FILE", "SIDECAR_PREFIX", "UnsafeCheckpointError", "CorruptSafetensorsError", "SafetensorsReader",
           "write_sharded", "check_safetensors_file", "open_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SIDECAR_PREFIX = "megatron_s2_"
"""Files with this prefix are ours (verification data), never model weights."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_HEADER = 100 * 1024 * 1024


class UnsafeCheckpointError(ValueError):
    """A checkpoint that is not (only) safetensors, or a file that is not what its name says."""


class CorruptSafetensorsError(UnsafeCheckpointError):
    """A safetensors file the library cannot read (truncated, corrupt); the message names it."""


@contextlib.contextmanager
def open_safetensors(path: Path):
    """``safe_open`` whose failures (the library's own errors name no file) name ``path``."""
    why = "the file is truncated or corrupt"
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptSafetensorsError(f"{path}: cannot be read as safetensors ({exc}); {why}") from None
    with handle as f:
        try:
            yield f
        except (SafetensorError, OSError) as exc:
            raise CorruptSafetensorsError(f"{path}: cannot be read as safetensors ({exc}); {why}") from None


def _sniff(head: bytes) -> str:
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle"
    if head[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save format, which embeds a pickle)"
    return "not a safetensors file"


def check_safetensors_file(path: Path) -> None:
    """Raise :class:`UnsafeCheckpointError` unless ``path`` starts with a safetensors header."""
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 9:
            raise UnsafeCheckpointError(f"{path}: truncated ({len(head)} bytes); not a safetensors file")
        (n,) = struct.unpack("<Q", head[:8])
        if not (2 <= n <= _MAX_HEADER) or head[8:9] != b"{":
            raise UnsafeCheckpointError(f"{path}: {_sniff(head)}; only safetensors are loaded (refusing to unpickle)")
        f.seek(8)
        try:
            json.loads(f.read(n))
        except ValueError:
            raise UnsafeCheckpointError(f"{path}: corrupt safetensors header") from None


class SafetensorsReader:
    """Lazy, name-addressed access to the tensors of a safetensors checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir}: not a directory")
        files = sorted(p for p in self.dir.glob("*.safetensors") if not p.name.startswith(SIDECAR_PREFIX))
        if not files:
            pickles = sorted(p.name for p in self.dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
            found = f" (found {', '.join(pickles)})" if pickles else ""
            raise UnsafeCheckpointError(f"{self.dir}: no .safetensors files{found}; pickle-based weights are refused "
                                        "— convert them to safetensors with a trusted tool first")
        index_path = self.dir / INDEX_FILE
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                raise UnsafeCheckpointError(f"{index_path}: not valid JSON ({exc})") from None
            if not isinstance(index, dict):
                raise UnsafeCheckpointError(f"{index_path}: expected a JSON object with a 'weight_map'")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise UnsafeCheckpointError(f"{index_path}: no 'weight_map'")
            names = {str(v) for v in weight_map.values()}
            for name in names:
                if Path(name).name != name or not name.endswith(".safetensors"):
                    raise UnsafeCheckpointError(f"{index_path}: refers to '{name}', which is not a safetensors "
                                                "file in this directory")
            files = [self.dir / n for n in sorted(names)]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX_FILE} but missing")
            check_safetensors_file(path)
        self.files = files
        self._where: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        for path in files:
            with open_safetensors(path) as f:
                self.metadata.update(f.metadata() or {})
                for key in f.keys():
                    if key in self._where:
                        raise UnsafeCheckpointError(f"{self.dir}: tensor '{key}' is stored in both "
                                                    f"{self._where[key].name} and {path.name}")
                    self._where[key] = path

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        """The safetensors file holding ``name``."""
        return self._where[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.dir}: no tensor '{name}'")
        with open_safetensors(self._where[name]) as f:
            return f.get_tensor(name)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) without reading the data."""
        with open_safetensors(self._where[name]) as f:
            sl = f.get_slice(name)
            return tuple(sl.get_shape()), sl.get_dtype()


def _shard_plan(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in items:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_sharded(out_dir: str | Path, plan: list[tuple[str, int]], produce, *, max_shard_bytes: int,
                  metadata: dict[str, str] | None = None, progress: Iterable | None = None) -> list[Path]:
    """Write tensors into sharded safetensors files plus the index.

    ``plan``: (name, nbytes) in file order; ``produce(names) -> {name: tensor}`` materialises one
    shard's tensors (so at most one shard is in memory beyond the source state);
    ``progress``: an object with ``update(n)`` (tqdm) or None.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shard_plan(plan, max_shard_bytes)
    total = len(shards)
    weight_map, paths, total_size = {}, [], 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{total:05d}.safetensors"
        tensors = produce(names)
        if set(tensors) != set(names):
            raise RuntimeError(f"shard {file}: produced {sorted(set(tensors) ^ set(names))[:3]} unexpectedly")
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        save_file(tensors, str(out / file), metadata={"format": "pt", **(metadata or {})})
        for n, t in tensors.items():
            weight_map[n] = file
            total_size += t.numel() * t.element_size()
        paths.append(out / file)
        if progress is not None:
            progress.update(len(names))
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths
