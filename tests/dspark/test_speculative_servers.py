"""Disaggregated RL with ``rl.rollout.engine.speculative: true``: the inference servers the launcher
starts (``launcher/disaggregated.py::server_command``) speculate with the checkpoint's drafter —
the setting used to be dropped — and serve what the orchestrator asks of them: the policy's greedy
tokens exactly, processed log-probs, weight reloads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.launcher.disaggregated import server_command
from megatron_s2.launcher.local import free_port

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ["model.dspark_layers=2", "model.dspark_block_size=4", "model.dspark_noise_token_id=127",
           "model.dspark_target_layer_ids=[5,6,7]", "model.dspark_markov_rank=8", "model.dspark_num_routed_experts=4",
           "model.dspark_moe_topk=2"]


@pytest.fixture(scope="module")
def drafter_checkpoint(tmp_path_factory) -> Path:
    """Two steps of the DSpark stage: a checkpoint whose model has a drafter."""
    run = tmp_path_factory.mktemp("dspark") / "run"
    assert main(["train", str(ROOT / "recipes" / "phases" / "dspark_sort_copy.yaml"), "training.train_steps=2",
                 "training.seq_length=32", "training.global_batch_size=4", "training.micro_batch_size=2",
                 "data.num_documents=200", "logging.tensorboard=false", "logging.progress_bar=false",
                 "checkpoint.resume=false", "--run-dir", str(run)]) == 0
    return run / "checkpoints"


def _generate(url: str, **params) -> dict:
    body = {"token_ids": [0, 30, 31, 32, 33, 34], "sampling_params": {"max_tokens": 10, "logprobs": 1,
                                                                      "ignore_eos": True, **params}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.slow
def test_a_speculative_rollout_server_serves_the_policy_exactly(drafter_checkpoint, tmp_path):
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.inference.engine import InferenceEngine
    from megatron_s2.inference.sampling import SamplingParams
    from megatron_s2.inference.weights import load_model

    recipe = load_recipe(ROOT / "recipes" / "phases" / "rl_addition.yaml", [
        *DRAFTER, "rl.mode=disaggregated", "rl.rollout.max_staleness=1", "rl.eval.interval=0", "rl.eval.at_start=false",
        "rl.rollout.engine.speculative=true",
        f"checkpoint.load={drafter_checkpoint}"])
    port = free_port()
    argv = server_command(sys.executable, recipe, port)
    assert "--speculative" in argv
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        greedy = _generate(url, temperature=0.0)
        _generate(url, temperature=1.0, seed=3)
        r = httpx.post(f"{url}/update_weights", json={"path": str(drafter_checkpoint), "version": 2}, timeout=120)
        assert r.status_code == 200, r.text
        again = _generate(url, temperature=0.0)
        stats = httpx.get(f"{url}/stats", timeout=10).json()["speculative"]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    model, _, _ = load_model(str(drafter_checkpoint), "cpu")
    plain = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=64)).generate(
        [[0, 30, 31, 32, 33, 34]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert greedy["token_ids"] == again["token_ids"] == plain.token_ids
    assert set(again["policy_versions"]) == {2}
    assert stats["speculative_steps"] > 0, stats  # the server drafted (the schedule's first probes at least)
