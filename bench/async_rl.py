"""Disaggregated asynchronous RL against co-located synchronous RL at equal processes (issue 25, seed 004).

One run, side by side, on this machine's CPUs, the same recipe, seed and starting policy:

* **co-located synchronous** — ``rl.mode: colocated``, ``max_staleness: 0``, two data-parallel
  trainer ranks, each generating its half of every batch on its own engine, then training
  (generate -> update -> generate: the step waits for its longest response);
* **disaggregated asynchronous** — ``rl.mode: disaggregated``, one inference server process and
  one trainer process (plus the orchestrator, an HTTP client that mostly waits), ``max_async_level``
  k: batch s+1 is generated while the trainer trains on batch s, long responses run on across
  the update instead of holding the step.

The task has long-tailed response lengths: the brackets task ("balanced:<string>" -> yes / no) from a
briefly fine-tuned policy sampled at a temperature where most answers stop after a few tokens and
some ramble to ``max_new_tokens`` (the printed length percentiles show the tail). Reported: step
throughput over the steps after the first (steps / summed step time) and its ratio, and the
accuracy of the policy's own rollouts per step for both (mean and standard error over steps).

    python bench/async_rl.py                       # a 60-step SFT made here, 12 RL steps each
    python bench/async_rl.py --checkpoint runs/x   # another starting policy
    python bench/async_rl.py --smoke               # seconds per part: 3 steps of 8 samples

Measured on a 2-core machine shared with other jobs (load 3-7), 12 steps of 32 samples, k=1:
temperature 1.0 (lengths p50 4, p90 9, p99 17, max 23 tokens): 0.156 -> 0.218 steps/s, 1.40x,
rollout accuracy 0.019 +- 0.004 vs 0.008 +- 0.004; from a 20-step SFT at temperature 0.6 (p50 6,
p90 17, p99 32): 0.094 -> 0.149 steps/s, 1.58x, accuracy 0.003 +- 0.002 vs 0.004 +- 0.003;
without a tail (60-step SFT, temperature 0.7: p99 7 tokens) 1.01x, accuracy 0.146 +- 0.010 vs
0.126 +- 0.017 — the gain is the long responses no longer holding the step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = REPO / "recipes" / "phases"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_interval=0",
         "checkpoint.save_at_end=false"]


def cli(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=cwd, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench: `megatron-s2 {' '.join(args[:2])} ...` failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def throughput(records: list[dict]) -> float:
    """Steps per second after the first step (start-up and the first generation excluded)."""
    times = [r["step_time_s"] for r in records[1:]]
    return len(times) / sum(times)


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def response_lengths(run: Path) -> list[int]:
    """Generated tokens of every trained sample (disaggregated batch files)."""
    out = []
    for path in sorted((run / "disaggregated" / "batches").glob("step_*.json")):
        for group in json.loads(path.read_text())["groups"]:
            out += [sum(s["policy_mask"]) for s in group["accepted"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="starting policy (default: a 60-step brackets SFT made here)")
    ap.add_argument("--steps", type=int, default=12, help="RL steps of each mode")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--async-level", type=int, default=1, help="max_async_level k of the disaggregated run")
    ap.add_argument("--smoke", action="store_true", help="3 steps of 8 samples, 8 new tokens, a 3-step SFT")
    args = ap.parse_args()
    sft_steps = 60
    if args.smoke:
        args.steps, args.group_size, args.batch_groups, args.max_new_tokens, sft_steps = 3, 4, 2, 8, 3
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.checkpoint is None:
            args.checkpoint = str(tmp / "sft" / "checkpoints")
            cli("train", str(PHASES / "sft_addition.yaml"), f"training.train_steps={sft_steps}",
                "schedule.warmup_steps=1", f"schedule.decay_start_step={2 * sft_steps // 3}",
                f"schedule.decay_end_step={sft_steps}", "data.tasks=[brackets]", "training.seq_length=32",
                "logging.progress_bar=false", "logging.tensorboard=false", "--run-dir", str(tmp / "sft"), cwd=tmp)
        samples = args.group_size * args.batch_groups
        common = [f"training.train_steps={args.steps}", f"training.global_batch_size={samples}",
                  f"training.micro_batch_size={max(samples // 4, 1)}",
                  f"training.seq_length={28 + args.max_new_tokens + 4}", f"rl.rollout.group_size={args.group_size}",
                  f"rl.rollout.batch_groups={args.batch_groups}", f"rl.rollout.max_in_flight={2 * samples}",
                  f"rl.rollout.max_new_tokens={args.max_new_tokens}", f"rl.rollout.temperature={args.temperature}",
                  f"rl.loss.temperature={args.temperature}", "rl.advantage.dynamic_sampling=false",
                  "rl.eval.interval=0", "rl.eval.at_start=false", "rl.rollout.environment.task=brackets",
                  "rl.rollout.environment.num_prompts=2000", f"rl.rollout.engine.max_num_seqs={2 * samples}",
                  f"checkpoint.load={args.checkpoint}", *QUIET]
        k = args.async_level
        runs = {
            "co-located sync (2 trainer ranks)": (tmp / "colocated", [
                "rl.rollout.max_staleness=0", "parallel.dp=2", "launcher.nproc_per_node=2"]),
            f"disaggregated async k={k} (1 server + 1 trainer)": (tmp / "disaggregated", [
                "rl.mode=disaggregated", f"rl.disaggregated.max_async_level={k}", f"rl.rollout.max_staleness={k}",
                "rl.disaggregated.num_servers=1", f"rl.disaggregated.max_num_seqs={2 * samples}"]),
        }
        results = {}
        for name, (run, extra) in runs.items():
            print(f"running {name} ...", flush=True)
            cli("launch", str(PHASES / "rl_addition.yaml"), *common, *extra, "--local", "--run-dir", str(run), cwd=tmp)
            results[name] = metrics(run)
        names = list(results)
        base, ours = (throughput(results[n]) for n in names)
        print(f"\n(a) Step throughput, {args.steps} steps of {samples} samples, max_new_tokens {args.max_new_tokens}, "
              f"temperature {args.temperature} (steps 2..{args.steps})")
        print(f"{'mode':52s} {'steps/s':>9s} {'s/step':>8s}")
        for n, value in zip(names, (base, ours)):
            print(f"{n:52s} {value:9.3f} {1 / value:8.2f}")
        print(f"ratio = disaggregated / co-located: {ours / base:.2f}x")
        lengths = response_lengths(runs[names[1]][0])
        print(f"response lengths (disaggregated batches): p50 {percentile(lengths, 0.5)}, p90 "
              f"{percentile(lengths, 0.9)}, p99 {percentile(lengths, 0.99)}, max {max(lengths)} tokens")
        print("\n(b) Rollout accuracy per step (the policy's own samples)")
        print(f"{'step':>4s} " + " ".join(f"{n[:30]:>30s}" for n in names))
        for i in range(args.steps):
            print(f"{i + 1:4d} " + " ".join(f"{results[n][i].get('rollout_accuracy', math.nan):30.3f}"
                                            for n in names))
        for n in names:
            mean, se = mean_se([r["rollout_accuracy"] for r in results[n] if "rollout_accuracy" in r])
            lag = sum(r.get("async_lag_mean", 0.0) for r in results[n]) / len(results[n])
            print(f"mean accuracy {n}: {mean:.3f} +- {se:.3f} (lag mean {lag:.2f} versions)")


if __name__ == "__main__":
    main()
