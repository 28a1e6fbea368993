"""OPD's SFT warm-up (walkthrough Ch. 8): teacher trajectories generated in process (or read from a
JSON-lines file) train the student's first steps with cross-entropy on the teacher's response
tokens only; the steps are ordinary checkpointed steps (a resume inside the warm-up continues it
exactly, a resume after it never redoes it); bad settings are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
from megatron_s2.config.recipe import RECIPES_DIR, load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import V41Model
from megatron_s2.posttrain.envs.base import PromptSet
from megatron_s2.posttrain.opd.warmup import SftWarmup, keep_verified, warmup_micro_batches
from megatron_s2.posttrain.opd.warmup_data import Trajectory, TrajectoryFile, WarmupPrompts
from megatron_s2.posttrain.trainer import PosttrainTrainer

from tests.posttrain.cli_run import read_jsonl

# one intra-op thread here and in the runs it starts (tests/conftest.py): tiny models, 2 shared cores
pytestmark = pytest.mark.usefixtures("one_thread", "one_thread_children")

OPD = RECIPES_DIR / "phases" / "opd_addition.yaml"
SMALL = ["logging.progress_bar=false", "logging.tensorboard=false", "training.global_batch_size=4",
         "training.micro_batch_size=2", "opd.rollout.group_size=1", "opd.rollout.batch_groups=4",
         "opd.rollout.max_in_flight=4", "opd.rollout.engine.max_num_seqs=8", "opd.rollout.environment.num_prompts=64",
         "opd.rollout.environment.eval_prompts=8", "opd.eval.interval=0", "checkpoint.save_interval=1",
         "checkpoint.keep_last=4", "schedule.lr=3.0e-3", "schedule.min_lr=3.0e-3"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A committed checkpoint of a tiny model initialised differently from the student."""
    root = tmp_path_factory.mktemp("teacher")
    recipe = load_recipe(OPD)
    write_full_state(V41Model(recipe.model).init_weights(7).state_dict(), recipe, root)
    return root


def _recipe(teacher: Path, *extra: str):
    return load_recipe(OPD, [*SMALL, f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}}}]",
                             *extra])


def _trainer(recipe, run_dir: Path, guard=None) -> PosttrainTrainer:
    return PosttrainTrainer(recipe, run_dir, guard=guard, log=lambda *a, **k: None)


