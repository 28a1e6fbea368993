"""The embedded verifiable tasks packaged as a verifiers 0.4.0 environment
(megatron_s2/posttrain/envs/vf_tasks.py, plugin id ``megatron_s2_tasks``) rolled out against
``megatron-s2 serve`` exactly as any verifiers environment reaches a model: SingleAgentEnv ->
interception server -> TrainClient -> renderers -> ``/inference/v1/generate``. The rubric's
``correct`` reward is the task's exact verifier of the reply; the held-out split excludes every
training prompt of the trainer's environment."""

from __future__ import annotations

import asyncio

import pytest
from renderers import DefaultRendererConfig

import verifiers.v1 as vf
from megatron_s2.config.data import TaskDifficulty
from megatron_s2.data.tasks import build_task
from megatron_s2.posttrain.envs.tasks import task_prompts
from megatron_s2.posttrain.envs.vf_tasks import plugin_dir
from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server


@pytest.fixture(scope="module")
def server(loaded):
    srv = start_server(loaded, serve=ServeConfig(return_routed_experts=True, disconnect_poll_s=0.05))
    yield srv
    srv.stop()


def test_embedded_task_environment_rolls_out_against_the_server(server, loaded, run_dir, monkeypatch):
    model, tok, _ = loaded
    monkeypatch.syspath_prepend(str(plugin_dir()))
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset={"id": "megatron_s2_tasks", "task_name": "addition", "max_digits": 2, "count": 3,
                 "num_prompts": 200}, agent={"runtime": {"type": "subprocess"}}))
    tasks = list(env.taskset)
    task = build_task("addition", TaskDifficulty(addition_max_digits=2))
    train = task_prompts(task, 200, 0)  # the trainer's training prompts (environment seed 0)
    assert len(tasks) == 3 and not {t.data.prompt for t in tasks} & {s.prompt for s in train}  # held out
    client = vf.TrainClientConfig(base_url=f"{server.url}/v1", api_key_var="MEGATRON_S2_UNUSED_KEY",
                                  renderer=DefaultRendererConfig(), renderer_model_name=str(run_dir / "tokenizer"))
    ctx = vf.ModelContext(model="tiny", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=6))

    async def rollouts():
        async with env.serving():
            return [await env.run_episode(t, ctx) for t in env.taskset]

    for episode in asyncio.run(rollouts()):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert trace.stop_condition == "agent_completed" and trace.num_turns == 1
        reply = (trace.last_reply or "").strip()
        expected = float(bool(reply) and task.verify(trace.task.data.prompt, reply))
        assert trace.rewards["correct"].score == expected
        assert trace.rewards["answered"].score == float(bool(reply))
        assert trace.reward == pytest.approx(expected)  # 'answered' has weight 0
        branch = trace.branches[-1]  # token-in/token-out: what a trainer consumes
        assert any(branch.sampled_mask) and len(branch.token_ids) == len(branch.sampled_mask)
        assert branch.routed_experts is not None


def test_retry_environment_session_is_one_sample_with_the_feedback_masked(server, loaded, run_dir, monkeypatch):
    """The second-try taskset (plugin id megatron_s2_retry) with the bridging renderer: the tiny
    model's (wrong) first reply gets the feedback and a second call whose prompt extends the first
    call's ids verbatim, so the session is one branch — one training sample whose two replies are
    policy tokens and whose feedback turn between them is environment tokens, loss-masked."""
    from renderers import CustomRendererConfig

    from megatron_s2.posttrain.envs.vf_renderer import IMPORT_PATH
    from megatron_s2.posttrain.envs.vf_retry import FEEDBACK
    from megatron_s2.posttrain.rollout.vf_trace import trace_sample

    _, tok, _ = loaded
    monkeypatch.syspath_prepend(str(plugin_dir()))
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset={"id": "megatron_s2_retry", "task_name": "addition", "max_digits": 2, "count": 3, "num_prompts": 200},
        agent={"runtime": {"type": "subprocess"}}))
    client = vf.TrainClientConfig(base_url=f"{server.url}/v1", api_key_var="MEGATRON_S2_UNUSED_KEY",
                                  renderer=CustomRendererConfig(import_path=IMPORT_PATH),
                                  renderer_model_name=str(run_dir / "tokenizer"))
    ctx = vf.ModelContext(model="tiny", client=client, sampling=vf.SamplingConfig(temperature=0.0, max_tokens=6))

    async def rollouts():
        async with env.serving():
            return [await env.run_episode(t, ctx) for t in env.taskset]

    two_turn = 0
    for episode in asyncio.run(rollouts()):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        sample = trace_sample(trace, 0, version=0, layer_ids=None)
        first_right = trace.metrics["first_try_correct"] == 1.0
        assert trace.num_turns == (1 if first_right else 2) and len(trace.branches) == 1
        assert len(sample.spans) == trace.num_turns and not any(sample.policy_mask[:sample.spans[0][0]])
        if trace.num_turns == 2:
            two_turn += 1
            (a, b), (c, d) = sample.spans
            assert b < c and not any(sample.policy_mask[b:c])  # the environment's turn: no loss
            assert FEEDBACK in tok.decode(sample.tokens[b:c])
            assert sample.reward == trace.rewards["solved"].score in (0.0, 0.5)
    assert two_turn  # a freshly trained tiny model answers 2-digit sums wrong
