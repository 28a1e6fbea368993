"""A single-turn verifiers (0.4.0, ``verifiers.v1``) environment for the server tests.

verifiers 0.4.0 has no ``SingleTurnEnv`` / ``Rubric`` any more (the v1 API composes a
*taskset* — tasks whose ``@vf.reward`` methods score a finished trace, which replaced rubrics —
with a *harness*, the program that talks to the model, run in a *runtime*). This module is a
plugin in that API: it exports one :class:`vf.Taskset` (arithmetic questions, a reward for the
right number and one for brevity, one turn) and one :class:`vf.Harness` — the taskset's default
harness — that asks the model once through the rollout's interception endpoint with the
``openai`` client, in-process (verifiers' own ``null`` harness does the same from a ``uv``
script, which needs ``uv`` and a package download at run time). Every model call goes through
verifiers' interception server, which hands it to the configured client: with
``TrainClientConfig`` that is ``TrainClient`` -> ``renderers.client.generate`` ->
``POST /inference/v1/generate`` on ``megatron-s2 serve``.

Imported by id (``megatron_s2_single_turn``) as verifiers loads plugins: the test puts this
folder on ``sys.path``.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

from megatron_s2.posttrain.envs.vf_tasks import AskOnceHarness  # the harness the embedded tasks ship with

__all__ = ["ArithmeticTaskset", "AskOnceHarness"]

QUESTIONS = [("2+2", 4), ("3+5", 8), ("7-4", 3)]


class ArithmeticData(vf.TaskData):
    answer: int
    """The number the reply should contain."""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or ""))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, vf.TasksetConfig]):
    def load(self) -> list[ArithmeticTask]:
        return [ArithmeticTask(ArithmeticData(idx=i, prompt=f"What is {q}?", system_prompt="Answer with a number.",
                                              answer=a), self.config.task) for i, (q, a) in enumerate(QUESTIONS)]
