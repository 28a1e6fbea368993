"""A sampled-token OPD teacher over HTTP (walkthrough Ch. 8, Eq. 33) against a real
``megatron-s2 serve`` app in-thread: its per-token log-probs have the in-process teacher's layout
and values, so the OPD advantages and loss of a micro-batch are the same with the teacher
remote, in process, or a mix per domain; an unreachable endpoint stops the trainer at start-up
with exit 2 and one line naming ``opd.teachers.<name>.endpoint``."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.v41.model import build_model
from megatron_s2.config.posttrain import LossConfig, LossTermConfig
from megatron_s2.posttrain.frozen import TeacherPool, load_frozen_model
from megatron_s2.posttrain.losses import PosttrainObjective, aggregation_weights
from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacher
from megatron_s2.posttrain.train_batch import PosttrainLoss
from tests.serve.conftest import start_server

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# (prompt, response) token ids; the micro-batch is right-padded past the longest row
ROWS = [([0, 30, 31, 32], [33, 34, 35, 36, 40, 41]), ([0, 50], [7, 7, 9]), ([0, 90, 91, 92], []),
        ([0, 11, 12], [13, 14])]
DOMAINS = ["math", "swe", "math", "swe"]


@pytest.fixture(scope="module")
def teacher(run_dir, loaded):
    model, tokenizer, _ = loaded
    return load_frozen_model(run_dir, model.groups, vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                             what="teacher", device="cpu")


def micro_batch(seq_length: int = 12) -> dict:
    """The trainer's micro-batch layout (posttrain/batch.py): tokens = ids[:-1], labels = ids[1:],
    loss on the response labels, padding after."""
    b = len(ROWS)
    mb = {"tokens": torch.zeros(b, seq_length, dtype=torch.long), "labels": torch.zeros(b, seq_length, dtype=torch.long),
          "loss_mask": torch.zeros(b, seq_length), "behaviour_logprobs": torch.zeros(b, seq_length),
          "versions": torch.full((b, seq_length), -1), "advantages": torch.zeros(b, seq_length)}
    for i, (prompt, response) in enumerate(ROWS):
        ids = torch.tensor(prompt + response)
        n = ids.numel() - 1
        mb["tokens"][i, :n], mb["labels"][i, :n] = ids[:-1], ids[1:]
        mb["loss_mask"][i, len(prompt) - 1:n] = 1.0
        mb["versions"][i, len(prompt) - 1:n] = 0
        mb["behaviour_logprobs"][i, len(prompt) - 1:n] = -2.0
    mb["weights"] = aggregation_weights(mb["loss_mask"].bool(), "token_mean", global_tokens=float(mb["loss_mask"].sum()))
    return mb


def opd_step(student, pool: TeacherPool, groups) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Teacher log-probs as the trainer adds them, then the sampled-token OPD loss (Eq. 33-36)."""
    mb = micro_batch()
    mb["teacher_logprobs"] = pool.token_logprobs(mb["tokens"], mb["labels"], DOMAINS, groups.tp,
                                                 loss_mask=mb["loss_mask"])
    objective = PosttrainObjective(LossConfig(terms=(LossTermConfig("policy_gradient"),), masks=()))
    loss_fn = PosttrainLoss(objective, groups, current_version=0, global_tokens=float(mb["loss_mask"].sum()),
                            mode="opd_sampled")
    logits = student(mb["tokens"])
    loss, _ = loss_fn(student, logits, mb, None)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
    student.zero_grad()
    return mb["teacher_logprobs"], {"loss": float(loss.detach()), **loss_fn.reduce()}, grad


def test_remote_teacher_gives_the_in_process_teacher_s_opd_step(server, teacher, loaded):
    model, _, _ = loaded
    groups = model.groups
    remote = RemoteTeacher("t", f"{server.url}/v1", max_concurrent_requests=2, rows_per_request=2
                           ).connect(model.config.vocab_size)
    try:
        assert remote.model == "tiny"
        student = build_model(model.config, seed=5)
        local = TeacherPool({"t": teacher}, {"math": "t", "swe": "t"}, {"t": 1.0})
        far = TeacherPool({}, {"math": "r", "swe": "r"}, {"r": 1.0}, {"r": remote})
        mixed = TeacherPool({"t": teacher}, {"math": "t", "swe": "r"}, {"t": 1.0, "r": 1.0}, {"r": remote})
        before = remote.requests
        lp_local, out_local, g_local = opd_step(student, local, groups)
        lp_far, out_far, g_far = opd_step(student, far, groups)
        assert remote.requests - before == 2  # 3 rows with loss tokens (row 2 has none), 2 per request
        lp_mixed, out_mixed, g_mixed = opd_step(student, mixed, groups)
    finally:
        remote.close()
    mask = micro_batch()["loss_mask"].bool()
    assert mask.sum() == 11
    for lp in (lp_far, lp_mixed):
        assert lp.dtype == torch.float32 and lp.shape == lp_local.shape
        assert torch.allclose(lp[mask], lp_local[mask], atol=1e-5, rtol=0), (lp - lp_local)[mask].abs().max()
    assert (lp_far[~mask & (torch.arange(12) >= 9)] == 0).all()  # nothing after a row's last loss label
    for out in (out_far, out_mixed):
        for key in ("loss", "opd_advantage", "teacher_logprob", "loss_policy_gradient"):
            assert abs(out[key] - out_local[key]) < 1e-5, (key, out[key], out_local[key])
        assert out_local["opd_advantage"] != 0.0
    assert torch.allclose(g_far, g_local, atol=1e-6) and torch.allclose(g_mixed, g_local, atol=1e-6)



