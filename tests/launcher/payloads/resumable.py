"""Stand-in trainer for launcher tests: resumable, preemptible, with one collective per step.

    resumable.py RUN_DIR [--steps N] [--step-time S] [--die-rank R --die-at-step K]
                 [--fail-rank R --fail-at-step K]

Every step sleeps ``--step-time`` seconds, all-reduces a value so the ranks stay in lock
step, and updates a deterministic "loss". After each step it asks the PreemptionGuard
whether to stop; then rank 0 "checkpoints" (step, loss) to RUN_DIR/checkpoints/state.json,
writes RUN_DIR/PREEMPTED like the trainer, and every rank exits with EXIT_PREEMPTED. A restart resumes from that file. A completed
run writes RUN_DIR/FINISHED like the real trainer. Rank 0 appends one JSON line per start
to RUN_DIR/events.jsonl. ``--die-rank`` makes that rank SIGKILL itself at a step,
``--fail-rank`` raise an exception (exit 1). A rank whose all-reduce fails because a peer is
gone says so in one line and exits EXIT_PEER_LOST, as ``megatron-s2 train`` does.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_s2.runtime.bootstrap import init_distributed, shutdown_distributed
from megatron_s2.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard
from megatron_s2.runtime.markers import write_preempted
from megatron_s2.runtime.peer_loss import EXIT_PEER_LOST, lost_peer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-at-step", type=int, default=-1)
    args = parser.parse_args()

    guard = PreemptionGuard().install()
    info = init_distributed(backend="gloo")
    state_file = args.run_dir / "checkpoints" / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "loss": 10.0}
    if info.rank == 0:
        with open(args.run_dir / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "start", "step": state["step"], "world": info.world_size,
                                 "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                                 "source": info.source}) + "\n")
    print(f"rank {info.rank}/{info.world_size} pid {os.getpid()} from step {state['step']}", flush=True)

    step, loss = state["step"], state["loss"]
    while step < args.steps:
        time.sleep(args.step_time)
        if info.rank == args.die_rank and step == args.die_at_step:
            print(f"rank {info.rank}: killing myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if info.rank == args.fail_rank and step == args.fail_at_step:
            raise RuntimeError(f"rank {info.rank}: simulated failure at step {step}")
        value = torch.tensor([float(info.rank + 1)])
        if info.world_size > 1:
            try:
                dist.all_reduce(value)
            except RuntimeError as exc:
                reason = lost_peer(exc)
                if reason is None:
                    raise
                print(f"rank {info.rank}: {reason}", flush=True)
                shutdown_distributed(leave_together=False)
                return EXIT_PEER_LOST
        step += 1
        loss = round(loss * 0.9 + 0.001 * value.item(), 9)
        print(f"step {step} loss {loss}", flush=True)
        if guard.should_stop():
            print(f"rank {info.rank}: stopping at step {step} on {guard.received.name if guard.received else '?'}",
                  flush=True)
            if info.rank == 0:
                state_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step, "loss": loss}))
                tmp.replace(state_file)
                # the trainer's protocol: announce the saved preemption before any rank exits
                write_preempted(args.run_dir, step, guard.received.name if guard.received else "unknown")
            shutdown_distributed()
            return EXIT_PREEMPTED
    if info.rank == 0:
        (args.run_dir / "FINISHED").write_text(json.dumps({"step": step, "loss": loss}))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
