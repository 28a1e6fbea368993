"""A run's ``checkpoints/`` directory and its commit protocol (why "latest" is never broken).

Layout::

    checkpoints/
        step_00000010/          committed checkpoints (see :mod:`.format`)
        step_00000020/
        .step_00000030.tmp/     a save in progress (or the debris of a crashed one): never loaded
        .step_00000005.deleting/  a checkpoint being deleted by retention (or its debris)
        latest                  the name of the newest committed step, replaced by atomic rename

Protocol of one save (every step is durable before the next begins):

1. rank 0 creates ``.step_N.tmp``; all ranks write their shards into it (fsync'd by DCP);
2. every rank checksums the files it wrote; rank 0 collects them and writes
   ``checkpoint.json`` (fsync) — a crash up to here leaves only a ``.tmp`` directory;
3. rank 0 writes ``COMMITTED`` holding the manifest's sha256 (fsync): from now on the
   directory is a checkpoint; it is renamed to ``step_N`` and the parent fsync'd;
4. ``latest`` is rewritten through a temporary file and ``os.replace`` (fsync);
5. retention deletes the oldest committed steps beyond ``keep_last`` — never the one just
   written, which is the newest valid checkpoint (and, since a checkpoint holding a NaN or
   infinity is never committed, the newest finite one). Each is first renamed out of the
   step namespace (``.step_N.deleting``), then emptied: a crash mid-deletion leaves garbage,
   never a committed-looking partial directory.

Leftovers of a crash (``.step_*`` directories) are never loaded; :meth:`CheckpointStore.remove_leftovers`
deletes them, naming each, when a run starts writing and before every save's free-space check
(a killed save can hold a whole checkpoint's worth of disk).

A checkpoint is *valid* when ``COMMITTED`` exists, matches the manifest, and every file the
manifest lists has its recorded size and sha256. :meth:`CheckpointStore.latest_valid` takes the
step ``latest`` names if it is valid, otherwise the newest valid one, and says which and why.
Verification can be spread over ranks (``group``): each checks every world-size-th file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from megatron_s2.checkpoint.collectives import gather_objects, group_rank, group_size
from megatron_s2.checkpoint.faults import crash_point
from megatron_s2.checkpoint.format import (
    COMMIT,
    DCP_METADATA,
    LATEST,
    MANIFEST,
    CheckpointError,
    Manifest,
    fsync_dir,
    parse_step_name,
    sha256_file,
    step_name,
    write_durable,
)

__all__ = ["CheckpointStore", "check_file", "is_step_dir", "read_manifest", "verify_checkpoint"]


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` looks like one step's directory (committed or not)."""
    return (path / COMMIT).exists() or (path / MANIFEST).exists() or parse_step_name(path.name) is not None


def read_manifest(step_dir: Path) -> Manifest:
    """The manifest of a committed checkpoint; CheckpointError naming the file otherwise."""
    marker = step_dir / COMMIT
    if not step_dir.is_dir():
        raise CheckpointError(f"{step_dir}: no such checkpoint directory")
    if not marker.is_file():
        raise CheckpointError(f"{marker}: missing — the save did not finish, so {step_dir.name} is not a checkpoint "
                              "and cannot be loaded")
    try:
        data = (step_dir / MANIFEST).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{step_dir / MANIFEST}: unreadable ({exc.strerror or exc})") from None
    if hashlib.sha256(data).hexdigest() != marker.read_text().strip():
        raise CheckpointError(f"{step_dir / MANIFEST}: checksum mismatch with {COMMIT} (the file is corrupted)")
    manifest = Manifest.from_json(data, step_dir / MANIFEST)
    if DCP_METADATA not in manifest.files:
        raise CheckpointError(f"{step_dir / MANIFEST}: lists no {DCP_METADATA} (tensor index)")
    return manifest


def check_file(step_dir: Path, name: str, entry: dict) -> str | None:
    """None if ``name`` has the recorded size and checksum, else a message naming it."""
    path = step_dir / name
    if not path.is_file():
        return f"{path}: missing from the checkpoint"
    size = path.stat().st_size
    if "bytes" in entry and size != entry["bytes"]:
        return f"{path}: {size} bytes, the manifest records {entry['bytes']} (the file is truncated or corrupted)"
    if sha256_file(path) != entry["sha256"]:
        return f"{path}: checksum mismatch (the file is corrupted)"
    return None


def verify_checkpoint(step_dir: Path, group=None) -> Manifest:
    """Manifest of a valid checkpoint, or CheckpointError naming the first bad file (in name
    order). Collective over ``group`` when given: files are checked round-robin over ranks."""
    step_dir = Path(step_dir)
    rank, world = group_rank(group), group_size(group)
    found: tuple[int, str] | None = None
    manifest = None
    try:
        manifest = read_manifest(step_dir)
        names = sorted(manifest.files)
        for i in range(rank, len(names), world):
            error = check_file(step_dir, names[i], manifest.files[names[i]])
            if error:
                found = (i, error)
                break
    except CheckpointError as exc:
        found = (-1, str(exc))
    errors = [e for e in gather_objects(found, group) if e is not None]
    if errors:
        raise CheckpointError(min(errors)[1])
    return manifest


