"""End-to-end post-training on CPU through the real CLI (slow): on-policy distillation moves a
student toward its teacher on held-out prompts, and the RL phase pipeline
(recipes/rl_tiny.yaml: SFT, then RL) runs under `megatron-s2 launch --local` with held-out
accuracy measured before and after the RL phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    teacher = tmp_path / "teacher"
    _cli("train", str(RECIPES / "phases" / "sft_addition.yaml"), "training.train_steps=12",
         "schedule.warmup_steps=2", "schedule.decay_start_step=6", "schedule.decay_end_step=12", *QUIET, "--run-dir", str(teacher), cwd=tmp_path)
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
    for key in ("reward_mean", "reward_std", "response_length", "truncation_rate", "staleness_0", "importance_weight",
                "importance_weight_max", "masked_any", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_time_s",
                "train_time_s", "opd_advantage", "teacher_logprob"):
        assert key in metrics[0], key


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
    for key in ("reward_mean", "reward_std", "accuracy", "response_length", "truncation_rate", "staleness_0",
                "staleness_gt", "importance_weight", "importance_weight_max", "masked_any", "rollout_tokens_per_s",
                "train_tokens_per_s", "rollout_time_s", "train_time_s"):
        assert key in metrics[-1], key
    records = [json.loads(line) for line in (rl / "rollouts.jsonl").read_text().splitlines()]
    trained = [uid for r in records for uid in r["trained"]]
    assert len(trained) == len(set(trained)) == 3 * 4
