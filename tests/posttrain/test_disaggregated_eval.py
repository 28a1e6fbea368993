"""Held-out evaluation of disaggregated RL through the inference servers
(``megatron_s2/posttrain/disaggregated/served_eval.py``; issue 25, seed 004).

The co-located evaluator (a second engine over the weights) and the served one (the same episode
loop over two real servers, in process, on copies of the same checkpoint) give the same
``eval_*`` figures: greedy, and sampled with k episodes per prompt (each call's seed travels with
it, whichever server answers). The served evaluation first loads the evaluated version into the
servers (``POST /update_weights``), checks every token's policy version, and goes on when a server
is down (its calls re-routed).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.posttrain.environment import EnvironmentConfig, EvaluationConfig
from megatron_s2.inference import InferenceEngine
from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
from megatron_s2.posttrain.disaggregated.served_eval import ServedEvalEngine, ServedEvaluator
from megatron_s2.posttrain.envs import TaskEnvironment
from megatron_s2.posttrain.rollout.evaluation import Evaluator
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
from megatron_s2.serve import ServeConfig, ServerThread, build_state

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN, NEW_TOKENS = 64, 8
ENGINE = dict(max_num_seqs=8, max_model_len=MAX_LEN, seed=0)


@pytest.fixture(scope="module")
def run_dir(tiny_pretrained_run) -> Path:
    return tiny_pretrained_run  # tests/posttrain/conftest.py


def _load(run_dir: Path):
    from megatron_s2.inference.weights import load_model

    return load_model(str(run_dir), "cpu")


@pytest.fixture(scope="module")
def servers(run_dir):
    threads = []
    for _ in range(2):
        model, tokenizer, description = _load(run_dir)
        state = build_state(model, tokenizer, description, ServeConfig(disconnect_poll_s=0.05), EngineConfig(**ENGINE),
                            model_name="policy")
        threads.append(ServerThread(state).start())
    yield threads
    for t in threads:
        t.stop()


def _envs(tokenizer) -> dict:
    cfg = EnvironmentConfig(kind="task", task="addition", num_prompts=8, eval_prompts=6)
    return {"add": TaskEnvironment("add", cfg, tokenizer)}


def _colocated(run_dir: Path, config: EvaluationConfig, version: int) -> dict:
    model, tokenizer, _ = _load(run_dir)
    engine = InferenceEngine(model.eval(), EngineConfig(**ENGINE, max_waiting=1000), eos_token_ids=[tokenizer.eos_id])
    engine.set_policy_version(version)
    return Evaluator(engine, _envs(tokenizer), ReplicaTopology.single(), config, NEW_TOKENS, MAX_LEN).run(version)


def _served(run_dir: Path, urls: list[str], config: EvaluationConfig, version: int, logs: list[str]) -> dict:
    tokenizer = _load(run_dir)[1]
    # every published version is this checkpoint's weights: the figures must not move, the version must
    backend = ServedRolloutBackend(urls, {}, weights_path=lambda v: str(run_dir), record_routing=False,
                                   max_model_len=MAX_LEN, max_concurrent=8, request_timeout_s=60, server_wait_s=30,
                                   ordered=True, log=logs.append)
    engine = ServedEvalEngine(backend, 8)
    try:
        return ServedEvaluator(engine, _envs(tokenizer), ReplicaTopology.single(), config, NEW_TOKENS, MAX_LEN,
                               rank=0).run(version)
    finally:
        engine.close()
        backend.close()


@pytest.mark.parametrize("config", [EvaluationConfig(),  # greedy, the default
                                    EvaluationConfig(temperature=1.0, samples_per_prompt=3, also_greedy=True)],
                         ids=["greedy", "sampled_avg@3"])
def test_served_evaluation_equals_the_colocated_one_on_the_same_weights(run_dir, servers, config):
    urls = [s.url for s in servers]
    version = 2 if config.temperature else 1  # versions only grow on a server
    ours = _served(run_dir, urls, config, version, [])
    ref = _colocated(run_dir, config, version)
    assert ref["eval_episodes"] == 6 * config.samples_per_prompt and ref["eval_response_length"] > 0
    assert ours == ref  # every figure, bit for bit (measured: equal, greedy and sampled)
    assert ours["eval_policy_version"] == version
    for url in urls:  # the servers were asked to load the evaluated version first
        assert httpx.get(f"{url}/stats").json()["policy_version"] == version


def test_a_server_down_during_evaluation_has_its_calls_rerouted(run_dir, servers):
    """Evaluate with a third URL where nothing listens (a dead server): its calls go to the live
    two, the figures are the same."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    config, logs = EvaluationConfig(), []
    version = httpx.get(f"{servers[0].url}/stats").json()["policy_version"]
    ours = _served(run_dir, [dead, *(s.url for s in servers)], config, version, logs)
    assert ours == _colocated(run_dir, config, version)
    assert any(dead in line and "is down" in line for line in logs), logs


def test_tokens_of_another_version_are_an_error(run_dir, servers):
    """A server moved past the evaluated version by someone else: the figures would mix policies."""
    newer = httpx.get(f"{servers[0].url}/stats").json()["policy_version"] + 5
    for s in servers:
        r = httpx.post(f"{s.url}/update_weights", json={"path": str(run_dir), "version": newer}, timeout=120)
        assert r.status_code == 200, r.text
    with pytest.raises(RuntimeError, match=f"did not load version {newer - 1}|policy versions \\[{newer}\\]"):
        _served(run_dir, [s.url for s in servers], EvaluationConfig(num_prompts=2), newer - 1, [])
