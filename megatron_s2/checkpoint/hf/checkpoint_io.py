"""Our sharded checkpoints as full model states, from any layout and for any layout.

The sharded format (:mod:`megatron_s2.checkpoint`) stores every model tensor once under
``model/<name>`` with its global shape, in chunks written by whichever layout saved it, plus
the manifest (step, layout, resolved recipe, checksums). Conversion therefore needs no
knowledge of the saving layout, and uses the checkpoint core's single-process entry points
(:mod:`megatron_s2.checkpoint.offline`):

* :func:`read_full_state` — ``read_model_state``: verified (commit marker, every file's
  checksum), each ``model/*`` tensor read whole through the core's safe DCP reader;
* :func:`write_full_state` — ``write_model_state``: a committed model-only checkpoint (no
  optimiser, data or RNG state) with one full chunk per tensor, for the recipe's layout
  (validated first, recorded in the manifest); any other layout can load it as well.
  :func:`read_back_as_layout` then reads the written checkpoint exactly as the ranks of the
  target layout would (each distinct rank's ShardSpecs from a skeleton of the model it
  builds) and reassembles it, so an import is verified for the layout it targets without
  starting those ranks.

These run in one process without collectives: call them outside a multi-rank job (the
core's offline functions use the default process group when one is initialised).
Start training from an imported checkpoint with
``checkpoint.load=<dir> checkpoint.load_optimizer=false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_s2.checkpoint.dcp_io import GlobalShard, load_shards
from megatron_s2.checkpoint.format import MODEL_PREFIX, step_name
from megatron_s2.checkpoint.hf.gather import assemble
from megatron_s2.models.family.skeleton import rank_skeleton_state
from megatron_s2.checkpoint.offline import read_model_state, resolve_step_dir, write_model_state
from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import apply_override, from_mapping, to_mapping
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["FullCheckpoint", "read_full_state", "write_full_state", "read_back_as_layout", "recipe_with_model"]


@dataclass
class FullCheckpoint:
    recipe: RecipeConfig
    step: int
    world_size: int
    layout: str
    state: dict[str, torch.Tensor]
    path: Path


def read_full_state(path: str | Path) -> FullCheckpoint:
    """Every model tensor of a committed checkpoint, whole, whatever layout saved it."""
    step_dir = resolve_step_dir(path, log=lambda *a: None)
    manifest, state = read_model_state(step_dir)
    recipe = from_mapping(RecipeConfig, manifest.config, f"{step_dir.name}/checkpoint.json:config")
    return FullCheckpoint(recipe, manifest.step, manifest.world_size, manifest.layout, state, step_dir)


def write_full_state(state: dict[str, torch.Tensor], recipe: RecipeConfig, root: str | Path, *,
                     world_size: int = 1, step: int = 0, source: str = "") -> Path:
    """Write ``state`` as a committed model-only checkpoint in ``root`` for the recipe's
    layout at ``world_size`` ranks."""
    target = Path(root) / step_name(step)
    if target.exists():
        raise FileExistsError(f"{target}: a checkpoint for step {step} already exists")
    return write_model_state(state, recipe, root, world_size=world_size, step=step,
                             info={"source": source, "writer": "megatron_s2.checkpoint.hf"})


def read_back_as_layout(path: str | Path, recipe: RecipeConfig, world_size: int) -> dict[str, torch.Tensor]:
    """Load ``path`` the way each rank of the layout would (its ShardSpecs, its slices), one
    representative rank per distinct set of slices, and reassemble the full state."""
    step_dir = resolve_step_dir(path, log=lambda *a: None)
    layout = ParallelLayout.from_recipe(recipe, world_size, batch=False)
    seen: set[frozenset] = set()

    def shards():
        for rank in range(world_size):
            infos = rank_skeleton_state(recipe.model, layout, rank)
            key = frozenset((n, tuple((sl.start, sl.stop) for sl in i.spec.slices())) for n, i in infos.items())
            if key in seen:
                continue
            seen.add(key)
            targets = {MODEL_PREFIX + n: GlobalShard.from_spec(torch.empty(i.shape, dtype=i.dtype), i.spec)
                       for n, i in infos.items()}
            load_shards(targets, step_dir, None)
            for n, i in infos.items():
                yield n, i.spec, targets[MODEL_PREFIX + n].local

    return assemble(shards(), where=f"{step_dir} read as '{layout.describe()}'")


def recipe_with_model(model_cfg, overrides: list[str], base: RecipeConfig | None = None) -> RecipeConfig:
    """``base`` (or defaults) with ``model`` replaced and ``section.key=value`` overrides applied."""
    tree = to_mapping((base or RecipeConfig(model=model_cfg)).replace(model=model_cfg))
    for text in overrides:
        apply_override(tree, text)
    return from_mapping(RecipeConfig, tree)
