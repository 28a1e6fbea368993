"""A learnable multi-turn verifiers environment: the embedded tasks with a second try after feedback
(verifiers 0.4.0, ``verifiers.v1``; plugin id ``megatron_s2_retry``).

The verifiers twin of the token-level ``task_retry`` kind (:mod:`.tasks`): the harness asks the
task (the same system prompt, prompts and splits as :class:`~.vf_tasks.EmbeddedTaskset`: the
held-out ``split: eval`` is never trained on); when the reply does not verify, the environment
answers ``feedback`` as the user ("Wrong. Try again.") and the model answers again, up to
``max_tries`` replies; a right reply ends the session. Every call goes through the rollout's
interception endpoint, so with ``environment.renderer: bridge`` the session is one training sample
whose environment tokens (the feedback turn and the template's markers around it) are
loss-masked (:func:`~megatron_s2.posttrain.rollout.vf_trace.trace_sample`). The harness's config
sets the tries and the words: ``environment.agent: {harness: {id: megatron_s2_retry, max_tries: 3,
feedback: "No."}}`` (recipes/rl_tiny_verifiers_multiturn.yaml keeps the defaults).

Rubric (:class:`RetryTask`):

* ``solved`` (weight 1) — ``1 / k`` for a session whose first right reply is its ``k``-th: 1.0 on
  the first try, 0.5 on the second, 0.0 if never right. The rule of ``task_retry``: a reward for
  the final reply alone would pay a second-try solution as much as a first-try one (the retry a
  free second sample), so RL would not push first-try accuracy; the discount keeps that pressure
  and still rewards using the feedback, and its three levels leave fewer groups uniform.
* ``correct`` (weight 0) — the final reply verifies (= solved within ``max_tries``): the run's
  accuracy (``eval_accuracy``, ``rollout_accuracy``).
* ``first_try_correct`` (a metric) — the first reply verifies: ``eval_metric_first_try_correct``.
* ``second_try_correct`` (a metric) — the second reply verifies after a wrong first one (what the
  feedback turn adds); ``first_try_well_formed`` (a metric) — the first reply has the answer's
  form, right or wrong (a held-out rise in accuracy at a constant ~1.0 here is not a format effect).
* ``turn_reward_1`` .. ``turn_reward_3`` (metrics) — the per-turn rewards: 1.0 when the k-th reply
  verifies, else 0.0 (0.0 for a turn the session did not reach). The sample builder reads them as
  the session's per-turn rewards (:attr:`~megatron_s2.posttrain.orchestrator.RolloutSample.turn_rewards`,
  one per assistant turn the sample holds) instead of reporting them, so that with
  ``rl.advantage.credit: turn`` the first reply is credited by first-try correctness alone and the
  second by second-try correctness; the session reward (``solved``) is unchanged.
"""

from __future__ import annotations

from pydantic import Field

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

from megatron_s2.posttrain.envs.vf_tasks import (EmbeddedTaskData, EmbeddedTasksetConfig, embedded_tasks,
                                                 interception_client, opening_messages, reply_is_correct,
                                                 reply_is_well_formed)

__all__ = ["FEEDBACK", "turn_correct", "RetryTask", "RetryTaskset", "RetryHarnessConfig", "RetryHarness", "replies"]

FEEDBACK = "Wrong. Try again."
"""The environment's reply to a wrong answer (short: the tiny model reads it)."""


def replies(trace: vf.Trace) -> list[str]:
    """The model's replies of a session, in order (every branch: a re-rendered history splits it)."""
    return [(m.content or "").strip() if isinstance(m.content, str) or m.content is None else str(m.content)
            for m in trace.assistant_messages]


def turn_correct(data: EmbeddedTaskData, trace: vf.Trace, k: int) -> float:
    """1.0 when the session's ``k``-th reply (1-based) exists and verifies, else 0.0."""
    said = replies(trace)
    return float(len(said) >= k and reply_is_correct(data, said[k - 1]))


class RetryTask(vf.Task[EmbeddedTaskData]):
    @vf.stop
    async def solved_now(self, trace: vf.Trace) -> bool:
        """A right reply ends the session (the harness's ``max_tries`` ends a wrong one)."""
        said = replies(trace)
        return bool(said) and reply_is_correct(self.data, said[-1])

    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        """``1 / k`` for the first right reply being the ``k``-th; 0.0 if none is right."""
        k = next((i for i, r in enumerate(replies(trace), 1) if reply_is_correct(self.data, r)), 0)
        return 1.0 / k if k else 0.0

    @vf.reward(weight=0.0)
    async def correct(self, trace: vf.Trace) -> float:
        """The final reply verifies (the accuracy metric)."""
        said = replies(trace)
        return float(bool(said) and reply_is_correct(self.data, said[-1]))

    @vf.metric
    async def first_try_correct(self, trace: vf.Trace) -> float:
        said = replies(trace)
        return float(bool(said) and reply_is_correct(self.data, said[0]))

    @vf.metric
    async def first_try_well_formed(self, trace: vf.Trace) -> float:
        """The first reply has the answer's form, right or wrong (a format check: see
        :func:`~.vf_tasks.reply_is_well_formed`)."""
        said = replies(trace)
        return float(bool(said) and reply_is_well_formed(self.data, said[0]))

    @vf.metric
    async def second_try_correct(self, trace: vf.Trace) -> float:
        """The session was solved by its second reply, after the feedback (the first was wrong):
        what the retry adds, ``correct`` − ``first_try_correct`` per episode."""
        said = replies(trace)
        return float(len(said) >= 2 and not reply_is_correct(self.data, said[0])
                     and reply_is_correct(self.data, said[1]))


    # per-turn rewards (credit: turn; read by the sample builder, see vf_trace.TURN_REWARD_PREFIX)
    @vf.metric
    async def turn_reward_1(self, trace: vf.Trace) -> float:
        return turn_correct(self.data, trace, 1)

    @vf.metric
    async def turn_reward_2(self, trace: vf.Trace) -> float:
        return turn_correct(self.data, trace, 2)

    @vf.metric
    async def turn_reward_3(self, trace: vf.Trace) -> float:
        return turn_correct(self.data, trace, 3)


class RetryTaskset(vf.Taskset[RetryTask, EmbeddedTasksetConfig]):
    """The embedded tasks (same fields and splits as ``megatron_s2_tasks``) with the retry rubric."""

    def load(self) -> list[RetryTask]:
        return embedded_tasks(self.config, RetryTask)


class RetryHarnessConfig(vf.HarnessConfig):
    feedback: str = Field(default=FEEDBACK, min_length=1)
    """The user's reply to a wrong answer."""
    max_tries: int = Field(default=2, ge=1)
    """Model replies per session at most (1 = single turn)."""


class RetryHarness(vf.Harness[RetryHarnessConfig]):
    """Ask; while the reply is wrong and tries are left, answer ``feedback`` and ask again — every
    call through the interception endpoint, in this process."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        messages = opening_messages(self, data)
        async with interception_client(endpoint, secret) as client:
            for attempt in range(1, self.config.max_tries + 1):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                text = reply.choices[0].message.content or ""
                if attempt == self.config.max_tries or reply_is_correct(data, text):
                    break
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": self.config.feedback}]
        return ProgramResult(exit_code=0, stdout="", stderr="")
