"""The embedded verifiable tasks (``megatron_s2/data/tasks.py``) packaged as a ``verifiers``
environment (verifiers 0.4.0, the ``verifiers.v1`` API; the Prime Intellect talk's architecture).

verifiers 0.4.0 composes an environment from a *taskset* (tasks whose ``@vf.reward`` methods
score a finished trace — the rubric) and a *harness* (the program that talks to the model)
run in a *runtime*. This module provides both for the embedded tasks:

* :class:`EmbeddedTaskset` — the held-out (``split: eval``) or training prompts of one task,
  drawn exactly as the trainer's :class:`~megatron_s2.posttrain.envs.tasks.TaskEnvironment`
  draws them (same seed streams, so ``eval`` is never trained on); the rubric is
  ``correct`` (weight 1: the task's exact verifier on the reply) and ``answered`` (weight 0, a
  metric-only reward: the reply is non-empty);
* :class:`AskOnceHarness` — one chat completion through the rollout's interception endpoint,
  in process (verifiers' ``null`` harness does the same from a ``uv`` script, which needs a
  package download at run time).

:mod:`.vf_retry` (plugin id ``megatron_s2_retry``) plays the same tasks multi-turn: a second try
after the environment's feedback, rewarded 1 / the try that first verifies.

verifiers loads a taskset by the id of a top-level module exporting it via ``__all__``;
``megatron_s2/posttrain/envs/vf_plugins/megatron_s2_tasks.py`` is that module: put the folder
on ``sys.path`` (:func:`plugin_dir`) and use ``taskset={"id": "megatron_s2_tasks", ...}``. With
``vf.TrainClientConfig`` pointing at ``megatron-s2 serve``, every model call goes through
verifiers' interception server -> ``renderers.client.generate`` ->
``POST /inference/v1/generate`` (token ids, log-probs, routed experts), as for any verifiers
environment.
"""

from __future__ import annotations


from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field
from openai import AsyncOpenAI

import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

from megatron_s2.config.data import TaskDifficulty
from megatron_s2.data.tasks import build_task
from megatron_s2.posttrain.envs.tasks import _EVAL_STREAM, task_prompts

__all__ = ["EmbeddedTasksetConfig", "EmbeddedTaskData", "EmbeddedTask", "EmbeddedTaskset", "AskOnceHarness",
           "embedded_tasks", "plugin_dir", "reply_is_correct", "reply_is_well_formed", "opening_messages", "interception_client"]

SYSTEM_PROMPT = "Reply with the answer only."


def plugin_dir() -> Path:
    """The folder to put on ``sys.path`` so that verifiers finds the ``megatron_s2_tasks`` id."""
    return Path(__file__).resolve().parent / "vf_plugins"


class EmbeddedTasksetConfig(vf.TasksetConfig):
    task_name: str = "addition"
    """Embedded task (megatron_s2.config.data.TASK_NAMES)."""
    max_digits: int = 2
    """Difficulty: addition / multiplication operand digits (the other tasks use their defaults)."""
    split: Literal["train", "eval"] = "eval"
    """'eval': the held-out prompts (never trained on); 'train': the training prompts."""
    num_prompts: int = Field(default=4096, ge=1)
    """Training prompts of the environment (defines what 'held-out' excludes)."""
    count: int = Field(default=16, ge=1)
    """Tasks in this taskset (the first ``count`` of the split)."""
    seed: int = 0
    """Prompt-generation seed (rollout.environment.seed of the trainer)."""
    use_system_prompt: bool = True
    """Send SYSTEM_PROMPT before every task; false = the user's prompt alone, as the embedded tasks'
    synthetic SFT documents are rendered. (verifiers' own ``system_prompt`` field names a file whose
    text replaces it.)"""


class EmbeddedTaskData(vf.TaskData):
    task_name: str
    """Embedded task the prompt belongs to."""
    answer: str
    """Reference answer (the verifier does not need it; kept for inspection)."""