class CheckpointStore:
    """Scanning, committing, pointing and retention for one ``checkpoints/`` directory."""

    def __init__(self, root: Path, keep_last: int = 3, log=print):
        self.root, self.keep_last, self.log = Path(root), keep_last, log

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".{step_name(step)}.tmp"

    # ---- discovery ---------------------------------------------------------------------------
    def step_dirs(self) -> list[Path]:
        """Every ``step_*`` directory, committed or not, by step."""
        if not self.root.is_dir():
            return []
        found = [(parse_step_name(p.name), p) for p in self.root.iterdir() if p.is_dir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)]

    def committed(self) -> list[Path]:
        return [p for p in self.step_dirs() if (p / COMMIT).is_file()]

    def latest_name(self) -> str | None:
        """The step directory name ``latest`` holds; None (with a note) when it is missing or
        unusable — unreadable, not text, or not a step name. ``latest`` is only a hint: the
        newest valid step is found without it."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        try:
            raw = pointer.read_bytes()
        except OSError as exc:
            self.log(f"checkpoint: {pointer} cannot be read ({exc.strerror or exc}); ignored")
            return None
        try:
            name = raw.decode("utf-8").strip()
        except UnicodeDecodeError:  # a torn write or a file copied over it
            self.log(f"checkpoint: {pointer} holds {len(raw)} bytes of binary data, not a step directory name; "
                     "ignored")
            return None
        if parse_step_name(name) is None:
            self.log(f"checkpoint: {pointer} holds {name[:64]!r}, not a step directory name; ignored")
            return None
        return name

    def latest_valid(self, group=None) -> Path | None:
        """The step ``latest`` names if valid, else the newest valid one (saying so); None if
        there is none. Collective over ``group``."""
        named = self.latest_name()
        candidates = [p for p in self.committed()[::-1] if p.name != named]
        if named:  # tried first even when uncommitted, so that the log says why it is skipped
            candidates.insert(0, self.root / named)
        for path in candidates:
            try:
                verify_checkpoint(path, group)
            except CheckpointError as exc:
                self.log(f"checkpoint: skipping {path.name}: {exc}")
                continue
            if named and path.name != named:
                self.log(f"checkpoint: 'latest' points at {named}, which is not valid; using {path.name} instead")
            return path
        return None

    # ---- the commit protocol (rank 0) --------------------------------------------------------
    def prepare(self, step: int) -> Path:
        tmp = self.tmp_dir(step)
        self.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, manifest: Manifest, rank: int = 0) -> Path:
        """Steps 2-5 of the protocol for the shards already in ``tmp_dir(step)``."""
        tmp, final = self.tmp_dir(step), self.step_dir(step)
        on_disk = {p.name for p in tmp.iterdir()}
        if set(manifest.files) != on_disk:
            raise CheckpointError(f"{tmp}: files {sorted(on_disk)} do not match the writers' report "
                                  f"{sorted(manifest.files)}")
        data = manifest.to_json()
        write_durable(tmp / MANIFEST, data)
        crash_point("before_commit", rank)
        write_durable(tmp / COMMIT, (hashlib.sha256(data).hexdigest() + "\n").encode())
        old = self.root / f".{final.name}.old"
        if final.exists():  # the same step saved again (e.g. after a fallback): replace it
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        crash_point("before_latest", rank)
        write_durable(self.root / LATEST, (final.name + "\n").encode())
        self.apply_retention(final, rank)
        return final

    def apply_retention(self, newest: Path, rank: int = 0) -> None:
        committed = self.committed()
        keep = set(committed[-self.keep_last:]) | {newest}
        for path in committed:
            if path not in keep:
                self.retire(path, rank)
        self.remove_leftovers()

    def retire(self, path: Path, rank: int = 0) -> None:
        """Delete a committed checkpoint in an order no crash can turn into a half-deleted
        checkpoint: first an atomic rename out of the step namespace (``.step_N.deleting``,
        made durable), then its files. Leftovers of a crash are garbage that ``latest_valid``
        never sees and the next save removes."""
        doomed = self.root / f".{path.name}.deleting"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        fsync_dir(self.root)
        _remove_tree(doomed, rank)

    def garbage(self) -> list[Path]:
        """Leftovers of interrupted saves and deletions (``.step_*`` directories)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(".step_*") if p.is_dir())

    def remove_leftovers(self) -> int:
        """Delete :meth:`garbage`, naming each directory and the space it held; the bytes freed.
        Only while no save is in flight (rank 0, between saves): a crashed save's directory
        can hold a whole checkpoint's worth of disk, which the next run needs."""
        freed = 0
        for debris in self.garbage():
            size = _tree_bytes(debris)
            shutil.rmtree(debris, ignore_errors=True)
            freed += size
            what = "deletion" if debris.name.endswith(".deleting") else "save"
            self.log(f"checkpoint: removed {debris.name} ({size / 2**20:.1f} MiB), left by an interrupted {what}")
        return freed


def _tree_bytes(path: Path) -> int:
    total = 0
    for child in path.rglob("*"):
        try:
            total += child.lstat().st_size if child.is_file() else 0
        except OSError:
            pass
    return total


def _remove_tree(path: Path, rank: int) -> None:
    for i, child in enumerate(sorted(path.iterdir())):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        if i == 0:
            crash_point("mid_rotation", rank)
    path.rmdir()
