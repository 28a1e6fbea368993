"""Per-rank checkpoints with an atomic commit protocol (same-layout resume).

Layout of ``<run_dir>/checkpoints``::

    step_00000010/            one committed checkpoint
        rank_00000.pt         that rank's model / optimiser / schedule / data / RNG state
        metadata.json         step, world size, layout, resolved config, sha256 per file
        COMMITTED             written last (fsync'd); a directory without it is not a checkpoint
    latest                    name of the newest committed step (replaced by atomic rename)

Every rank writes into a temporary directory; after a barrier rank 0 checksums the files,
writes the metadata and the commit marker, renames the directory into place and only then
moves ``latest``. A crash at any point leaves ``latest`` on the previous committed step.
Files are written with ``torch.save`` from tensors and plain containers only and read with
``weights_only=True``. Retention never deletes the newest valid checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["CheckpointManager", "CheckpointError"]

COMMIT = "COMMITTED"
LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, root: Path, rank: int = 0, world_size: int = 1, keep_last: int = 3, log=print):
        self.root, self.rank, self.world_size, self.keep_last, self.log = Path(root), rank, world_size, keep_last, log

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step:08d}"

    # ---- save --------------------------------------------------------------------------------
    def save(self, step: int, state: dict, metadata: dict) -> Path:
        final = self.root / self.step_name(step)
        tmp = self.root / f".{self.step_name(step)}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier()
        shard = tmp / f"rank_{self.rank:05d}.pt"
        with open(shard, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _barrier()
        if self.rank == 0:
            files = sorted(p.name for p in tmp.glob("rank_*.pt"))
            if len(files) != self.world_size:
                raise CheckpointError(f"{tmp}: expected {self.world_size} rank files, found {len(files)}")
            meta = dict(metadata, step=step, world_size=self.world_size, format_version=1,
                        files={name: _sha256(tmp / name) for name in files})
            _write_durable(tmp / "metadata.json", json.dumps(meta, indent=1, sort_keys=True).encode())
            _write_durable(tmp / COMMIT, b"ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _write_durable(self.root / LATEST, (final.name + "\n").encode())
            self._apply_retention()
        _barrier()
        return final

    def _apply_retention(self) -> None:
        committed = self.committed_steps()
        for name in committed[:-self.keep_last]:
            shutil.rmtree(self.root / name, ignore_errors=True)

    # ---- discovery / load -----------------------------------------------------------------------
    def committed_steps(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.glob("step_*") if (p / COMMIT).is_file())

    def verify(self, path: Path) -> dict:
        """Metadata of a committed, intact checkpoint; CheckpointError naming the bad file otherwise."""
        if not (path / COMMIT).is_file():
            raise CheckpointError(f"{path}: no {COMMIT} marker (the save did not finish); it cannot be loaded")
        try:
            meta = json.loads((path / "metadata.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path / 'metadata.json'}: unreadable ({exc})") from None
        for name, digest in meta.get("files", {}).items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file}: missing from the checkpoint")
            if _sha256(file) != digest:
                raise CheckpointError(f"{file}: checksum mismatch (the file is corrupted)")
        return meta

    def latest_valid(self) -> Path | None:
        """The checkpoint ``latest`` names, or the newest valid one (saying so) when it is bad."""
        pointer = self.root / LATEST
        named = pointer.read_text().strip() if pointer.is_file() else None
        candidates = self.committed_steps()[::-1]
        if named and named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
        for name in candidates:
            try:
                self.verify(self.root / name)
            except CheckpointError as exc:
                self.log(f"checkpoint: skipping {name}: {exc}")
                continue
            if named and name != named:
                self.log(f"checkpoint: 'latest' points at {named}, which is not valid; using {name} instead")
            return self.root / name
        return None

    def load(self, path: Path) -> tuple[dict, dict]:
        meta = self.verify(path)
        if meta["world_size"] != self.world_size:
            raise CheckpointError(f"{path}: saved by {meta['world_size']} ranks, loading with {self.world_size}; "
                                  "this per-rank format needs the same layout (use the sharded checkpoint format "
                                  "to change layouts)")
        shard = path / f"rank_{self.rank:05d}.pt"
        try:
            state = torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling of anything but tensors/containers is refused here
            raise CheckpointError(f"{shard}: cannot be loaded safely ({type(exc).__name__}: {exc})") from None
        return state, meta