class EmbeddedTask(vf.Task[EmbeddedTaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """The task's exact verifier (megatron_s2/data/tasks.py) on the reply."""
        return float(reply_is_correct(self.data, trace.last_reply))

    @vf.reward(weight=0.0)
    async def answered(self, trace: vf.Trace) -> float:
        return float(bool((trace.last_reply or "").strip()))

    @vf.metric
    async def well_formed(self, trace: vf.Trace) -> float:
        """The reply has the answer's form, right or wrong (:func:`reply_is_well_formed`)."""
        return float(reply_is_well_formed(self.data, trace.last_reply))


def _prompt_text(data: EmbeddedTaskData) -> str:
    return data.prompt if isinstance(data.prompt, str) else str(data.prompt)


def reply_is_correct(data: EmbeddedTaskData, reply: str | None) -> bool:
    """The task's exact verifier (megatron_s2/data/tasks.py) on a reply (an empty one is wrong)."""
    reply = (reply or "").strip()
    return bool(reply) and _task(data.task_name).verify(_prompt_text(data), reply)


def reply_is_well_formed(data: EmbeddedTaskData, reply: str | None) -> bool:
    """The reply is made of the kinds of characters the reference answer is made of (digits for a
    sum, letters for a copied word, ...), right or wrong: the format half of the task. Its held-out
    mean (``eval_metric_well_formed``) tells a rise in accuracy that comes from the model learning
    the expected form of a reply (e.g. under a prompt it was not fine-tuned on) from one that comes
    from better answers in a form it already had."""
    reply = (reply or "").strip()
    kinds = {_char_kind(c) for c in data.answer}
    return bool(reply) and all(_char_kind(c) in kinds for c in reply)


def _char_kind(char: str) -> str:
    return "digit" if char.isdigit() else "letter" if char.isalpha() else "space" if char.isspace() else char


_TASKS: dict[str, object] = {}


def _task(name: str, max_digits: int | None = None):
    key = f"{name}:{max_digits}"
    if key not in _TASKS:
        knobs = {} if max_digits is None else {"addition_max_digits": max_digits,
                                                 "multiplication_max_digits": min(max_digits, 15)}
        _TASKS[key] = build_task(name, TaskDifficulty(**knobs))
    return _TASKS[key]


def embedded_tasks(config: EmbeddedTasksetConfig, task_type: type[vf.Task]) -> list[vf.Task]:
    """The tasks of ``config``'s split as ``task_type`` (the rubric): the first ``count`` training
    prompts, or the first ``count`` held-out ones (the eval stream minus every training prompt)."""
    c = config
    task = _task(c.task_name, c.max_digits)
    train = task_prompts(task, c.num_prompts, c.seed)
    if c.split == "train":
        samples = train[:c.count]
    else:
        seen = {s.prompt for s in train}
        pool = task_prompts(task, 4 * c.count + 16, c.seed ^ _EVAL_STREAM)
        samples = [s for s in pool if s.prompt not in seen][:c.count]
    system = SYSTEM_PROMPT if c.use_system_prompt else None
    return [task_type(EmbeddedTaskData(idx=i, prompt=s.prompt, system_prompt=system, task_name=c.task_name,
                                       answer=s.answer), c.task)
            for i, s in enumerate(samples)]


class EmbeddedTaskset(vf.Taskset[EmbeddedTask, EmbeddedTasksetConfig]):
    def load(self) -> list[EmbeddedTask]:
        return embedded_tasks(self.config, EmbeddedTask)


class AskOnceHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion through the interception endpoint, in this process."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        async with interception_client(endpoint, secret) as client:
            await client.chat.completions.create(model=ctx.model, messages=opening_messages(self, data))
        return ProgramResult(exit_code=0, stdout="", stderr="")


def opening_messages(harness: vf.Harness, data) -> list[dict]:
    """The task's system prompt (when it has one) and question, as chat messages."""
    system, prompt = harness.resolve_prompt(data)
    return [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]


def interception_client(endpoint: str, secret: str) -> AsyncOpenAI:
    """An OpenAI client of the rollout's in-process interception endpoint. openai's default 5 s
    connect timeout failed episodes (and the run) on a loaded 2-core machine while dozens of
    episodes opened their connection at once; the endpoint is in-process, so a slow accept is load,
    not an outage (verifiers' own clients set no read limit either: ClientTimeoutConfig)."""
    return AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=httpx.Timeout(None, connect=60.0))


