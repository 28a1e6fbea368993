"""Single-process tools on checkpoints: full tensors in and out, and the offline reshard.

Because every stored tensor carries its global shape, a single process can read any
checkpoint as full tensors (:func:`read_full_tensors`, :func:`read_model_state`) and write
full tensors as a checkpoint for any layout (:func:`write_full_tensors`,
:func:`write_model_state`): DCP later serves each rank of that layout the slices it asks for.
These are the entry points for format conversion (Hugging Face import/export) and for:

``reshard(source, dest, overrides)`` — ``megatron-s2 checkpoint reshard <in> <out> parallel.tp=1
parallel.pp=4``. It assembles the full model and optimiser tensors in this process's memory,
validates the target layout (:meth:`ParallelLayout.from_recipe`, same messages as ``train``), and
writes a committed checkpoint whose manifest records the target layout and the resolved
config with the overrides applied, so ``megatron-s2 train <out>/../config`` or
``checkpoint.load=<out>`` starts in the new layout. Step, data-iterator state and optimiser
state carry over; per-rank RNG states are dropped (a changed layout reseeds them). Memory
need: the whole model plus optimiser state in host RAM — fine for the ``tiny``/``small``
models; for large models skip it, since ``train`` loads any checkpoint at any layout directly.
"""

from __future__ import annotations

import copy
import platform
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_s2.checkpoint.dcp_io import (
    GlobalShard,
    load_shards,
    read_index,
    save_shards,
)
from megatron_s2.checkpoint.format import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    CheckpointError,
    Manifest,
    sha256_file,
)
from megatron_s2.checkpoint.store import CheckpointStore, is_step_dir, verify_checkpoint
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout

__all__ = [
    "RESHARD_KEYS",
    "read_full_tensors",
    "read_model_state",
    "reshard",
    "resolve_step_dir",
    "write_full_tensors",
    "write_model_state",
]

RESHARD_KEYS = ("parallel.", "training.micro_batch_size=")
"""Overrides ``reshard`` accepts: the layout, and the micro-batch size some layouts need."""


def resolve_step_dir(path: str | Path, log=print) -> Path:
    """A step directory as given, or the newest valid one of a ``checkpoints/`` or run directory."""
    path = Path(path)
    if is_step_dir(path):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = CheckpointStore(root, log=log).latest_valid()
    if found is None:
        raise CheckpointError(f"{path}: holds no valid checkpoint (a committed step_* directory)")
    return found


def read_full_tensors(step_dir: Path, prefixes: tuple[str, ...] = (MODEL_PREFIX,)) -> tuple[Manifest, dict]:
    """(manifest, {key: full tensor}) of every stored tensor whose key starts with ``prefixes``."""
    step_dir = Path(step_dir)
    manifest = verify_checkpoint(step_dir)
    index = read_index(step_dir)
    targets = {}
    for fqn, md in index.state_dict_metadata.items():
        if fqn.startswith(prefixes):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{step_dir}: '{fqn}' is stored as a pickled object, not a tensor; refused")
            size = tuple(md.size)
            targets[fqn] = GlobalShard(torch.empty(size, dtype=md.properties.dtype), size, (0,) * len(size))
    load_shards(targets, step_dir, None)
    return manifest, {fqn: shard.local for fqn, shard in targets.items()}


def write_full_tensors(tensors: dict[str, torch.Tensor], manifest: Manifest, root: Path) -> Path:
    """Write ``tensors`` (key -> full tensor) as committed step ``manifest.step`` under ``root``
    (the commit protocol of :mod:`.store`; existing checkpoints there are kept)."""
    from megatron_s2.runtime.finite import first_non_finite

    bad = first_non_finite(tensors.items())
    if bad:  # never committed non-finite, whoever writes (import, reshard)
        raise CheckpointError(f"checkpoint step {manifest.step} not written: '{bad}' holds NaN or infinite values")
    store = CheckpointStore(Path(root), keep_last=sys.maxsize)
    tmp = store.prepare(manifest.step)
    shards = {fqn: GlobalShard(t.detach().cpu(), tuple(t.shape), (0,) * t.dim()) for fqn, t in tensors.items()}
    save_shards(shards, tmp, None, 0)
    manifest.files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in tmp.iterdir()}
    manifest.info.setdefault("torch", torch.__version__)
    manifest.info.setdefault("host", platform.node())
    manifest.info["writers"] = 1
    return store.commit(manifest.step, manifest)


def read_model_state(path: str | Path) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """(manifest, {parameter or buffer name: full tensor}) of a checkpoint saved at any layout;
    ``path`` is a step, ``checkpoints/`` or run directory."""
    manifest, tensors = read_full_tensors(resolve_step_dir(path), (MODEL_PREFIX,))
    return manifest, {fqn[len(MODEL_PREFIX):]: t for fqn, t in tensors.items()}


def write_model_state(state: dict[str, torch.Tensor], recipe, root: str | Path, *, world_size: int, step: int = 0,
                      info: dict | None = None) -> Path:
    """A committed, model-only checkpoint of ``state`` (full tensors by name) for the recipe's
    layout at ``world_size`` ranks; train from it with ``checkpoint.load=<path>
    checkpoint.load_optimizer=false``."""
    layout = ParallelLayout.from_recipe(recipe, world_size)
    manifest = Manifest(step=step, world_size=world_size, layout=layout.describe(), config=recipe.to_mapping(),
                        info={"model": recipe.model.name, **(info or {})})
    return write_full_tensors({MODEL_PREFIX + k: v for k, v in state.items()}, manifest, Path(root))


def reshard(source: str | Path, dest_root: str | Path, overrides: list[str], *, world_size: int | None = None,
            log=print) -> Path:
    """Rewrite the checkpoint at ``source`` for the layout given by ``overrides`` (see module
    docstring); returns the new step directory under ``dest_root``."""
    from megatron_s2.config.recipe import RecipeConfig
    from megatron_s2.config.schema import apply_override, from_mapping

    step_dir = resolve_step_dir(source, log)
    manifest = verify_checkpoint(step_dir)
    for text in overrides:
        if not text.startswith(RESHARD_KEYS):
            raise ConfigError(f"reshard: '{text}' is not a layout override; only parallel.* and "
                              "training.micro_batch_size can change (the rest of the run stays as saved)")
    tree = copy.deepcopy(manifest.config)
    for text in overrides:
        apply_override(tree, text)
    recipe = from_mapping(RecipeConfig, tree)
    world = world_size or manifest.world_size
    layout = ParallelLayout.from_recipe(recipe, world)
    dest = Path(dest_root) / step_dir.name
    if dest.resolve() == step_dir.resolve():
        raise ConfigError(f"reshard: the output {dest} is the input; write to another checkpoints directory")
    _, tensors = read_full_tensors(step_dir, (MODEL_PREFIX, OPTIM_PREFIX))
    new = Manifest(step=manifest.step, world_size=world, layout=layout.describe(), config=recipe.to_mapping(),
                   data=manifest.data, has_optimizer=manifest.has_optimizer, rng_ranks=0,
                   info={**manifest.info, "resharded_from": str(step_dir.resolve()), "source_layout": manifest.layout})
    log(f"reshard: {step_dir} ({manifest.layout}) -> {dest} ({layout.describe()}), {len(tensors)} tensors")
    return write_full_tensors(tensors, new, Path(dest_root))

