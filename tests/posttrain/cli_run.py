"""Running the ``megatron-s2`` command line from post-training tests, and reading its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path, timeout: float = 900) -> str:
    """``python -m megatron_s2.cli ARGS`` in ``cwd`` (one thread, unbuffered); its stdout. A
    non-zero exit fails the test with the last lines of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (metrics.jsonl, eval.jsonl, ...)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_runs_equal(colocated: Path, disaggregated: Path, steps: int, eval_steps: list[int]) -> None:
    """A synchronous (``max_async_level`` 0) disaggregated run equals the co-located one: same
    rewards, lengths and tokens per step, behaviour log-probs and loss within fp32 rounding (the
    servers' batch composition moves the log-probs' last bits: measured 6e-7 on -6.27), no lag or
    dropped sample, the same samples trained, and ``eval.jsonl`` equal but for its timing."""
    ref, ours = read_jsonl(colocated / "metrics.jsonl"), read_jsonl(disaggregated / "metrics.jsonl")
    assert [m["step"] for m in ours] == list(range(1, steps + 1))
    for a, b in zip(ours, ref):
        for key in ("trained_reward_mean", "response_length", "rollout_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert abs(a["behaviour_logprob"] - b["behaviour_logprob"]) < 1e-5, (a["step"], a, b)
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(b["loss"])), (a["step"], a["loss"], b["loss"])
        assert a["async_lag_max"] == 0 and a["async_dropped_samples"] == 0
    trained = [[r["trained"] for r in read_jsonl(run / "rollouts.jsonl")] for run in (colocated, disaggregated)]
    assert trained[0] == trained[1]
    evals = [read_jsonl(run / "eval.jsonl") for run in (colocated, disaggregated)]
    assert [e["step"] for e in evals[0]] == [e["step"] for e in evals[1]] == eval_steps
    for ref_eval, ours_eval in zip(*evals):
        ref_eval, ours_eval = ({k: v for k, v in e.items() if k != "eval_time_s"} for e in (ref_eval, ours_eval))
        assert ours_eval == ref_eval and ours_eval["eval_policy_version"] == ours_eval["step"], (ours_eval, ref_eval)
