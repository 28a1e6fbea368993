"""A single-turn verifiers (0.4.0, ``verifiers.v1``) taskset with a held-out split and a binary
reward that any model earns about half the time, for the metric and evaluation tests: ``correct``
is 1 when the reply has an even number of characters (so groups of a random model are sometimes
uniform — dynamic sampling drops them — and sometimes mixed), recomputable from the trace alone.
``split: train`` and ``split: eval`` hold disjoint prompts. Harness: the embedded tasks' one-call
harness. Imported by id (``megatron_s2_parity``): the tests put this folder on ``sys.path``
(``environment.plugin_path``)."""

from __future__ import annotations

from typing import Literal

import verifiers.v1 as vf

from megatron_s2.posttrain.envs.vf_tasks import AskOnceHarness

__all__ = ["ParityTaskset", "AskOnceHarness", "reply_reward"]


def reply_reward(reply: str | None) -> float:
    """The rubric, for the tests to recompute it from a trace."""
    return float(len(reply or "") % 2 == 0)


class ParityTasksetConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """'train': prompts 0, 2, 4 ...; 'eval': prompts 1, 3, 5 ... (never trained on)."""
    count: int = 8
    """Tasks in this taskset."""
    offset: int = 0
    """Skip this many prompts of the split (so two configs of one split can overlap partly)."""


class ParityTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return reply_reward(trace.last_reply)


class ParityTaskset(vf.Taskset[ParityTask, ParityTasksetConfig]):
    def load(self) -> list[ParityTask]:
        first = 0 if self.config.split == "train" else 1
        c = self.config
        return [ParityTask(vf.TaskData(idx=i, prompt=f"Item {2 * (i + c.offset) + first}?", system_prompt="Reply."),
                           c.task) for i in range(c.count)]