def _hand_ce(model, rows: list[Trajectory]) -> float:
    """Mean float64 cross-entropy of the teacher-generated tokens only, from plain logits."""
    total = count = 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.tokens])
            logits = model(ids[:, :-1], ForwardContext.create(ids[:, :-1], model.plan)).double()
            lp = torch.log_softmax(logits[0], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            for pos, bears in enumerate(row.loss_mask[1:]):
                if bears:
                    total -= float(lp[pos])
                    count += 1
    return total / count


# ---- pure pieces ------------------------------------------------------------------------------------
def test_micro_batches_mask_exactly_the_teacher_tokens():
    rows = [Trajectory([1, 5, 6, 7, 9, 2], [0, 0, 0, 1, 1, 1], "a"),  # prompt 1 5 6, response 7 9 2
            Trajectory([1, 8, 3, 4, 11, 12, 2], [0, 0, 1, 0, 0, 1, 1], "b")]  # multi-turn: 4 11 from the environment
    (mb,) = warmup_micro_batches(rows, seq_length=8, micro_batch_size=2, dp_rank=0, dp_size=1, pad_id=0)
    assert mb["tokens"][0].tolist() == [1, 5, 6, 7, 9, 0, 0, 0] and mb["labels"][0].tolist()[:5] == [5, 6, 7, 9, 2]
    assert mb["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 1, 1, 0, 0]]
    # data-parallel rank 1 of 2 takes the second row
    (mb1,) = warmup_micro_batches(rows, seq_length=8, micro_batch_size=1, dp_rank=1, dp_size=2, pad_id=0)
    assert mb1["tokens"][0].tolist()[:6] == [1, 8, 3, 4, 11, 12]
    with pytest.raises(ValueError, match="do not split"):
        warmup_micro_batches(rows, seq_length=8, micro_batch_size=3, dp_rank=0, dp_size=1, pad_id=0)


def test_verified_only_masks_the_rows_the_environment_rejected():
    rows = [Trajectory([1, 5, 7, 2], [0, 0, 1, 1], "a", True), Trajectory([1, 6, 8, 2], [0, 0, 1, 1], "b", False)]
    kept = keep_verified(rows)
    assert [r.loss_mask for r in kept] == [[0, 0, 1, 1], [0, 0, 0, 0]] and [r.uid for r in kept] == ["a", "b"]
    (mb,) = warmup_micro_batches(kept, seq_length=4, micro_batch_size=2, dp_rank=0, dp_size=1, pad_id=0)
    assert mb["loss_mask"].sum().item() == 2


def test_prompt_schedule_reads_each_prompt_once_per_epoch_and_is_a_function_of_the_step():
    sched = WarmupPrompts({"a": 5, "b": 3}, {"a": 1.0, "b": 1.0}, seed=3, batch=4)
    rows = [r for k in range(4) for r in sched.step_rows(k)]  # 16 rows over 8 prompts
    for name, size in (("a", 5), ("b", 3)):
        seen = [(i, e) for n, i, e in rows if n == name]
        full = [i for i, e in seen if e == 0]
        assert len(seen) >= size and sorted(full) == list(range(size))  # epoch 0 is a permutation
        assert len(set(seen)) == len(seen)  # no (prompt, epoch) twice
    fresh = WarmupPrompts({"a": 5, "b": 3}, {"a": 1.0, "b": 1.0}, seed=3, batch=4)
    assert fresh.step_rows(2) == sched.step_rows(2)  # a resumed run computes step 2 alone, identically


def test_trajectory_file_epochs_and_one_line_errors(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text("".join(json.dumps({"tokens": [1, 5, 6, 2 + k], "loss_mask": [0, 0, 1, 1]}) + "\n" for k in range(3)))
    f = TrajectoryFile(good, vocab_size=128, max_tokens=17, seed=0)
    uids = [r.uid for k in range(3) for r in f.step_rows(k, 2)]
    assert sorted(u for u in uids if u.endswith("@0")) == [f"file:{i}@0" for i in range(3)]
    assert len(set(uids)) == 6
    cases = {"missing.jsonl": "is not a file", "notjson": "not JSON", "nolist": "'tokens' and 'loss_mask'",
             "vocab": "integer ids in", "mask": "one 0/1 per token", "long": "a row holds", "nothing": "no loss-bearing"}
    lines = {"notjson": "{tokens", "nolist": json.dumps({"tokens": 3}),
             "vocab": json.dumps({"tokens": [1, 500], "loss_mask": [0, 1]}),
             "mask": json.dumps({"tokens": [1, 2], "loss_mask": [0, 2]}),
             "long": json.dumps({"tokens": [1] * 20, "loss_mask": [1] * 20}),
             "nothing": json.dumps({"tokens": [1, 2, 3], "loss_mask": [1, 0, 0]})}
    for case, match in cases.items():
        path = tmp_path / case
        if case in lines:
            path.write_text(lines[case] + "\n")
        with pytest.raises(ConfigError, match=match) as err:
            TrajectoryFile(path, vocab_size=128, max_tokens=17, seed=0)
        assert str(err.value).startswith("opd.sft_warmup.data: ") and "\n" not in str(err.value)


def test_trajectory_file_refuses_binary_pickled_and_hostile_lines_in_one_line(tmp_path):
    """A pickle, random bytes, non-UTF-8 text or absurd JSON nesting is a one-line ConfigError
    (never a UnicodeDecodeError/RecursionError traceback, never unpickled); a BOM is accepted."""
    import pickle
    cases = {"pickle": pickle.dumps({"tokens": [1, 2], "loss_mask": [0, 1]}), "latin1": b'{"tokens": [1, 2], "x": "\xe9"}\n',
             "deep": b"[" * 100000 + b"\n"}
    for case, raw in cases.items():
        (tmp_path / case).write_bytes(raw)
        with pytest.raises(ConfigError, match=r"line 1: not") as err:
            TrajectoryFile(tmp_path / case, vocab_size=128, max_tokens=17, seed=0)
        assert str(err.value).startswith("opd.sft_warmup.data: ") and "\n" not in str(err.value)
    (tmp_path / "bom").write_bytes(b'\xef\xbb\xbf{"tokens": [1, 2], "loss_mask": [0, 1]}\n')
    assert TrajectoryFile(tmp_path / "bom", vocab_size=128, max_tokens=17, seed=0).rows == [([1, 2], [0, 1])]

@pytest.mark.parametrize("overrides, match", [
    (["opd.sft_warmup.steps=-1"], r"^opd\.sft_warmup\.steps: must be >= 0"),
    (["opd.sft_warmup.steps=30"], r"^opd\.sft_warmup\.steps: 30 warm-up steps exceed training\.train_steps = 20"),
    (["opd.sft_warmup.temperature=-1"], r"^opd\.sft_warmup\.temperature: must be"),
    (["opd.sft_warmup.verified_only=true", "opd.sft_warmup.data=x.jsonl"], r"^opd\.sft_warmup\.verified_only: "),
])
def test_bad_warmup_settings_are_one_line_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_recipe(OPD, overrides)
    assert "\n" not in str(err.value)


def test_a_missing_trajectory_file_is_refused_when_the_recipe_loads(tmp_path):
    """At load (so `launch` refuses it before starting ranks, one line, exit 2), not first in the trainer."""
    with pytest.raises(ConfigError, match=r"^opd\.sft_warmup\.data: .*none\.jsonl is not a file") as err:
        load_recipe(OPD, ["opd.sft_warmup.steps=1", f"opd.sft_warmup.data={tmp_path / 'none.jsonl'}"])
    assert "\n" not in str(err.value)
    load_recipe(OPD, ["opd.sft_warmup.steps=0", f"opd.sft_warmup.data={tmp_path / 'none.jsonl'}"])  # unused: fine

def test_cli_refuses_a_missing_trajectory_file_with_exit_2_and_one_line(tmp_path, teacher):
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "train", str(OPD), *SMALL, "opd.sft_warmup.steps=1",
                           f"opd.sft_warmup.data={tmp_path / 'none.jsonl'}",
                           f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}}}]",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "opd.sft_warmup.data:" in err[0] and "none.jsonl is not a file" in err[0]


