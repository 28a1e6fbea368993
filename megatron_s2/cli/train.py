"""`megatron-s2 train <recipe> [section.key=value ...] [--run-dir DIR]`.

Runs one phase of a recipe in this process. Multi-rank runs are started by
`megatron-s2 launch <recipe> --local` (or SLURM), which sets the rank environment; this entry
point discovers it through the launcher's bootstrap. A run directory that already holds a
checkpoint is resumed from its newest valid checkpoint. ``<recipe>`` may also be a run
directory's ``config.yaml``, which reproduces that run on its own.

Rank 0 holds the run directory's lock (``run.lock``, :mod:`.run_lock`) for the whole run, so
a second run on the same directory is refused naming this one. Preemption signals and Ctrl-C
are caught from the first line of ``megatron_s2.cli.main`` on: the run saves at the end of the
step and exits 75 (:mod:`megatron_s2.runtime.preemption`). A rank whose collective fails because
another rank died prints one line instead of a traceback and exits 76
(:mod:`megatron_s2.runtime.peer_loss`): its launcher names the rank that died.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.runtime.run_lock import hold_run_dir

__all__ = ["register", "run", "main"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a recipe in this process",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML (or a run's config.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (highest precedence)")
    p.add_argument("--run-dir", default=None, help="run directory (default: training.run_dir of the recipe)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_s2.runtime.bootstrap import init_distributed, shutdown_distributed
    from megatron_s2.runtime.health import maybe_run_health_checks
    from megatron_s2.runtime.peer_loss import EXIT_PEER_LOST, lost_peer
    from megatron_s2.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard
    from megatron_s2.training.run_checks import check_phase_layout

    recipe = load_recipe(args.recipe, list(args.overrides))
    if args.run_dir:  # a path, not YAML: never parsed as an override value
        recipe = recipe.replace(training=dataclasses.replace(recipe.training, run_dir=args.run_dir))
    # Catch the preemption signal before anything slow happens (init, model build).
    guard = PreemptionGuard.from_config(recipe.launcher).install()
    info = init_distributed(recipe.parallel.backend)
    rank, world = info.rank, info.world_size
    leave_together = True
    try:
        needed = recipe.parallel.world_size() or recipe.parallel.model_parallel_size()
        # Validate the layout against the model first (an impossible layout is wrong whatever
        # the number of ranks), then the number of ranks this process was started with.
        ParallelLayout.from_recipe(recipe, world if world > 1 else needed)
        check_phase_layout(recipe)  # a layout the phase cannot use is wrong at any rank count
        if world == 1 and needed > 1:
            raise ConfigError(f"parallel: this layout needs {needed} ranks but the process runs alone; start it "
                              f"with `megatron-s2 launch {args.recipe} --local`")
        run_dir = Path(recipe.training.run_dir)
        # One run per run directory (run.lock), taken before anything is written there.
        with hold_run_dir(run_dir, rank, world, log=print if rank == 0 else (lambda *a: None)):
            report = maybe_run_health_checks(info, recipe.launcher)
            if report is not None and rank == 0:
                print(report.format(), flush=True)
                (run_dir / "health.json").write_text(report.to_json())
            if report is not None and not report.ok:
                print(f"rank {rank}: health checks failed; not training on this allocation", file=sys.stderr)
                return 1
            if recipe.phase.kind == "rl" and recipe.rl.mode == "disaggregated":  # batches from an orchestrator
                from megatron_s2.posttrain.disaggregated.trainer import DisaggregatedTrainer as Trainer
            elif recipe.phase.kind in ("rl", "opd"):  # rollouts co-located on these ranks
                from megatron_s2.posttrain.trainer import PosttrainTrainer as Trainer
            elif recipe.phase.kind == "contrastive":  # SigLIP vision pre-training (two towers)
                from megatron_s2.training.contrastive_trainer import ContrastiveTrainer as Trainer
            elif recipe.phase.kind == "visual_next_patch":  # text + rendered pages (walkthrough Ch. 3)
                from megatron_s2.training.next_patch_trainer import VisualNextPatchTrainer as Trainer
            elif recipe.phase.kind == "timeseries_forecast":  # text + numerical forecasts (Intern-S2 §2.2.2)
                from megatron_s2.training.forecast_trainer import ForecastTrainer as Trainer
            elif recipe.phase.kind in ("memdec", "memdec_router"):  # the Memory Decoder's phases
                from megatron_s2.posttrain.memdec.trainer import memdec_trainer

                Trainer = memdec_trainer(recipe.phase.kind)
            else:
                from megatron_s2.training.trainer import Trainer

            result = Trainer(recipe, run_dir, rank=rank, world_size=world, guard=guard, device=info.device).train()
            return EXIT_PREEMPTED if result.preempted else 0
    except Exception as exc:
        reason = lost_peer(exc) if world > 1 else None
        if reason is None:
            raise
        leave_together = False  # the barrier could only fail again, or hang under NCCL
        print(f"megatron-s2 train: rank {rank}: {reason}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        guard.uninstall()
        shutdown_distributed(leave_together)


def main(argv: list[str] | None = None) -> int:
    from megatron_s2.cli import main as cli_main

    return cli_main(["train", *(argv if argv is not None else sys.argv[1:])])
