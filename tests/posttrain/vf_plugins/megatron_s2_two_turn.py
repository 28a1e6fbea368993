"""A two-turn verifiers (0.4.0, ``verifiers.v1``) environment for the RL-on-verifiers tests: the
harness asks a question, then sends the model's reply back with a user follow-up and asks again
(both calls through the rollout's interception endpoint, with the ``openai`` client, in process).
The rubric rewards a short final reply (graded, so group advantages are not all zero) and logs
whether the first reply was empty. Imported by id (``megatron_s2_two_turn``): the test puts this
folder on ``sys.path`` (``environment.plugin_path``)."""

from __future__ import annotations

from openai import AsyncOpenAI

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

__all__ = ["TwoTurnTaskset", "FollowUpHarness"]

FOLLOW_UP = "Say it again, shorter."


class TwoTurnTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def two_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 2

    @vf.reward(weight=1.0)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or ""))


class TwoTurnTaskset(vf.Taskset[TwoTurnTask, vf.TasksetConfig]):
    def load(self) -> list[TwoTurnTask]:
        questions = ["What is 2+2?", "Name a colour.", "Count to three."]
        return [TwoTurnTask(vf.TaskData(idx=i, prompt=q, system_prompt="Answer briefly."), self.config.task)
                for i, q in enumerate(questions)]


class FollowUpHarness(vf.Harness[vf.HarnessConfig]):
    """Two chat completions: the question, then the reply and a follow-up."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            first = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": FOLLOW_UP}]
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout="", stderr="")