# ---- through the trainer ----------------------------------------------------------------------------
@pytest.mark.slow
def test_warmup_loss_is_the_cross_entropy_of_the_teacher_tokens_only(tmp_path, teacher):
    """The logged loss of a file-fed warm-up step equals a float64 hand CE over the response
    tokens alone, not the one that also counts the prompt's labels."""
    rows = [([1, 5, 6, 7 + k, 9, 2], [0, 0, 0, 1, 1, 1]) for k in range(4)]
    path = tmp_path / "traj.jsonl"
    path.write_text("".join(json.dumps({"tokens": t, "loss_mask": m}) + "\n" for t, m in rows))
    tr = _trainer(_recipe(teacher, "training.train_steps=1", "opd.sft_warmup.steps=1", f"opd.sft_warmup.data={path}"),
                  tmp_path / "run")
    batch = tr.warmup.rows(0)
    assert sorted(r.tokens[3] for r in batch) == [7, 8, 9, 10]  # the file's four rows, once
    expected = _hand_ce(tr.model, batch)
    with_prompt = _hand_ce(tr.model, [Trajectory(r.tokens, [1] * len(r.tokens), r.uid) for r in batch])
    result = tr.train()
    record = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert record["sft_warmup"] == 1.0 and record["tokens"] == 12  # 3 response labels x 4 rows
    assert result.final_loss == pytest.approx(expected, rel=1e-5)
    assert abs(result.final_loss - with_prompt) > 1e-3


@pytest.mark.slow
def test_generated_warmup_raises_the_students_likelihood_of_the_teachers_answers(tmp_path, teacher):
    run = tmp_path / "run"
    tr = _trainer(_recipe(teacher, "training.train_steps=4", "opd.sft_warmup.steps=4"), run)
    first = tr.warmup.rows(0)
    before = _hand_ce(tr.model, first)
    tr.train()
    after = _hand_ce(tr.model, first)
    assert after < before - 0.5, (before, after)  # the trained rows: -log p of the teacher tokens falls
    evals = read_jsonl(run / "eval.jsonl")  # held out: the student's log-prob of the teacher's greedy answers
    assert [e["step"] for e in evals] == [0, 4]
    assert evals[1]["eval_student_logprob_teacher"] > evals[0]["eval_student_logprob_teacher"] + 0.3, evals
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["sft_warmup"] for m in metrics] == [1.0] * 4
    assert all(m["warmup_response_tokens"] > 0 for m in metrics)