def test_remote_teacher_temperature_is_applied_by_the_server(server, teacher, loaded):
    groups = loaded[0].groups
    mb = micro_batch()
    mask = mb["loss_mask"].bool()
    local = TeacherPool({"t": teacher}, {"math": "t", "swe": "t"}, {"t": 0.5})
    remote = RemoteTeacher("t", f"{server.url}/v1", temperature=0.5).connect()
    try:
        far = TeacherPool({}, {"math": "r", "swe": "r"}, {"r": 0.5}, {"r": remote})
        hot = far.token_logprobs(mb["tokens"], mb["labels"], DOMAINS, groups.tp, loss_mask=mb["loss_mask"])
    finally:
        remote.close()
    ref = local.token_logprobs(mb["tokens"], mb["labels"], DOMAINS, groups.tp)
    assert torch.allclose(hot[mask], ref[mask], atol=1e-5, rtol=0)
    plain = TeacherPool({"t": teacher}, {"math": "t", "swe": "t"}, {"t": 1.0})
    assert not torch.allclose(hot[mask], plain.token_logprobs(mb["tokens"], mb["labels"], DOMAINS, groups.tp)[mask],
                              atol=1e-3)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_checked_once_at_start_up(server, loaded):
    vocab = loaded[0].config.vocab_size
    with pytest.raises(ConfigError, match=rf"^opd\.teachers\.small\.endpoint: .* refuses the student's token id {vocab}"
                                          r" .*; a teacher must share the student's tokenizer"):
        RemoteTeacher("small", f"{server.url}/v1").connect(vocab_size=vocab + 1)
    port = _closed_port()
    with pytest.raises(ConfigError, match=rf"^opd\.teachers\.far\.endpoint: cannot reach http://127\.0\.0\.1:{port}/v1/"
                                          r"models \(ConnectError"):
        RemoteTeacher("far", f"http://127.0.0.1:{port}/v1", timeout_s=5).connect()
    with pytest.raises(ConfigError, match=r"^opd\.teachers\.root\.endpoint: .* answered HTTP 404 without a model list"):
        RemoteTeacher("root", server.url).connect()  # the server root, not its /v1
    # the evaluation's KL needs the full distribution: a server capped at 20 log-probs is refused
    with pytest.raises(ConfigError, match=rf"^opd\.teachers\.t\.endpoint: {server.url}/v1 does not return the "
                                          rf"teacher's full distribution \(POST .*prompt_logprobs: must be <= 20 .*got "
                                          rf"{vocab}\)\), which the held-out evaluation's eval_kl_to_teacher needs; "
                                          r"serve the teacher with --max-logprobs -1 .* or turn the evaluation off "
                                          r"\(opd\.eval\.interval=0 opd\.eval\.at_start=false\)$"):
        RemoteTeacher("t", f"{server.url}/v1").connect(vocab_size=vocab, full_distribution=True)
    RemoteTeacher("t", f"{server.url}/v1").connect(vocab_size=vocab).close()  # enough for training


@pytest.mark.slow
def test_unreachable_teacher_endpoint_exits_2_with_one_line(tmp_path):
    port = _closed_port()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPES / "phases" / "opd_addition.yaml"),
         f"opd.teachers=[{{name: far, domains: [default], endpoint: 'http://127.0.0.1:{port}/v1'}}]",
         "logging.progress_bar=false", "logging.tensorboard=false", "--run-dir", str(tmp_path / "opd")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"opd.teachers.far.endpoint: cannot reach http://127.0.0.1:{port}/v1/models" in lines[0]


