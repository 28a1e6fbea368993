"""End-to-end post-training on CPU through the real CLI (slow): on-policy distillation moves a
student toward its teacher on held-out prompts, the served-teacher commands of
recipes/opd_tiny.yaml's header run as written and give the in-process run's figures, and the RL
phase pipeline (recipes/rl_tiny.yaml: SFT, then RL) runs under `megatron-s2 launch --local`
with held-out accuracy measured before and after the RL phase."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_s2.cli import main

# one intra-op thread here and in the runs it starts (tests/conftest.py): tiny models, 2 shared cores
pytestmark = pytest.mark.usefixtures("one_thread", "one_thread_children")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false"]


def _cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _evals(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_opd_moves_the_student_toward_the_teacher_on_held_out_prompts(tmp_path):
    # The teacher: 6 SFT steps by the CLI in this process (the 4 OPD steps halve the KL to it,
    # 0.023 -> 0.012); the opd phase is the run under test, in its own process.
    teacher = tmp_path / "teacher"
    assert main(["train", str(RECIPES / "phases" / "sft_addition.yaml"), "training.train_steps=6",
                 "schedule.warmup_steps=2", "schedule.decay_start_step=3", "schedule.decay_end_step=6", *QUIET,
                 "--run-dir", str(teacher)]) == 0
    opd = tmp_path / "opd"  # the student starts from the initialisation (a weaker model than the teacher)
    _cli("train", str(RECIPES / "phases" / "opd_addition.yaml"), "training.train_steps=4",
         "training.global_batch_size=16", "training.micro_batch_size=16", "opd.rollout.group_size=4",
         "opd.rollout.batch_groups=4", "opd.rollout.max_in_flight=16", "opd.eval.interval=4",
         "opd.rollout.environment.eval_prompts=16",
         f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}/checkpoints}}]",
         *QUIET, "--run-dir", str(opd), cwd=tmp_path)
    before, after = _evals(opd)[0], _evals(opd)[-1]
    assert (before["step"], after["step"]) == (0, 4)
    assert after["eval_kl_to_teacher"] < before["eval_kl_to_teacher"]
    assert after["eval_student_logprob_teacher"] > before["eval_student_logprob_teacher"]
    metrics = [json.loads(line) for line in (opd / "metrics.jsonl").read_text().splitlines()]
    for key in ("trained_reward_mean", "trained_reward_std", "rollout_reward_mean", "rollout_episodes",
                "response_length", "truncation_rate", "staleness_0", "importance_weight",
                "importance_weight_max", "masked_any", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_time_s",
                "train_time_s", "opd_advantage", "teacher_logprob"):
        assert key in metrics[0], key


def _documented_commands(text: str) -> list[str]:
    """The ``megatron-s2`` command lines of a recipe header (``#   megatron-s2 ...``, with
    ``\\``-continued lines joined)."""
    commands, current = [], None
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if current is not None:
            current += " " + body
        elif line.startswith("#   megatron-s2 "):
            current = body
        if current is not None and not current.endswith("\\"):
            commands.append(current)
            current = None
        elif current is not None:
            current = current[:-1].rstrip()
    return commands


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_served_teacher_commands_of_the_opd_recipe_run_as_documented(tmp_path):
    """recipes/opd_tiny.yaml's header, copied: the pipeline, then `megatron-s2 serve` of its teacher
    and the opd phase again with `opd.teachers=[{... endpoint ...}]` (the README shows the same
    commands). Shortened only as the header says (its `training.train_steps=N`); the port is a
    free one instead of the documented 8001; the served commands start as soon as the teacher and
    student phases they read have finished (the pipeline's opd phase still running). The served
    run's warm-up and evaluation go through the endpoint, and its eval.jsonl holds the in-process
    opd phase's distillation metrics."""
    header = (RECIPES / "opd_tiny.yaml").read_text()
    commands = _documented_commands(header)
    assert [c.split()[1] for c in commands] == ["launch", "serve", "train"], commands
    readme = " ".join((RECIPES.parent / "README.md").read_text().replace("\\\n", " ").split())
    for command in commands[1:]:
        assert " ".join(command.split()) in readme, f"README lacks the header's command: {command}"
    quick = re.search(r"append (\S+=\S+) to\s*#?\s*the launch and train commands", header)
    assert quick, "the header no longer says how to shorten the commands"
    launch, serve, train = (shlex.split(c) for c in commands)
    documented_port = serve[serve.index("--port") + 1]
    port = str(_free_port())
    serve[serve.index("--port") + 1] = port
    assert serve[-1] == "&"  # started in the background
    train = [a.replace(f":{documented_port}/", f":{port}/") for a in train]
    assert any(f"127.0.0.1:{port}/v1" in a for a in train)
    (tmp_path / "recipes").symlink_to(RECIPES)  # the commands' relative paths, run from a scratch directory
    cli = [sys.executable, "-m", "megatron_s2.cli"]
    runs = tmp_path / "runs" / "opd_tiny"
    # The served commands need only the teacher and student phases' checkpoints, so they start
    # once those phases have FINISHED, while the pipeline's opd phase still runs: each run uses one
    # thread (one_thread_children), and on 2 idle cores the two then overlap instead of queueing.
    pipeline_log = open(tmp_path / "launch.log", "w")
    pipeline = subprocess.Popen([*cli, *launch[1:], quick.group(1)], cwd=tmp_path, stdout=pipeline_log,
                                stderr=subprocess.STDOUT)
    server = log = None
    try:
        deadline = time.monotonic() + 1800
        while not all((runs / phase / "FINISHED").is_file() for phase in ("teacher", "student")):
            assert pipeline.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.5)
        log = open(tmp_path / "serve.log", "w")
        server = subprocess.Popen([*cli, *serve[1:-1]], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "listening on" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        _cli(*train[1:], quick.group(1), cwd=tmp_path)
        assert pipeline.wait(timeout=1800) == 0, (tmp_path / "launch.log").read_text()[-8000:]
    finally:
        for proc in (server, pipeline):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
        for f in (log, pipeline_log):
            if f is not None:
                f.close()
    served, in_process = _evals(runs / "opd_served"), _evals(runs / "opd")
    steps = int(quick.group(1).split("=")[1])
    assert [e["step"] for e in served] == [e["step"] for e in in_process] == [0, 5, steps]  # before, warm-up, end
    for a, b in zip(served, in_process):
        for key in ("eval_student_logprob_teacher", "eval_teacher_logprob_teacher", "eval_kl_to_teacher"):
            assert abs(a[key] - b[key]) < 1e-5, (a["step"], key, a[key], b[key])
    metrics = [json.loads(line) for line in (runs / "opd_served" / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("sft_warmup", 0.0) for m in metrics] == [1.0] * 5 + [0.0] * (steps - 5)
    assert all(m["warmup_response_tokens"] > 0 for m in metrics[:5])  # the teacher's answers, from its server
    assert all(m["opd_teacher_http_bytes"] > m["opd_teacher_signal_bytes"] > 0 for m in metrics[5:])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sft_then_rl_pipeline_under_launch_local(tmp_path):
    """recipes/rl_tiny.yaml's two phases, shortened, under `megatron-s2 launch --local`: the rl
    phase starts from the SFT checkpoint, evaluates held-out accuracy before its first update and
    after its last, logs the rollout metrics, and trains every prompt once. (A short SFT leaves
    the policy near zero accuracy, so dynamic sampling is off here; recipes/rl_tiny.yaml keeps it.)"""
    pipeline = tmp_path / "rl_short.yaml"
    pipeline.write_text(f"""run_dir: runs/rl_short
phases:
  - name: sft
    recipe: {RECIPES / 'phases' / 'sft_addition.yaml'}
    overrides: [training.train_steps=4, schedule.warmup_steps=2, schedule.decay_start_step=2,
                schedule.decay_end_step=4, logging.progress_bar=false, logging.tensorboard=false]
  - name: rl
    recipe: {RECIPES / 'phases' / 'rl_addition.yaml'}
    overrides: [training.train_steps=3, training.global_batch_size=16, training.micro_batch_size=8,
                rl.rollout.group_size=4, rl.rollout.batch_groups=4, rl.rollout.max_in_flight=24,
                rl.advantage.dynamic_sampling=false, rl.eval.interval=3, rl.rollout.environment.eval_prompts=16,
                checkpoint.save_interval=0, logging.progress_bar=false, logging.tensorboard=false]
""")
    _cli("launch", str(pipeline), "--local", cwd=tmp_path)
    rl = tmp_path / "runs" / "rl_short" / "rl"
    config = yaml.safe_load((rl / "config.yaml").read_text())
    assert config["checkpoint"]["load"] == str(tmp_path / "runs" / "rl_short" / "sft" / "checkpoints")
    evals = _evals(rl)
    assert [e["step"] for e in evals] == [0, 3] and all(0 <= e["eval_accuracy"] <= 1 for e in evals)
    assert all(e["eval_prompts"] == 16 and e["eval_episodes"] == 64 for e in evals)  # the recipe's avg@4
    assert all(0 <= e["eval_greedy_accuracy"] <= 1 for e in evals)  # and its greedy accuracy beside it
    metrics = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("trained_reward_mean", "trained_reward_std", "trained_accuracy", "rollout_reward_mean",
                "rollout_accuracy", "rollout_episodes", "response_length", "truncation_rate", "staleness_0",
                "staleness_gt", "importance_weight", "importance_weight_max", "masked_any", "rollout_tokens_per_s",
                "train_tokens_per_s", "rollout_time_s", "train_time_s"):
        assert key in metrics[0], key  # (a later step may train groups completed earlier: no rollout_* mean)
    records = [json.loads(line) for line in (rl / "rollouts.jsonl").read_text().splitlines()]
    trained = [uid for r in records for uid in r["trained"]]
    assert len(trained) == len(set(trained)) == 3 * 4