class _StopAt:
    """Preemption requested once the trainer reaches ``step`` (what a SLURM warning signal does)."""

    received = None

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def should_stop(self) -> bool:
        return self.trainer is not None and self.trainer.step >= self.step


@pytest.mark.slow
def test_resume_inside_the_warmup_continues_it_and_after_it_never_redoes_it(tmp_path, teacher):
    common = ("training.train_steps=3", "opd.sft_warmup.steps=2", "opd.eval.at_start=false")
    ref = tmp_path / "ref"
    _trainer(_recipe(teacher, *common), ref).train()
    cut = tmp_path / "cut"
    guard = _StopAt(1)
    tr = _trainer(_recipe(teacher, *common), cut, guard=guard)
    guard.trainer = tr
    assert tr.train().preempted and tr.step == 1
    tr = _trainer(_recipe(teacher, *common), cut)  # resumes inside the warm-up, at step 1
    assert tr.train().steps_run == 2
    got, want = read_jsonl(cut / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3]
    assert [m.get("sft_warmup") for m in got] == [1.0, 1.0, None]
    for g, w in zip(got[:2], want[:2]):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6)
    rollouts = read_jsonl(cut / "rollouts.jsonl")
    warm = [u for r in rollouts for u in r.get("warmup", [])]
    assert warm == [u for r in read_jsonl(ref / "rollouts.jsonl") for u in r.get("warmup", [])]
    assert len(warm) == 8 and len(set(warm)) == 8  # no warm-up prompt repeated or skipped
    assert rollouts[-1]["step"] == 3 and len(rollouts[-1]["trained"]) == 4  # then OPD groups
    # extend the finished run: it resumes at step 3 and runs OPD only
    tr = _trainer(_recipe(teacher, "training.train_steps=4", *common[1:]), cut)
    assert tr.train().steps_run == 1
    last = read_jsonl(cut / "metrics.jsonl")[-1]
    assert last["step"] == 4 and "sft_warmup" not in last and "opd_advantage" in last


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_warmup_under_dp2_launch_matches_one_rank(tmp_path, teacher):
    """The warm-up runs through the layout: dp=2 under `launch --local` logs the single-rank losses
    (the single-rank run in this process: the trainer `megatron-s2 train` runs, without a start-up)."""
    args = ["training.train_steps=2", "opd.sft_warmup.steps=2", "opd.eval.at_start=false",
            "training.global_batch_size=8", "opd.rollout.batch_groups=8", "opd.rollout.max_in_flight=8"]
    _trainer(_recipe(teacher, *args), tmp_path / "one").train()
    teachers = f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}}}]"
    proc = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "launch", str(OPD), "--local", *SMALL, teachers,
                           *args, "parallel.dp=2", "launcher.nproc_per_node=2", "--run-dir", str(tmp_path / "dp2")],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {name: [(m["step"], m["sft_warmup"], m["loss"]) for m in read_jsonl(tmp_path / name / "metrics.jsonl")]
              for name in ("one", "dp2")}
    assert [s for s, _, _ in losses["one"]] == [s for s, _, _ in losses["dp2"]] == [1, 2]
    for (s1, w1, l1), (s2, w2, l2) in zip(losses["one"], losses["dp2"]):
        assert (s1, w1) == (s2, w2) and l2 == pytest.approx(l1, rel=1e-5)


