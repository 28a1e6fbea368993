"""Crash-safe post-training: an RL run killed with SIGKILL between checkpoints, inside one, or in
one rank of two, resumes from its
newest checkpoint with the orchestrator's state (prompt cursor, group bookkeeping, in-flight
samples, policy version) and RNG streams, so that no prompt is trained twice or skipped.

The audit trail is the run's ``rollouts.jsonl`` (one line per optimiser step: the prompts it
trained, the prompts dispatched so far, the prompts still open); records written after the last
checkpoint by the killed attempt are dropped on resume, as metrics and evaluations are.

Resume is exact: RL and OPD runs killed during step 1's rollout (no checkpoint yet) or right after
a checkpoint end with the uninterrupted run's weights and optimiser state, bit for bit — each
in-flight sample continues from its saved engine caches with draws keyed by (seed, position).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.posttrain.cli_run import read_jsonl

# one intra-op thread here and in the runs it starts (tests/conftest.py): tiny models, 2 shared cores
pytestmark = pytest.mark.usefixtures("one_thread", "one_thread_children")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "phases" / "rl_addition.yaml"
SMALL = ["training.seq_length=16", "training.global_batch_size=8", "training.micro_batch_size=8",
         "training.train_steps=5", "checkpoint.save_interval=2", "checkpoint.keep_last=3",
         "rl.rollout.group_size=4", "rl.rollout.batch_groups=2", "rl.rollout.max_in_flight=16",
         "rl.rollout.engine.max_num_seqs=16", "rl.advantage.dynamic_sampling=false", "rl.eval.interval=0",
         "rl.rollout.environment.num_prompts=64", "rl.rollout.environment.eval_prompts=4",
         "logging.progress_bar=false", "logging.tensorboard=false"]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "rollouts.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _train(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SMALL,
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_run_killed_mid_run_resumes_without_training_a_prompt_twice_or_skipping_one(tmp_path):
    run_dir = tmp_path / "rl"
    proc = _train(run_dir)
    try:  # SIGKILL once step 3 has trained (after the step-2 checkpoint, before the step-4 one)
        deadline = time.monotonic() + 900
        while not any(r["step"] >= 3 for r in _records(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed = _records(run_dir)
    assert proc.returncode == -signal.SIGKILL and max(r["step"] for r in killed) >= 3

    resumed = _train(run_dir)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert "checkpoint: resumed from" in out and "step_00000002" in out, out
    assert "rollout: orchestrator restored at version 2" in out, out
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # the killed attempt's step 3 was dropped
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5]
    trained = [uid for r in records for uid in r["trained"]]
    assert len(trained) == 5 * 2 and len(set(trained)) == len(trained), "a prompt was trained twice"
    last = records[-1]
    assert not set(last["open"]) & set(trained)
    assert last["filtered"] == 0 and len(trained) + len(last["open"]) == last["dispatched"], \
        "a dispatched prompt was neither trained nor still open (skipped)"
    cursor = sorted(int(uid.split(":")[2]) for uid in trained + last["open"])
    assert len(set(cursor)) == len(cursor)  # one epoch: each prompt index at most once


def _check_every_prompt_trained_once(records: list[dict], steps: int, groups: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    trained = [uid for r in records for uid in r["trained"]]
    assert len(trained) == steps * groups and len(set(trained)) == len(trained), "a prompt was trained twice"
    last = records[-1]
    assert len(trained) + len(last["open"]) == last["dispatched"], "a dispatched prompt was skipped"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_run_killed_mid_save_resumes_from_a_complete_checkpoint(tmp_path):
    """SIGKILL inside the step-4 checkpoint (a shard half written; the other save points are
    covered for every phase by tests/checkpoint): the resumed run loads the complete step-3
    checkpoint, never the partial one, and still trains each prompt once."""
    from megatron_s2.cli import main

    run_dir = tmp_path / "rl"
    assert main(["train", str(RECIPE), *SMALL, "training.train_steps=3", "--run-dir", str(run_dir)]) == 0  # set-up
    env = {**os.environ, "MEGATRON_S2_CKPT_FAULT": "mid_shard"}  # the next save (step 4) kills the process
    killed = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SMALL,
                             "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=900, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert max(r["step"] for r in _records(run_dir)) == 4
    resumed = _train(run_dir)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert "checkpoint: resumed from" in out and "step_00000003" in out, out
    _check_every_prompt_trained_once(_records(run_dir), 5, 2)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_launch_survives_one_rank_of_two_killed(tmp_path):
    """DP2 under `megatron-s2 launch --local`: rank 1 is SIGKILLed inside a checkpoint write; the
    launch fails, the other rank does not hang, and launching again finishes the run with each
    prompt trained once. (3 steps: the kill is in the first save, step 2's, so the launch
    again trains from step 1; steps 4-5 would add nothing to what is checked.)"""
    run_dir = tmp_path / "rl"
    args = [sys.executable, "-m", "megatron_s2.cli", "launch", str(RECIPE), "--local", *SMALL,
            "parallel.dp=2", "launcher.nproc_per_node=2", "training.global_batch_size=8",
            "training.micro_batch_size=4", "training.train_steps=3", "--run-dir", str(run_dir)]
    env = {**os.environ, "MEGATRON_S2_CKPT_FAULT": "mid_shard@1"}
    killed = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert killed.returncode != 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert not list((run_dir / "checkpoints").glob("step_*")), "a checkpoint one rank never finished was committed"
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    _check_every_prompt_trained_once(_records(run_dir), 3, 2)


# ---- exact resume: final weights bit for bit ----------------------------------------------------------
OPD = RECIPE.parent / "opd_addition.yaml"
# A random initial policy earns no reward, so the RL runs add a small entropy bonus: then every
# sampled token and log-probability moves the weights, and any divergence shows in them.
EXACT = {
    "rl": (RECIPE, [*SMALL, "training.train_steps=3", "rl.rollout.engine.max_num_seqs=5",
                    "rl.loss.terms=[{kind: policy_gradient}, {kind: entropy, coef: 0.01}]",
                    "rl.rollout.environment.eval_prompts=2", "rl.eval.samples_per_prompt=1",
                    "rl.eval.also_greedy=false"]),
    "opd": (OPD, ["logging.progress_bar=false", "logging.tensorboard=false", "training.train_steps=3",
                  "training.global_batch_size=4", "training.micro_batch_size=2", "opd.rollout.group_size=1",
                  "opd.rollout.batch_groups=4", "opd.rollout.max_in_flight=8", "opd.rollout.engine.max_num_seqs=3",
                  "opd.rollout.environment.num_prompts=64", "opd.rollout.environment.eval_prompts=2",
                  "opd.eval.interval=0", "checkpoint.save_interval=2", "schedule.lr=3.0e-3", "schedule.min_lr=3.0e-3"]),
}


def _exact_cmd(kind: str, run_dir: Path, teacher: Path) -> list[str]:
    recipe, args = EXACT[kind]
    if kind == "opd":
        args = [*args, f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}}}]"]
    return [sys.executable, "-m", "megatron_s2.cli", "train", str(recipe), *args, "--run-dir", str(run_dir)]


def _checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from megatron_s2.checkpoint.format import MODEL_PREFIX, OPTIM_PREFIX
    from megatron_s2.checkpoint.offline import read_full_tensors

    _, tensors = read_full_tensors(run_dir / "checkpoints" / f"step_{step:08d}", (MODEL_PREFIX, OPTIM_PREFIX))
    return tensors


def _differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(got) == sorted(want)
    return [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind", ["rl", "opd"])
def test_run_killed_during_a_rollout_and_after_a_checkpoint_ends_bit_for_bit_as_the_uninterrupted_one(kind, tmp_path,
                                                                                                    request):
    """One uninterrupted 3-step run, and one SIGKILLed twice — during step 1's rollout (after the
    at-start evaluation, before any checkpoint), then, resumed, right after the step-2 checkpoint —
    and resumed again: every model and optimiser tensor equal to the uninterrupted run's at both
    checkpoints, the same prompts trained, and the step-0 evaluation recorded once."""
    teacher = tmp_path / "teacher"
    if kind == "opd":
        from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
        from megatron_s2.config.recipe import load_recipe
        from megatron_s2.models.v41.model import V41Model

        recipe = load_recipe(OPD)
        write_full_state(V41Model(recipe.model).init_weights(7).state_dict(), recipe, teacher)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels in every process
    ref, run_dir = tmp_path / "ref", tmp_path / "killed"
    # The uninterrupted run goes beside the first killed attempt (one thread each: on 2 idle cores
    # they overlap instead of queueing); it has ended before its checkpoints are read.
    log = open(tmp_path / "ref.log", "w")  # a file, not a pipe nobody reads while it runs
    done = subprocess.Popen(_exact_cmd(kind, ref, teacher), stdout=log, stderr=subprocess.STDOUT, env=env)
    request.addfinalizer(lambda: (done.kill(), done.wait(), log.close()))
    step2 = run_dir / "checkpoints" / "step_00000002" / "COMMITTED"
    moments = {"during step 1's rollout": lambda: "\n" in _text(run_dir / "eval.jsonl"),
               "after the step-2 checkpoint": step2.is_file}
    for moment, reached in moments.items():
        proc = subprocess.Popen(_exact_cmd(kind, run_dir, teacher), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + 900
            while not reached():
                assert proc.poll() is None and time.monotonic() < deadline, f"{moment}: exited {proc.returncode}"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if moment.startswith("during"):
            assert not list((run_dir / "checkpoints").glob("step_*")), "killed too late: step 2 was saved"
        else:  # the attempt resumed from step 0 went exactly as the uninterrupted run
            assert done.wait(timeout=900) == 0, (tmp_path / "ref.log").read_text()[-6000:]
            differ = _differing(_checkpoint(run_dir, 2), _checkpoint(ref, 2))
            assert not differ, f"step 2: {len(differ)} tensors differ, e.g. {differ[:3]}"
    resumed = subprocess.run(_exact_cmd(kind, run_dir, teacher), capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    restored = re.search(r"restored at version 2 .*\((\d+) on this rank from their engine state\)", resumed.stdout)
    assert restored and int(restored[1]) > 0, resumed.stdout[-3000:]  # partly generated samples were in flight
    differ = _differing(_checkpoint(run_dir, 3), _checkpoint(ref, 3))
    assert not differ, f"step 3: {len(differ)} of {len(_checkpoint(ref, 3))} tensors differ, e.g. {differ[:3]}"
    assert [r["trained"] for r in read_jsonl(run_dir / "rollouts.jsonl")] == \
        [r["trained"] for r in read_jsonl(ref / "rollouts.jsonl")]
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0], f"eval.jsonl holds steps {[e['step'] for e in evals]}"
    assert evals[0]["eval_accuracy"] == read_jsonl(ref / "eval.jsonl")[0]["eval_accuracy"]


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""