@pytest.mark.slow
def test_opd_run_is_the_same_with_the_teacher_served(tmp_path):
    """Through the trainer (`megatron-s2 train` of recipes/phases/opd_addition.yaml): the same
    teacher checkpoint in process, then behind `megatron-s2 serve`'s app with --max-logprobs -1 —
    one SFT warm-up step on the teacher's generated answers (through the endpoint: the same
    trajectories, so the same loss), one OPD step (same rollouts, teacher log-probs, loss, OPD
    advantage and gradient norm), and the held-out evaluation before, after the warm-up and at
    the end reports the same distillation metrics (the student's and the teacher's log-likelihood
    of the teacher's greedy answers, the full-vocabulary KL) to 1e-5 (~40 s)."""
    import json

    from megatron_s2.cli import main
    from megatron_s2.inference.weights import load_model
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.serve import ServeConfig, ServerThread, build_state

    quiet = ["logging.progress_bar=false", "logging.tensorboard=false"]
    teacher = tmp_path / "teacher"
    assert main(["train", str(RECIPES / "phases" / "sft_addition.yaml"), "training.train_steps=2",
                 "schedule.warmup_steps=1", "schedule.decay_start_step=1", "schedule.decay_end_step=2",
                 "checkpoint.save_interval=2", *quiet, "--run-dir", str(teacher)]) == 0
    model, tokenizer, description = load_model(str(teacher), "cpu")
    state = build_state(model, tokenizer, description, ServeConfig(max_logprobs=-1),
                        EngineConfig(max_num_seqs=8, max_model_len=128), model_name="teacher")
    opd = ["training.train_steps=2", "opd.sft_warmup.steps=1", "training.global_batch_size=4",
           "training.micro_batch_size=4", "opd.rollout.group_size=2", "opd.rollout.batch_groups=2",
           "opd.rollout.max_in_flight=4", "opd.rollout.environment.eval_prompts=8", "checkpoint.save_interval=0",
           *quiet]
    metrics, evals = {}, {}
    with ServerThread(state) as server:
        for kind, where in (("local", f"checkpoint: {teacher}/checkpoints"), ("remote", f"endpoint: '{server.url}/v1'")):
            assert main(["train", str(RECIPES / "phases" / "opd_addition.yaml"), *opd,
                         f"opd.teachers=[{{name: teacher, domains: [default], {where}}}]",
                         "--run-dir", str(tmp_path / kind)]) == 0
            metrics[kind] = [json.loads(line) for line in (tmp_path / kind / "metrics.jsonl").read_text().splitlines()]
            evals[kind] = [json.loads(line) for line in (tmp_path / kind / "eval.jsonl").read_text().splitlines()]
    (warm_l, opd_l), (warm_r, opd_r) = metrics["local"], metrics["remote"]
    assert warm_l["sft_warmup"] == warm_r["sft_warmup"] == 1.0
    assert warm_l["loss"] == warm_r["loss"] and warm_l["warmup_response_tokens"] == warm_r["warmup_response_tokens"]
    assert opd_l["policy_logprob"] == opd_r["policy_logprob"]  # the same rollouts of the same warmed-up student
    assert opd_l["opd_advantage"] != 0.0
    for key in ("teacher_logprob", "opd_advantage", "loss", "grad_norm"):
        assert abs(opd_l[key] - opd_r[key]) < 1e-5, (key, opd_l[key], opd_r[key])
    # worked example 24's payload: one float32 value per loss token either way; JSON over HTTP when served
    assert opd_l["opd_teacher_signal_bytes"] == opd_r["opd_teacher_signal_bytes"] == 4 * opd_l["tokens"] > 0
    assert "opd_teacher_http_bytes" not in opd_l and opd_r["opd_teacher_http_bytes"] > opd_r["opd_teacher_signal_bytes"]
    assert [e["step"] for e in evals["local"]] == [e["step"] for e in evals["remote"]] == [0, 1, 2]
    for local, remote in zip(evals["local"], evals["remote"]):
        assert local["eval_accuracy"] == remote["eval_accuracy"]
        for key in ("eval_student_logprob_teacher", "eval_teacher_logprob_teacher", "eval_kl_to_teacher"):
            assert abs(local[key] - remote[key]) < 1e-5, (local["step"], key, local[key], remote[key])
        assert local["eval_kl_to_teacher"] > 0 and local["eval_teacher_logprob_teacher"] < 0
    assert evals["local"][1]["eval_student_logprob_teacher"] != evals["local"][0]["eval_student_logprob_teacher"]


def test_a_teacher_that_fails_mid_run_halts_with_one_line(loaded, server):
    from megatron_s2.runtime.finite import TrainingHalted

    tokens, labels = torch.zeros(1, 300, dtype=torch.long), torch.ones(1, 300, dtype=torch.long)
    remote = RemoteTeacher("t", f"{server.url}/v1").connect()
    before = remote.requests
    with pytest.raises(TrainingHalted, match=r"^opd\.teachers\.t\.endpoint: POST .*/v1/completions failed \(HTTP 400: "
                                             r"prompt: This model's maximum context length is 256 tokens"):
        remote.token_logprobs(tokens, labels)  # a refusal is not retried
    assert remote.requests - before == 1
    remote.close()
    gone = start_server(loaded)
    remote = RemoteTeacher("t", f"{gone.url}/v1", retries=1).connect()
    gone.stop()
    with pytest.raises(TrainingHalted, match=r"^opd\.teachers\.t\.endpoint: POST .* failed \(ConnectError"):
        remote.token_logprobs(tokens[:, :5], labels[:, :5])
    remote.close()
