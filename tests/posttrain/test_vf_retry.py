"""The second-try verifiers environment (megatron_s2/posttrain/envs/vf_retry.py, plugin id
``megatron_s2_retry``) run by verifiers 0.4.0 itself (SingleAgentEnv -> interception server ->
the harness's chat calls): a session ends after a right reply, a wrong one gets the feedback and
one more try; the rubric pays 1 / the try that first verifies; ``correct`` is the final reply,
``first_try_correct`` the first. The model is a script served over HTTP (an OpenAI-compatible
``/chat/completions`` that answers each task's replies in turn) so that right and wrong first replies
are chosen, not hoped for; the token-level session (one sample, the feedback masked) is checked
against the real server in tests/serve/test_vf_embedded_tasks.py and by the RL test below it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

import verifiers.v1 as vf
from megatron_s2.config.recipe import load_recipe
from megatron_s2.posttrain.envs.vf_retry import FEEDBACK
from megatron_s2.posttrain.envs.vf_tasks import plugin_dir
from megatron_s2.serve.server import bind_socket

ROOT = Path(__file__).resolve().parents[2]
TASKSET = {"id": "megatron_s2_retry", "task_name": "addition", "max_digits": 2, "num_prompts": 500}


class ScriptedModel:
    """An OpenAI-compatible chat endpoint whose reply to a conversation is ``script[question][k]``,
    ``k`` = the assistant turns already in it; every request's messages are kept."""

    def __init__(self, script: dict[str, list[str]]):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.script, self.requests = script, []

        async def chat(request):
            body = await request.json()
            messages = body["messages"]
            self.requests.append(messages)
            question = next(m["content"] for m in messages if m["role"] == "user")
            reply = self.script[question][sum(m["role"] == "assistant" for m in messages)]
            return JSONResponse({"id": f"c{len(self.requests)}", "object": "chat.completion", "created": 0,
                                 "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": reply}}],
                                 "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})

        self.sock = bind_socket("127.0.0.1", 0)
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/chat/completions", chat,
                                                                            methods=["POST"])]),
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ScriptedModel":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"


def _play(monkeypatch, script_of, count: int, harness: dict | None = None):
    """Episodes of the first ``count`` training tasks; ``script_of(answer)`` -> that task's replies."""
    monkeypatch.syspath_prepend(str(plugin_dir()))
    monkeypatch.setenv("MEGATRON_S2_SCRIPTED_KEY", "unused")
    agent = {"runtime": {"type": "subprocess"}, **({"harness": harness} if harness else {})}
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={**TASKSET, "split": "train", "count": count},
                                                    agent=agent))
    tasks = list(env.taskset)
    script = {t.data.prompt: script_of(t.data.answer) for t in tasks}
    with ScriptedModel(script) as model:
        client = vf.EvalClientConfig(base_url=model.url, api_key_var="MEGATRON_S2_SCRIPTED_KEY")
        ctx = vf.ModelContext(model="scripted", client=client, sampling=vf.SamplingConfig(max_tokens=8))

        async def run():
            async with env.serving():
                return [await env.run_episode(t, ctx) for t in tasks]

        episodes = asyncio.run(run())
    traces = []
    for episode in episodes:
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        traces.append(trace)
    return tasks, traces, model.requests


def _wrong(answer: str) -> str:
    return str(int(answer) + 1)


