"""Pre-flight: decide the rank geometry and validate it before anything is queued or started.

An impossible layout found after hours in the queue is the most expensive kind of error.
:func:`plan_launch` settles nodes x ranks per node x GPUs from the ``launcher:`` section,
then builds the very :class:`~megatron_s2.parallel.layout.ParallelLayout` the trainer will
build, with the batch geometry, so every divisibility rule is checked at submit time, then
:func:`~megatron_s2.training.run_checks.check_run_inputs`, the trainer's own start-up checks
(run directory, tokenizer against vocabulary, data files, ``checkpoint.load``, memory on this
host in local mode), and for rl / opd phases
:func:`~megatron_s2.posttrain.checks.check_posttrain_inputs`.
Every error is a :class:`ConfigError` (exit code 2) naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.runtime.host_memory import HostMemory

__all__ = ["LaunchPlan", "plan_launch"]


@dataclass(frozen=True)
class LaunchPlan:
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    layout: ParallelLayout

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def describe(self) -> str:
        device = f"{self.gpus_per_node} GPUs" if self.gpus_per_node else "CPU"
        return (f"{self.world_size} ranks = {self.nodes} node(s) x {self.nproc_per_node} ({device}); "
                f"layout {self.layout.describe()}")


def _ranks_per_node(recipe: RecipeConfig) -> int:
    cfg, parallel = recipe.launcher, recipe.parallel
    if cfg.nproc_per_node:
        return cfg.nproc_per_node
    if cfg.gpus_per_node:
        return cfg.gpus_per_node
    world = parallel.world_size()
    if world is None:
        raise ConfigError("launcher.nproc_per_node: CPU ranks need a count; pass --nproc-per-node N "
                          "or set parallel.dp so the layout fixes the world size")
    if world % cfg.nodes:
        raise ConfigError(f"launcher.nodes: the layout's {world} ranks (tp*pp*cp*dp) do not split evenly over "
                          f"{cfg.nodes} nodes; change --nodes or pass --nproc-per-node")
    return world // cfg.nodes


def plan_launch(recipe: RecipeConfig, *, local: bool, visible_gpus: int | None = None,
                pending: tuple[str, ...] = ()) -> LaunchPlan:
    """Rank geometry for ``recipe`` and its validated layout.

    ``local``: one machine (nodes must be 1, GPUs must exist here: ``visible_gpus``, default
    ``torch.cuda.device_count()``). ``pending``: run directories of a pipeline's earlier phases,
    where checkpoints this phase loads may not exist yet.
    """
    cfg = recipe.launcher
    if local and cfg.nodes != 1:
        raise ConfigError(f"launcher.nodes: local mode runs on this machine only, got {cfg.nodes}; "
                          "use --nodes 1 or launch with --slurm")
    if local and cfg.gpus_per_node:
        if visible_gpus is None:
            import torch

            visible_gpus = torch.cuda.device_count()
        if cfg.gpus_per_node > visible_gpus:
            raise ConfigError(f"launcher.gpus_per_node: {cfg.gpus_per_node} GPUs requested but this machine has "
                              f"{visible_gpus}; lower --gpus-per-node (0 runs CPU ranks)")
    nproc = _ranks_per_node(recipe)
    if recipe.parallel.backend == "nccl" and not cfg.gpus_per_node:
        raise ConfigError("parallel.backend: nccl needs GPUs; set --gpus-per-node or parallel.backend: auto")
    sync = getattr(getattr(recipe, "rl", None), "disaggregated", None)
    if (recipe.phase.kind == "rl" and sync is not None and recipe.rl.mode == "disaggregated" and sync.weight_sync ==
            "broadcast" and sync.broadcast_backend == "nccl" and not cfg.gpus_per_node):
        raise ConfigError("rl.disaggregated.broadcast_backend: nccl needs GPU trainer ranks; set --gpus-per-node or "
                          "rl.disaggregated.broadcast_backend=gloo")
    layout = ParallelLayout.from_recipe(recipe, cfg.nodes * nproc)
    # Every other check the trainer makes at start-up, from the same function (memory only
    # where the ranks will run: this machine in local mode; compute nodes are unknown here).
    host = HostMemory.detect(nproc, gpus=bool(cfg.gpus_per_node)) if local else None
    from megatron_s2.training.run_checks import check_run_inputs  # torch: only when a launch is checked

    tokenizer = check_run_inputs(recipe, cfg.nodes * nproc, host, ranks_here=local, pending=pending)
    from megatron_s2.posttrain.checks import check_posttrain_inputs

    # rl/opd: registry names, engine settings against the model family, frozen-model paths, prompt lengths
    check_posttrain_inputs(recipe, tokenizer, pending=pending)
    return LaunchPlan(cfg.nodes, nproc, cfg.gpus_per_node, layout)
