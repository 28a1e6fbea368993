"""Human-readable reports of checkpoints (``megatron-s2 checkpoint inspect`` / ``verify``).

Everything printed comes from the manifest and DCP's index, both read safely; nothing is
loaded into a model. ``verify`` also reads every floating tensor (through the same safe
reader, a batch at a time) and refuses NaN or infinities. A ``checkpoints/`` directory is summarised step by step (committed or
not, which one ``latest`` names), then the checkpoint ``latest`` resolves to is described.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_s2.checkpoint.dcp_io import read_index
from megatron_s2.checkpoint.format import (
    COMMIT,
    LOCAL_PREFIX,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    RNG_PREFIX,
    CheckpointError,
    Manifest,
)
from megatron_s2.checkpoint.store import CheckpointStore, check_file, read_manifest

__all__ = ["describe_root", "describe_step", "human_bytes", "verify_lines"]


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tensor_summary(step_dir: Path) -> list[str]:
    index = read_index(step_dir)
    counts, numel = Counter(), Counter()
    for fqn, md in index.state_dict_metadata.items():
        kind = next((p[:-1] for p in (MODEL_PREFIX, OPTIM_PREFIX, RNG_PREFIX, LOCAL_PREFIX) if fqn.startswith(p)),
                    "other")
        if not isinstance(md, TensorStorageMetadata):
            kind = "NOT A TENSOR (refused when loading)"
        counts[kind] += 1
        if not isinstance(md, TensorStorageMetadata):
            continue
        n = 1
        for s in md.size:
            n *= s
        numel[kind] += n
    return [f"  {kind:<10} {counts[kind]:>6} tensors  {numel[kind]:>14,} elements" for kind in sorted(counts)]


def describe_step(step_dir: Path, *, config: bool = True) -> tuple[list[str], Manifest | None]:
    """Report lines for one step directory, and its manifest (None when it is not committed)."""
    step_dir = Path(step_dir)
    lines = [f"checkpoint:  {step_dir}"]
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as exc:
        lines.append(f"status:      NOT VALID — {exc}")
        return lines, None
    total = sum(int(e.get("bytes", 0)) for e in manifest.files.values())
    lines += [
        f"status:      committed ({COMMIT} matches the manifest)",
        f"format:      {manifest.format} v{manifest.format_version}",
        f"step:        {manifest.step}",
        f"layout:      {manifest.layout} ({manifest.world_size} ranks)",
        f"model:       {manifest.info.get('model', '?')}",
        f"optimizer:   {'stored' if manifest.has_optimizer else 'not stored (model only)'}",
        f"rng:         {f'{manifest.rng_ranks} ranks' if manifest.rng_ranks else 'not stored'}",
        f"data:        {_data_line(manifest.data)}",
    ]
    if manifest.info.get("resharded_from"):
        lines.append(f"resharded:   from {manifest.info['resharded_from']} ({manifest.info.get('source_layout', '?')})")
    lines.append("tensors:")
    try:
        lines += _tensor_summary(step_dir)
    except CheckpointError as exc:
        lines.append(f"  unreadable index: {exc}")
    lines.append(f"files:       {len(manifest.files)} files, {human_bytes(total)}")
    for name, entry in sorted(manifest.files.items()):
        lines.append(f"  {name:<24} {human_bytes(int(entry.get('bytes', 0))):>10}  sha256 {entry['sha256']}")
    if config:
        lines.append("config (resolved):")
        lines += ["  " + line for line in yaml.safe_dump(manifest.config, sort_keys=False).splitlines()]
    return lines, manifest


def _data_line(data: dict | None) -> str:
    if not data:
        return "not stored"
    return f"consumed_samples={data.get('consumed_samples')} seed={data.get('seed')} seq_length={data.get('seq_length')}"


def describe_root(root: Path) -> tuple[list[str], Path | None]:
    """Summary lines of a ``checkpoints/`` directory and the step directory to describe next."""
    messages: list[str] = []
    store = CheckpointStore(Path(root), log=messages.append)
    named = store.latest_name()
    lines = [f"checkpoints: {root}", f"latest:      {named or '(none)'}"]
    for path in store.step_dirs():
        state = "committed" if (path / COMMIT).is_file() else "NOT COMMITTED (ignored)"
        lines.append(f"  {path.name}  {state}{'  <- latest' if path.name == named else ''}")
    chosen = store.latest_valid()
    lines += [f"note:        {m}" for m in messages]
    if chosen is None:
        lines.append("no valid checkpoint")
    return lines, chosen


def verify_lines(step_dir: Path, values: bool = True) -> tuple[list[str], bool]:
    """Check every file of a step directory, in name order; stop at the first bad one. With
    ``values``, also read every floating tensor and refuse NaN or infinities."""
    step_dir = Path(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as exc:
        return [f"FAILED {exc}"], False
    for name in sorted(manifest.files):
        error = check_file(step_dir, name, manifest.files[name])
        if error:
            return [f"FAILED {error}"], False
    total = sum(int(e.get("bytes", 0)) for e in manifest.files.values())
    what = "all checksums match"
    if values:
        try:
            bad, count = first_non_finite_tensor(step_dir)
        except CheckpointError as exc:
            return [f"FAILED {exc}"], False
        if bad:
            return [f"FAILED {step_dir}: tensor '{bad}' holds NaN or infinite values"], False
        what += f", {count} floating tensors finite"
    return [f"OK     {step_dir} ({len(manifest.files)} files, {human_bytes(total)}, {what})"], True


def first_non_finite_tensor(step_dir: Path, batch_bytes: int = 256 << 20) -> tuple[str | None, int]:
    """(first stored floating tensor holding a NaN or infinity, or None; tensors checked), read
    whole through the safe DCP reader in batches of about ``batch_bytes``."""
    import torch

    from megatron_s2.checkpoint.dcp_io import GlobalShard, load_shards

    index = read_index(step_dir)
    keys = sorted(k for k, md in index.state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata) and md.properties.dtype.is_floating_point)
    batch: dict[str, GlobalShard] = {}
    size = 0

    def flush() -> str | None:
        load_shards(batch, step_dir, None)
        found = next((k for k, s in batch.items() if not bool(torch.isfinite(s.local).all())), None)
        batch.clear()
        return found

    for key in keys:
        md = index.state_dict_metadata[key]
        shape = tuple(md.size)
        batch[key] = GlobalShard(torch.empty(shape, dtype=md.properties.dtype), shape, (0,) * len(shape))
        size += batch[key].local.numel() * batch[key].local.element_size()
        if size >= batch_bytes:
            if bad := flush():
                return bad, len(keys)
            size = 0
    if batch and (bad := flush()):
        return bad, len(keys)
    return None, len(keys)