@pytest.mark.parametrize("replies, turns, solved, first, final, formed", [
    (lambda a: [a], 1, 1.0, 1.0, 1.0, 1.0),                   # right at once: one turn, no feedback
    (lambda a: [_wrong(a), a], 2, 0.5, 0.0, 1.0, 1.0),        # wrong, feedback, right
    (lambda a: [_wrong(a), _wrong(a) + "0"], 2, 0.0, 0.0, 0.0, 1.0),  # wrong twice: the session ends
    (lambda a: [" " + a + " "], 1, 1.0, 1.0, 1.0, 1.0),       # the task's verifier strips the reply
    (lambda a: ["=" + a, a], 2, 0.5, 0.0, 1.0, 0.0),          # not a number first: malformed, not just wrong
])
def test_a_wrong_reply_gets_the_feedback_and_one_more_try(monkeypatch, replies, turns, solved, first, final, formed):
    tasks, traces, requests = _play(monkeypatch, replies, count=2)
    assert len(requests) == 2 * turns
    for task, trace in zip(tasks, traces):
        said = replies(task.data.answer)
        assert trace.num_turns == turns and [m.content for m in trace.assistant_messages] == said[:turns]
        assert trace.rewards["solved"].score == solved and trace.reward == pytest.approx(solved)
        assert trace.rewards["correct"].score == final  # weight 0: the accuracy, not the reward
        assert trace.metrics["first_try_correct"] == first
        assert trace.metrics["second_try_correct"] == float(solved == 0.5)
        assert trace.metrics["first_try_well_formed"] == formed
        # per-turn rewards (credit: turn): each reply's own correctness, 0 for a turn not reached
        assert [trace.metrics[f"turn_reward_{k}"] for k in (1, 2, 3)] == [first, float(turns == 2 and final == 1.0), 0.0]
    for k, messages in enumerate(requests):
        assert messages[0] == {"role": "system", "content": "Reply with the answer only."}
        if k % turns:  # the second call: the whole exchange, the environment's feedback last
            assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
            assert messages[-1]["content"] == FEEDBACK


def test_max_tries_and_feedback_are_the_harness_config(monkeypatch):
    harness = {"id": "megatron_s2_retry", "max_tries": 3, "feedback": "No."}
    _, traces, requests = _play(monkeypatch, lambda a: [_wrong(a), _wrong(a), a], count=1, harness=harness)
    (trace,) = traces
    assert trace.num_turns == 3 and trace.reward == pytest.approx(1 / 3) and trace.metrics["first_try_correct"] == 0
    assert [m["content"] for m in requests[-1] if m["role"] == "user"][1:] == ["No.", "No."]


def test_without_the_system_prompt_the_task_is_asked_alone(monkeypatch):
    """``use_system_prompt: false`` (recipes/rl_tiny_verifiers_multiturn.yaml): the chats of the SFT data."""
    monkeypatch.setitem(TASKSET, "use_system_prompt", False)
    _, traces, requests = _play(monkeypatch, lambda a: [_wrong(a), a], count=1)
    assert [m["role"] for m in requests[-1]] == ["user", "assistant", "user"] and traces[0].reward == 0.5


def test_held_out_split_is_the_single_turn_one_and_never_a_training_task(monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir()))

    def prompts(taskset):
        env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent={"runtime": {"type": "subprocess"}}))
        return [t.data.prompt for t in env.taskset]

    train = prompts({**TASKSET, "split": "train", "count": 500})
    held_out = prompts({**TASKSET, "split": "eval", "count": 128})
    assert len(train) == 500 and len(held_out) == 128 and not set(train) & set(held_out)
    assert held_out == prompts({**TASKSET, "id": "megatron_s2_tasks", "split": "eval", "count": 128})


def test_the_multiturn_recipe_loads_and_passes_the_launch_pre_flight(capsys):
    from megatron_s2.cli import main

    env = load_recipe(str(ROOT / "recipes/phases/rl_addition_verifiers_retry.yaml")).rl.rollout.environment
    assert env.taskset["id"] == "megatron_s2_retry" and env.renderer == "bridge"
    assert main(["launch", str(ROOT / "recipes/rl_tiny_verifiers_multiturn.yaml"), "--local", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "phase sft" in err and "phase rl" in err


def test_the_shipped_sft_data_is_the_tools_output_with_this_environments_prompt_and_feedback(tmp_path):
    from megatron_s2.tools.make_chat_data import main

    out = tmp_path / "retry.jsonl"
    assert main(["--output", str(out), "--count", "8000", "--seed", "7", "--retry-task", "addition",
                 "--max-digits", "2", "--retry-fraction", "0.3", "--system-prompt", ""]) == 0
    assert out.read_bytes() == (ROOT / "recipes/data/addition_retry_chat.jsonl").read_bytes()
