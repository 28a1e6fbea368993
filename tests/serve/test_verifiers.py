"""RL clients against ``megatron-s2 serve``, unchanged: ``renderers.client.generate`` (what
verifiers' training client calls) on ``/inference/v1/generate`` with the run's own tokenizer
directory and the ``default`` renderer (the tokenizer's chat template), and a verifiers 0.4.0
environment (``SingleAgentEnv`` over a single-turn taskset with rewards, verifiers' own
interception server and ``TrainClient``) rolled out against the server. The token ids,
log-probs and routed experts the clients keep are checked against the model itself."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from openai import AsyncOpenAI
from renderers import DefaultRendererConfig, OverlongPromptError, create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

import verifiers.v1 as vf
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay
from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, serve=ServeConfig(return_routed_experts=True, disconnect_poll_s=0.05))
    yield srv
    srv.stop()


def forward(model, ids):
    """Log-probs of every next token and the routing a training forward records."""
    record = RoutingReplay(RoutingMode.RECORD)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x, ForwardContext.create(x, model.config.plan, routing=record))[0]
    logprobs = torch.log_softmax(logits.double(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    routing = torch.stack([record.records()[layer][0][0] for layer in model.layer_ids], dim=1).numpy()
    return logprobs, routing


def test_renderers_generate_round_trip(server, loaded, run_dir):
    model, tok, _ = loaded
    renderer = create_renderer(load_tokenizer(str(run_dir / "tokenizer")), DefaultRendererConfig())

    async def call(messages, **sampling):
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await generate(client=client, renderer=renderer, messages=messages, model="tiny",
                                  sampling_params={"temperature": 1.0, **sampling})

    out = asyncio.run(call(CHAT, max_tokens=8, seed=5))
    prompt, completion = out["prompt_ids"], out["completion_ids"]
    assert prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True)  # the renderer uses our template
    assert out["finish_reason"] in ("stop", "length") and 1 <= len(completion) <= 8
    ref, routing = forward(model, prompt + completion)
    assert np.allclose(out["completion_logprobs"], ref[len(prompt) - 1:].numpy(), atol=1e-4)
    routed = out["routed_experts"]
    assert isinstance(routed["data"], memoryview)  # renderers spliced the base64 out of the raw body
    rows = np.frombuffer(base64.b64decode(bytes(routed["data"])), dtype=routed["dtype"])
    assert np.array_equal(rows.reshape(routed["shape"]), routing[:-1])  # every fed token; the last is unfed
    assert isinstance(out["content"], str)
    # max_model_len came from GET /v1/models: an over-long chat is refused before it is sent
    with pytest.raises(OverlongPromptError):
        asyncio.run(call([{"role": "user", "content": "many words " * 200}], max_tokens=4))


def test_a_verifiers_environment_rolls_out_against_the_server(server, loaded, run_dir, monkeypatch):
    model, tok, _ = loaded
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "vf_plugins"))
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "megatron_s2_single_turn"},
                                                    agent={"runtime": {"type": "subprocess"}}))
    client = vf.TrainClientConfig(base_url=f"{server.url}/v1", api_key_var="MEGATRON_S2_UNUSED_KEY",
                                  renderer=DefaultRendererConfig(), renderer_model_name=str(run_dir / "tokenizer"))
    ctx = vf.ModelContext(model="tiny", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=8))

    async def rollouts():
        async with env.serving():
            return [await env.run_episode(task, ctx) for task in env.taskset]

    episodes = asyncio.run(rollouts())
    assert len(episodes) == 3
    for episode in episodes:
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert trace.stop_condition == "agent_completed" and trace.num_turns == 1
        reply, answer = trace.last_reply or "", trace.task.data.answer
        numbers = re.findall(r"-?\d+", reply)
        assert trace.rewards["correct"].score == float(bool(numbers) and int(numbers[-1]) == answer)
        assert trace.rewards["brief"].score == pytest.approx(1 / (1 + len(reply)))
        assert trace.reward == pytest.approx(sum(r.score * r.weight for r in trace.rewards.values()))
        # what a trainer takes from the trace: token ids, the sampled mask, log-probs, routing
        branch = trace.branches[-1]
        ids, mask = branch.token_ids, branch.sampled_mask
        system = [{"role": "system", "content": trace.task.data.system_prompt},
                  {"role": "user", "content": trace.task.data.prompt}]
        prompt = tok.apply_chat_template(system, add_generation_prompt=True)
        assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)]) and any(mask)
        ref, routing = forward(model, ids)
        sampled = [i for i, m in enumerate(mask) if m]
        assert np.allclose([branch.logprobs[i] for i in sampled], ref[[i - 1 for i in sampled]].numpy(), atol=1e-4)
        routed = branch.routed_experts
        assert routed is not None and routed.shape == (len(ids), len(model.layer_ids), model.config.moe_topk)
        assert np.array_equal(routed[:-1], routing[:-1])
