"""`megatron-s2 train <recipe> [section.key=value ...] [--run-dir DIR]`.

Runs one phase of a recipe in this process. Multi-rank runs are started by
`megatron-s2 launch <recipe> --local` (or SLURM), which sets the rank environment; this entry
point discovers it through the launcher's bootstrap. A run directory that already holds a
checkpoint is resumed from its newest valid checkpoint. ``<recipe>`` may also be a run
directory's ``config.yaml``, which reproduces that run on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_s2.config.recipe import load_recipe

__all__ = ["register", "run", "main"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a recipe in this process",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML (or a run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (highest precedence)")
    p.add_argument("--run-dir", default=None, help="run directory (default: training.run_dir of the recipe)")
    p.set_defaults(func=run)


def _init_distributed(backend: str):
    try:
        from megatron_s2.launcher.bootstrap import init_distributed
    except ModuleNotFoundError:
        return 0, 1
    info = init_distributed(backend)
    return info.rank, info.world_size


def _guard():
    try:
        from megatron_s2.launcher.preemption import PreemptionGuard
    except ModuleNotFoundError:
        return None, None
    from megatron_s2.launcher.preemption import EXIT_PREEMPTED

    return PreemptionGuard(), EXIT_PREEMPTED


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"training.run_dir={args.run_dir}")
    recipe = load_recipe(args.recipe, overrides)
    rank, world = _init_distributed(recipe.parallel.backend)
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.parallel.layout import ParallelLayout

    needed = recipe.parallel.world_size() or recipe.parallel.model_parallel_size()
    # Validate the layout against the model first (an impossible layout is wrong whatever the
    # number of ranks), then the number of ranks this process was started with.
    ParallelLayout.build(recipe.parallel, recipe.model, world if world > 1 else needed,
                         seq_length=recipe.training.seq_length, global_batch_size=recipe.training.global_batch_size,
                         micro_batch_size=recipe.training.micro_batch_size)
    if world == 1 and needed > 1:
        raise ConfigError(f"parallel: this layout needs {needed} ranks but the process runs alone; start it with "
                          f"`megatron-s2 launch {args.recipe} --local`")
    from megatron_s2.training.trainer import Trainer

    guard, exit_preempted = _guard()
    trainer = Trainer(recipe, Path(recipe.training.run_dir), rank=rank, world_size=world, guard=guard)
    result = trainer.train()
    if result.preempted and exit_preempted is not None:
        return exit_preempted
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_s2.cli import main as cli_main

    return cli_main(["train", *(argv if argv is not None else sys.argv[1:])])
