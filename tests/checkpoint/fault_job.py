"""A training job for the fault-injection tests to kill.

``python -m tests.checkpoint.fault_job [--world N] RUN_DIR STEPS [override ...]`` trains the tiny
recipe for ``STEPS`` optimiser steps in ``RUN_DIR`` (resuming from its checkpoints, saving
after every step) on ``N`` local gloo ranks. The test sets ``MEGATRON_S2_CKPT_FAULT`` in the
job's environment; the save path then SIGKILLs the process at that point.
"""

from __future__ import annotations

import argparse
from pathlib import Path

FAST = ["training.global_batch_size=4", "checkpoint.resume=true", "checkpoint.save_interval=1",
        "checkpoint.save_at_end=true"]


def job_overrides(run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    return [*FAST, f"training.train_steps={steps}", *extra]


def _rank(rank: int, world: int, run_dir: str, steps: int, extra: list[str]) -> None:
    from tests.checkpoint.runs import train

    train(rank, world, Path(run_dir), job_overrides(Path(run_dir), steps, extra))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.world == 1:
        _rank(0, 1, args.run_dir, args.steps, args.overrides)
    else:
        from tests.parallel.spawn import run_distributed

        run_distributed(args.world, _rank, args.run_dir, args.steps, args.overrides)


if __name__ == "__main__":
    main()
