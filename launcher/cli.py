"""`megatron-s2 launch`: run a recipe (or a pipeline of recipes) locally or on SLURM.

    megatron-s2 launch <recipe|pipeline.yaml> [section.key=value ...] (--local | --slurm | --summary)
        [--nodes N] [--gpus-per-node G] [--nproc-per-node P] [--mode srun|torchrun]
        [--partition P] [--time T] [--account A] [--job-name J] [--sbatch-arg ARG]...
        [--container-image I] [--mount SRC:DST]... [--env NAME[=VALUE]]... [--srun-arg ARG]...
        [--mpi PLUGIN] [--max-restarts K] [--signal SIG] [--signal-lead-time S]
        [--health-checks auto|on|off] [--python PATH] [--run-dir DIR] [--dry-run]

Each flag is the ``launcher:`` field of the same name (``--mount`` is
``container_mounts``; ``--env NAME=VALUE`` is ``env_override``, ``--env NAME``
``env_passthrough``). Exit codes: 0 success, 2 configuration error (nothing started or
queued), 75 stopped by preemption (local), 1 a rank failed (local: one line names it, how it
ended and its log).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_s2.launcher.environment import parse_env_flags
from megatron_s2.launcher.launch import launch_local, launch_slurm, prepare_runs
from megatron_s2.launcher.summary import summarise

__all__ = ["register", "run", "launcher_flags"]

# argparse destination -> LauncherConfig field, for flags whose value is taken as given.
_SCALAR_FLAGS = ("nodes", "gpus_per_node", "nproc_per_node", "mode", "partition", "time", "account", "job_name",
                 "mpi", "container_image", "python", "max_restarts", "signal", "signal_lead_time", "health_checks")
_LIST_FLAGS = {"mount": "container_mounts", "srun_arg": "srun_args", "sbatch_arg": "sbatch_args"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="run a recipe locally or on SLURM",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML, or a pipeline YAML with a phases: list")
    p.add_argument("overrides", nargs="*", metavar="[PHASE:]section.key=value",
                   help="recipe overrides; in a pipeline file they reach every phase, or only PHASE when prefixed")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="one process per rank on this machine")
    where.add_argument("--slurm", action="store_true", help="write an sbatch script and submit it")
    where.add_argument("--summary", action="store_true",
                       help="print the first and last held-out evaluation of every phase that has run; start nothing")

    ranks = p.add_argument_group("ranks")
    ranks.add_argument("--nodes", type=int, help="nodes (SLURM)")
    ranks.add_argument("--gpus-per-node", type=int, help="GPUs per node; 0 = CPU ranks")
    ranks.add_argument("--nproc-per-node", "--nproc", type=int, help="rank processes per node")
    ranks.add_argument("--mode", choices=("srun", "torchrun"), help="one srun task per rank, or torchrun per node")

    slurm = p.add_argument_group("SLURM")
    slurm.add_argument("--partition")
    slurm.add_argument("--time", help="time limit, e.g. 04:00:00")
    slurm.add_argument("--account")
    slurm.add_argument("--job-name")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG", help="extra sbatch option")
    slurm.add_argument("--srun-arg", action="append", default=[], metavar="ARG", help="extra srun option")
    slurm.add_argument("--mpi", metavar="PLUGIN", help="srun --mpi plugin (default: the site's)")
    slurm.add_argument("--container-image", metavar="IMAGE", help="pyxis container image")
    slurm.add_argument("--mount", action="append", default=[], metavar="SRC:DST", help="pyxis container mount")
    slurm.add_argument("--max-restarts", type=int, help="requeues after preemption")
    slurm.add_argument("--signal", help="warning signal before the time limit (default USR1)")
    slurm.add_argument("--signal-lead-time", type=int, metavar="SECONDS", help="seconds before the time limit")

    common = p.add_argument_group("both modes")
    common.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="NAME=VALUE: set for every rank; NAME: pass through from this shell")
    common.add_argument("--health-checks", choices=("auto", "on", "off"))
    common.add_argument("--python", help="interpreter for rank processes")
    common.add_argument("--run-dir", help="run directory (training.run_dir; a pipeline's parent directory)")
    common.add_argument("--dry-run", action="store_true", help="validate and print; start and submit nothing")
    p.set_defaults(func=run)


def launcher_flags(args: argparse.Namespace) -> dict:
    """The LauncherConfig fields given on the command line."""
    flags = {name: getattr(args, name) for name in _SCALAR_FLAGS if getattr(args, name) is not None}
    flags.update({field: tuple(getattr(args, dest)) for dest, field in _LIST_FLAGS.items() if getattr(args, dest)})
    overrides, passthrough = parse_env_flags(args.env)
    if overrides:
        flags["env_override"] = overrides
    if passthrough:
        flags["env_passthrough"] = passthrough
    return flags


def run(args: argparse.Namespace) -> int:
    # --summary reads run directories only: the launcher flags of a job it does not start do not apply
    runs = prepare_runs(args.recipe, list(args.overrides), {} if args.summary else launcher_flags(args),
                        args.run_dir, local=args.local or args.summary)
    if args.summary:
        print(summarise([(run.phase or Path(run.job.run_dir).name, run.job.run_dir) for run in runs]))
        return 0
    if args.local:
        return launch_local(runs, dry_run=args.dry_run)
    return launch_slurm(runs, dry_run=args.dry_run)


if __name__ == "__main__":  # python -m megatron_s2.launcher.cli ... (without the umbrella CLI)
    from megatron_s2.cli import main

    sys.exit(main(["launch", *sys.argv[1:]]))
