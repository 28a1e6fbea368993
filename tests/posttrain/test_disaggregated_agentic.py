"""Agentic environments in disaggregated RL (``posttrain/disaggregated/served_agentic.py``; issue 25,
seed 004): the orchestrator serves the agent gateway (sessions, TITO capture, PrefixTree trace)
over the inference servers — each model call one ``POST /inference/v1/generate`` — while the
builtin harness plays copy_word instances in real sandboxes in the orchestrator. With
``max_async_level: 0`` the run equals the co-located one of the same recipe and seed (the sessions
are seeded from their samples' seeds in both modes): the same sampled tokens, rewards, losses (to
fp32 rounding) and held-out figures, also with a server killed -9 mid-run. A server dying under
an episode costs nothing: its call is re-sent to another with the same seed and the episode goes
on to the same sample.
The tiny model is random (one step from scratch) and earns no reward: an entropy bonus gives the
steps a real loss, so version 1's weights differ from version 0's and step 2 checks the servers'
weight updates too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_s2.config.recipe import load_recipe
from tests.posttrain.cli_run import assert_runs_equal, read_jsonl, run_cli
from tests.serve.conftest import loaded, run_dir  # noqa: F401 - the served checkpoint (smolagents' test)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "phases" / "rl_agentic.yaml")
STEPS = 3
SMALL = ["training.seq_length=576", "training.global_batch_size=2", "training.micro_batch_size=2",
         "rl.rollout.group_size=2", "rl.rollout.batch_groups=1", "rl.rollout.max_in_flight=2",
         "rl.rollout.max_new_tokens=12", "rl.rollout.engine.max_num_seqs=2", "rl.rollout.environment.max_concurrent=2",
         "rl.rollout.environment.tasks=[copy_word]", "rl.rollout.environment.max_turns=2",
         "rl.rollout.environment.num_prompts=8", "rl.rollout.environment.eval_prompts=2",
         "rl.advantage.dynamic_sampling=false", "rl.rollout.max_staleness=0",
         "rl.eval={interval: 2, at_start: true, temperature: 1.0}", "logging.progress_bar=false",
         "logging.tensorboard=false"]
DISAGGREGATED = ["rl.mode=disaggregated", "rl.disaggregated.max_async_level=0", "rl.disaggregated.num_servers=2"]


def _sandbox_or_skip():
    from megatron_s2.config.posttrain.agentic import SandboxConfig
    from megatron_s2.posttrain.agentic.sandbox import SandboxUnavailable, detect_runtime

    try:
        detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


def _init(tmp_path: Path) -> Path:
    """The servers start from a checkpoint: one cheap co-located step writes one."""
    init = tmp_path / "init"
    run_cli("train", RECIPE, *SMALL, "training.train_steps=1", "checkpoint.save_interval=1", "rl.eval.at_start=false",
            "rl.eval.interval=0", "rl.rollout.environment.max_turns=1", "--run-dir", str(init), cwd=tmp_path,
            timeout=1500)
    return init


def test_agentic_environments_load_in_disaggregated_mode_with_routing_replay():
    recipe = load_recipe(RECIPE, [*SMALL, *DISAGGREGATED])
    assert recipe.rl.rollout.uses_agentic and recipe.rl.rollout.engine.routing_replay


def test_a_gateway_call_goes_to_the_servers_as_its_engine_request_and_comes_back_whole():
    """The gateway's engine parameters on the wire, and a server's answer as the engine's one
    finished output (token ids, log-probs, versions, the routed experts of every fed position)."""
    import numpy as np

    from megatron_s2.inference.request import CompletedRequest, FinishReason
    from megatron_s2.inference.sampling import SamplingParams
    from megatron_s2.posttrain.disaggregated.served_agentic import choice_output, wire_sampling
    from megatron_s2.serve.token_api import encode_routed_experts

    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=11, stop_token_ids=(3,), record_routing=True)
    assert wire_sampling(params, record_routing=True) == {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 11, "stop_token_ids": [3],
        "ignore_eos": False, "logprobs": 1, "skip_special_tokens": False, "return_routed_experts": True,
        "routed_experts_prompt_start": 0}
    assert "return_routed_experts" not in wire_sampling(params, record_routing=False)
    # tool_choice none / required: the engine's masks, as the token endpoint's banned / required ids
    wire = wire_sampling(SamplingParams(banned_token_ids=(5, 6), required_token_id=7), record_routing=False)
    assert wire["banned_token_ids"] == [5, 6] and wire["required_token_id"] == 7
    rows = np.arange(5 * 2 * 3).reshape(5, 2, 3) % 8  # prompt 4 + 2 sampled: 5 fed positions
    choice = {"token_ids": [9, 10], "finish_reason": "length", "policy_versions": [4, 5],
              "logprobs": {"content": [{"token": "token_id:9", "logprob": -0.5}, {"token": "token_id:10", "logprob": -1.5}]},
              "routed_experts": encode_routed_experts(rows, 0)}
    result = CompletedRequest("r", [1, 2, 3, 4])
    result.add(choice_output("r", choice))
    assert result.token_ids == [9, 10] and result.logprobs == [-0.5, -1.5] and result.versions == [4, 5]
    assert result.finish_reason is FinishReason.LENGTH and np.array_equal(result.routed_experts.numpy(), rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_synchronous_disaggregated_agentic_run_equals_colocated_while_a_server_is_killed(tmp_path):
    """Server 0 is killed -9 once step 1 is logged: its calls in flight are re-sent to server 1 with
    the same seeds, the launcher restarts it, the orchestrator loads it with the current weights."""
    import signal

    from tests.posttrain.test_disaggregated import _pid_of, _server_port, _wait_for_step

    _sandbox_or_skip()
    init = _init(tmp_path)
    # no reward for a random policy: an entropy bonus makes the loss (and so version 1's weights) real
    common = [*SMALL, f"training.train_steps={STEPS}", "checkpoint.save_interval=0",
              f"checkpoint.load={init / 'checkpoints'}",
              "rl.loss.terms=[{kind: policy_gradient}, {kind: entropy, coef: 0.01}]"]
    run_cli("train", RECIPE, *common, "--run-dir", str(tmp_path / "colocated"), cwd=tmp_path, timeout=1500)
    run = tmp_path / "disaggregated"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "launch", RECIPE, *common, *DISAGGREGATED,
                             "--local", "--run-dir", str(run)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    _wait_for_step(run, 1, proc)
    time.sleep(2.0)  # into step 2's episodes (measured: a call in flight re-routed, rollout_rerouted 1; equal either way)
    os.kill(_pid_of("megatron_s2.cli", "serve", _server_port(run, 0)), signal.SIGKILL)
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out[-4000:]
    assert "inference server 0 exited (-9); restarting it" in out
    log = (run / "logs" / "restart0" / "orchestrator.log").read_text()
    assert "inference server http://127.0.0.1:" in log and "is down" in log, log
    ref = read_jsonl(tmp_path / "colocated" / "metrics.jsonl")
    assert all(abs(m["loss"]) > 1e-3 for m in ref), ref
    assert_runs_equal(tmp_path / "colocated", tmp_path / "disaggregated", STEPS, [0, 2, 3])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_agentic_episode_whose_server_dies_goes_on_on_another_with_the_same_sample(tmp_path):
    """The first server a call is sent to never answers (nothing listens there; or it accepts and
    hangs past request_timeout_s): the call is re-sent to the live one with the same seed and the
    episode's sample equals the one played on the live server alone (nothing lost, nothing twice),
    its sandbox never replayed."""
    import socket

    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.config.posttrain.engines import engine_max_model_len
    from megatron_s2.inference.weights import load_model
    from megatron_s2.posttrain.disaggregated.served_agentic import ServedAgentic
    from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
    from megatron_s2.posttrain.envs import build_environment
    from megatron_s2.serve import ServeConfig, ServerThread, build_state
    from megatron_s2.training.run_checks import check_tokenizer

    _sandbox_or_skip()
    init = _init(tmp_path)
    recipe = load_recipe(RECIPE, [*SMALL, *DISAGGREGATED, f"checkpoint.load={init / 'checkpoints'}"])
    rollout = recipe.rl.rollout
    tokenizer = check_tokenizer(recipe)
    envs = {n: build_environment(n, rollout.environment_of(n), tokenizer) for n in rollout.dataset_names()}
    max_len = engine_max_model_len(recipe, rollout)
    model, tok, description = load_model(str(init), "cpu")
    state = build_state(model, tok, description, ServeConfig(disconnect_poll_s=0.05, logprobs_mode="processed_logprobs"),
                        EngineConfig(max_num_seqs=4, max_model_len=max_len, seed=0), model_name="policy")
    live = ServerThread(state, keep_alive_s=60.0).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    hung_socket = socket.socket()  # accepts connections (the backlog) and never answers
    hung_socket.bind(("127.0.0.1", 0))
    hung_socket.listen(16)
    hung = f"http://127.0.0.1:{hung_socket.getsockname()[1]}"
    logs: list[str] = []
    samples, stats = [], []
    try:
        for urls, timeout_s in (([live.url], 60), ([dead, live.url], 60), ([hung, live.url], 5)):
            backend = ServedRolloutBackend(urls, envs, weights_path=str, record_routing=True, max_model_len=max_len,
                                           max_concurrent=2, request_timeout_s=timeout_s, server_wait_s=30,
                                           ordered=True, log=logs.append,
                                           agentic=ServedAgentic(envs, tokenizer, vocab_size=recipe.model.vocab_size))
            try:
                samples.append(backend.play_agentic("default", 3, "train", sample_id=7, temperature=1.0,
                                                    max_tokens=12, seed=1234, where="test"))
                stats.append(backend.take_stats())
            finally:
                backend.close()
    finally:
        live.stop()
        hung_socket.close()
    alone, *others = samples
    assert [s.rerouted for s in stats] == [0, 1, 1], (stats, logs)
    assert stats[0].calls >= 2 and alone.num_generated > 0, stats  # a multi-call episode (2 turns)
    assert any(dead in line and "is down" in line for line in logs), logs
    assert any(hung in line and "is down" in line for line in logs), logs
    assert alone.routing is not None and (alone.routing.start, alone.routing.end) == (0, len(alone.tokens) - 1)
    for rerouted in others:
        assert rerouted.tokens == alone.tokens and rerouted.reward == alone.reward
        assert rerouted.logprobs == alone.logprobs and rerouted.num_generated == alone.num_generated
        assert rerouted.spans == alone.spans and rerouted.routing == alone.routing


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_smolagents_episode_through_the_servers_becomes_one_row_per_call(loaded, tmp_path):  # noqa: F811
    """Multi-branch episodes in disaggregated mode (:mod:`megatron_s2.posttrain.episode_rows`):
    smolagents re-renders its history, so the orchestrator's gateway leaves one trace branch per
    model call, every call a ``POST /inference/v1/generate`` to an inference server. The sample the
    orchestrator ships (through its state dict, as the exchange does) holds one row per call, each
    row's policy span exactly that call's server output and log-probs in that call's context (the
    re-rendered calls: context), an R3 record covering each row; as the trainer's rows every call
    is trained once. The server's engine is steered to the task's reference solution (the served
    checkpoint of tests/serve, the run's tokenizer); one episode, ~5.4k-token rows."""
    import numpy as np

    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.config.posttrain.engines import engine_max_model_len
    from megatron_s2.config.posttrain.loss import LossConfig
    from megatron_s2.posttrain.agentic.tools import format_call
    from megatron_s2.posttrain.disaggregated.served_agentic import ServedAgentic
    from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
    from megatron_s2.posttrain.envs import build_environment
    from megatron_s2.posttrain.orchestrator import RolloutSample
    from megatron_s2.posttrain.train_batch import build_micro_batches
    from megatron_s2.serve import ServeConfig, ServerThread, build_state
    from tests.serve.test_gateway import ScriptedPolicy, record_calls

    _sandbox_or_skip()
    model, tok, description = loaded
    small = [o for o in SMALL
             if not o.startswith(("training.seq_length", "rl.eval", "rl.rollout.environment.max_turns"))]
    recipe = load_recipe(RECIPE, [*small, *DISAGGREGATED, "training.seq_length=6144", "rl.eval.interval=0",
                                  "rl.eval.at_start=false", "rl.rollout.environment.max_turns=4",
                                  "rl.rollout.environment.agent={harness: smolagents}"])
    rollout = recipe.rl.rollout
    envs = {n: build_environment(n, rollout.environment_of(n), tok) for n in rollout.dataset_names()}
    max_len = engine_max_model_len(recipe, rollout)
    serve = ServeConfig(disconnect_poll_s=0.05, logprobs_mode="processed_logprobs")
    state = build_state(model, tok, description, serve, EngineConfig(max_num_seqs=2, max_model_len=max_len, seed=0),
                        model_name="policy")
    engine = state.backend.engine
    calls = record_calls(engine)
    policy = ScriptedPolicy(engine)
    task = envs["default"].task(3, "train")
    policy.queue[:] = [tok.encode(format_call(c["name"], c["arguments"]) + "<｜end▁of▁sentence｜>")
                       for c in task.reference]
    live = ServerThread(state, keep_alive_s=60.0).start()
    logs: list[str] = []
    agentic = ServedAgentic(envs, tok, vocab_size=recipe.model.vocab_size)
    backend = ServedRolloutBackend([live.url], envs, weights_path=str, record_routing=True, max_model_len=max_len,
                                   max_concurrent=1, request_timeout_s=300, server_wait_s=30, ordered=True,
                                   log=logs.append, agentic=agentic)
    try:
        played = backend.play_agentic("default", 3, "train", sample_id=5, temperature=1.0, max_tokens=160, seed=99,
                                      where="test")
    finally:
        backend.close()
        live.stop()
    sample = RolloutSample.from_state_dict(played.state_dict())  # as the exchange ships it to the trainer
    assert sample.reward == 1.0 and len(calls) == len(task.reference) > 1, logs
    rows = sample.rows
    assert len(rows) == len(calls)  # one row per model call: the sample and its branches
    spans = []
    for row in rows:
        (start, end), = row.spans
        match = [c for c in calls if c["prompt"] == row.tokens[:start] and c["ids"] == row.tokens[start:end]]
        assert match, "a row's span is not a server call's output in its context"
        assert np.allclose(row.logprobs[start:end], match[0]["logprobs"], atol=1e-6)
        assert sum(row.policy_mask) == end - start  # the re-rendered earlier calls are context
        assert row.routing is not None and (row.routing.start, row.routing.end) == (0, len(row.tokens) - 1)
        spans.append(row.tokens[start:end])
    assert sorted(spans) == sorted(c["ids"] for c in calls)  # every call trained once
    mbs = build_micro_batches([sample], [1.0], seq_length=max(len(r.tokens) for r in rows), micro_batch_size=1,
                              dp_rank=0, dp_size=1, pad_id=tok.pad_id, loss_config=LossConfig(aggregation="token_mean"))
    assert len(mbs) == len(rows) and sum(int(mb["loss_mask"].sum()) for mb in mbs) == sum(len(c["ids"]) for c in calls)