def test_each_prompt_is_answered_by_its_domains_teacher_greedily():
    """Two domains, two teachers of different sizes: every warm-up row is its domain teacher's
    greedy continuation of the prompt (checked against full forwards of that teacher), with only
    the generated tokens loss-bearing."""
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.inference import EngineConfig
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.config.posttrain.environment import EnvironmentConfig
    from megatron_s2.posttrain.envs import TaskEnvironment
    from megatron_s2.posttrain.frozen import TeacherPool, full_logits
    from megatron_s2.posttrain.opd.warmup_data import TeacherGenerator
    from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
    from tests.posttrain.tiny import tiny_config
    import dataclasses

    tok = CharTokenizer()
    cfg = tiny_config()
    models = {"a": build_model(cfg, seed=21).eval(), "b": build_model(dataclasses.replace(cfg, hidden_size=96), seed=22).eval()}
    pool = TeacherPool(models, {"x": "a", "y": "b"}, {"a": 1.0, "b": 1.0})
    envs = {n: TaskEnvironment(n, EnvironmentConfig(kind="task", task="addition", num_prompts=6, eval_prompts=2, seed=s), tok)
            for n, s in (("dx", 1), ("dy", 2))}
    gen = TeacherGenerator(pool, {"dx": "x", "dy": "y"}, envs, EngineConfig(max_num_seqs=8, max_model_len=24, page_tokens=8),
                           [tok.eos_id], ReplicaTopology.single(), temperature=0.0, max_new_tokens=5, max_model_len=24,
                           seed=0)
    rows = WarmupPrompts({"dx": 6, "dy": 6}, {}, seed=0, batch=6).step_rows(0)
    assert {n for n, _, _ in rows} == {"dx", "dy"}
    for (name, index, _), traj in zip(rows, gen.generate(0, rows)):
        prompt = envs[name].episode(index, "train").prompt_tokens()
        teacher = models["a" if name == "dx" else "b"]
        ids = list(prompt)
        while len(ids) - len(prompt) < 5 and (len(ids) == len(prompt) or ids[-1] != tok.eos_id):
            ids.append(int(full_logits(teacher, torch.tensor([ids]))[0, -1].argmax()))
        assert traj.tokens == ids, (name, index)
        assert traj.loss_mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_run_killed_inside_the_warmup_resumes_it_without_repeating_or_skipping_a_prompt(tmp_path, teacher):
    """SIGKILL after warm-up step 3 trained (checkpoint at 2): the resumed run re-runs step 3 on
    the same prompts, every warm-up prompt is trained exactly once, and step 4 is OPD's."""
    import os
    import signal
    import time

    run_dir = tmp_path / "opd"
    cmd = [sys.executable, "-m", "megatron_s2.cli", "train", str(OPD), *SMALL, "training.train_steps=4",
           "opd.sft_warmup.steps=3", "checkpoint.save_interval=2", "opd.eval.at_start=false",
           f"opd.teachers=[{{name: teacher, domains: [default], checkpoint: {teacher}}}]", "--run-dir", str(run_dir)]

    def records() -> list[dict]:
        path = run_dir / "rollouts.jsonl"
        out = []
        for line in (path.read_text().splitlines() if path.is_file() else []):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not any(r["step"] >= 3 for r in records()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    killed_step3 = next(r["warmup"] for r in records() if r["step"] == 3)
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step_00000002" in resumed.stdout
    final = records()
    assert [r["step"] for r in final] == [1, 2, 3, 4] and [r["version"] for r in final][:3] == [1, 2, 3]
    warm = [u for r in final for u in r.get("warmup", [])]
    assert len(warm) == 3 * 4 and len(set(warm)) == len(warm)
    assert final[2]["warmup"] == killed_step3  # the re-run step trains the same prompts
    assert [m.get("sft_warmup") for m in read_jsonl(run_dir / "metrics.jsonl")] == [1.0, 1.0, 1.0, None]


class _HarnessPrompts(PromptSet):
    """A prompt set whose episodes only a harness back end plays (as verifiers / agentic)."""

    name = "harness"

    def size(self, split):
        return 3

    def prompt_tokens(self, index, effort=None):
        return [1, 2, 3]

    def longest_prompt_from(self, limit, split="train", efforts=(None,)):
        return 0


def test_warmup_without_a_file_refuses_a_prompt_set_with_no_token_level_episodes():
    trainer = SimpleNamespace(
        section=SimpleNamespace(sft_warmup=SimpleNamespace(steps=2, data="", verified_only=False)),
        recipe=SimpleNamespace(training=SimpleNamespace(global_batch_size=4, seq_length=32, seed=0)),
        rollout_cfg=SimpleNamespace(dataset_names=lambda: ["tools"]),
        environments={"tools": _HarnessPrompts()})
    with pytest.raises(ConfigError, match=r"opd.sft_warmup.data: the environment of dataset 'tools' plays no"):
        SftWarmup(trainer)
