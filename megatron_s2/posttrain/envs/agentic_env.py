"""The embedded agentic tasks as a rollout dataset (``environment.kind: agentic``; issue 25).

To the orchestrator an :class:`AgenticEnvironment` is a
:class:`~megatron_s2.posttrain.orchestrator.PromptSource`: prompt ``i`` of ``train`` is the ``i``-th
seeded instance of the configured tasks (:func:`~megatron_s2.posttrain.agentic.tasks.task_variants`,
the tasks taking turns), ``eval`` holds ``eval_prompts`` distinct held-out instances — split by
content, so none is ever trained on. Its episodes are not token-level: a real harness plays each
instance in a sandbox against the in-process agent gateway
(:class:`~megatron_s2.posttrain.rollout.agentic_backend.AgenticBackend`), and the grader scores it.

Built before the model, so what cannot run is refused here with one line naming the key: an
unknown task, a task without instances asked for held-out ones, a sandbox backend this machine
lacks (how to install bubblewrap), a harness whose library is not installed. A harness whose
episodes leave several trace branches (smolagents re-renders its history: one branch per call) is
trained branch by branch, each policy segment once (:mod:`~megatron_s2.posttrain.episode_rows`).
"""

from __future__ import annotations

import importlib.util

from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.agentic.harnesses import HARNESSES, Harness, HarnessSettings
from megatron_s2.posttrain.agentic.sandbox import SandboxRuntime, SandboxUnavailable, detect_runtime
from megatron_s2.posttrain.agentic.tasks import AgenticTask, task_names, task_variants
from megatron_s2.posttrain.agentic.tools import tools_prompt
from megatron_s2.posttrain.envs.base import PromptSet, Split

__all__ = ["AgenticEnvironment", "draw_instances"]

_HARNESS_MODULES = {"openai_agents": ("agents", "openai-agents"), "anthropic": ("anthropic", "anthropic"),
                    "smolagents": ("smolagents", "smolagents"), "builtin": ("openai", "openai")}
"""Harness -> (the module it imports, its package on the index)."""


def draw_instances(config, what: str) -> tuple[list[AgenticTask], list[AgenticTask]]:
    """(train, held-out) instances of an agentic environment ``config``; ConfigError (one line,
    naming the key) for an unknown task or more held-out instances than exist. Needs no sandbox:
    the launch pre-flight calls it too (:func:`~megatron_s2.posttrain.checks.check_agentic_tasks`)."""
    known = task_names()
    for task in config.tasks:
        if task not in known:
            raise ConfigError(f"{what}.tasks: unknown agentic task {task!r}; known: {', '.join(known)}")
    try:
        train = task_variants(config.tasks, "train", config.num_prompts, config.seed, max_operand=config.max_operand)
        held_out = task_variants(config.tasks, "eval", config.eval_prompts, config.seed,
                                 max_operand=config.max_operand, distinct=True) if config.eval_prompts else []
    except ValueError as exc:
        raise ConfigError(f"{what}.eval_prompts: {exc}; lower eval_prompts, set it to 0, or use tasks with "
                          "instances (sum_pair, copy_word, spot_seven)") from None
    return train, held_out


class AgenticEnvironment(PromptSet):
    """Seeded instances of the embedded agentic tasks (module docstring)."""

    def __init__(self, name: str, config, tokenizer, *, what: str = "rollout.environment"):
        self.name, self.config, self.tokenizer, self.what = name, config, tokenizer, what
        self.max_turns = config.max_turns
        self.train, self.held_out = draw_instances(config, what)
        harness = config.agent.get("harness", "builtin")
        module, package = _HARNESS_MODULES[harness]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{what}.agent.harness: {harness} needs the '{package}' package, which is not "
                              f"installed; pip install {package}, or use harness: builtin")
        self.harness_name = harness
        try:
            self.runtime: SandboxRuntime = detect_runtime(config.sandbox)
        except SandboxUnavailable as exc:
            raise ConfigError(f"{what}.sandbox.backend: {exc}".splitlines()[0]) from None

    # ---- what the back end plays ----------------------------------------------------------------
    def task(self, index: int, split: Split = "train") -> AgenticTask:
        return (self.train if split == "train" else self.held_out)[index]

    def harness(self) -> Harness:
        cls = HARNESSES[self.harness_name]
        api = self.config.agent.get("api")
        return cls(api=api) if api else cls()

    def settings(self, *, temperature: float, max_tokens: int) -> HarnessSettings:
        return HarnessSettings(model="policy", max_turns=self.config.max_turns, max_tokens=max_tokens,
                               temperature=temperature, declare_tools=self.config.agent.get("declare_tools", True))

    # ---- PromptSet ---------------------------------------------------------------------------------
    def size(self, split: Split) -> int:
        return len(self.train) if split == "train" else len(self.held_out)

    def prompt_messages(self, index: int, split: Split = "train") -> list[dict]:
        """The opening chat as the builtin harness sends it (other harnesses use their own prompts)."""
        return [{"role": "system", "content": tools_prompt()}, {"role": "user", "content": self.task(index, split).prompt}]

    def prompt_tokens(self, index: int, effort: int | None = None) -> list[int]:
        """The builtin harness's rendered opening chat (informational: the trained ids come from the trace)."""
        try:
            return list(self.tokenizer.apply_chat_template(self.prompt_messages(index), add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template is refused by the recipe checks
            return []

    def longest_prompt_from(self, limit: int, split: Split = "train", efforts=(None,)) -> int:
        # every instance has its task's prompt; the instances differ only in their files
        longest = max((len(self.prompt_tokens(i)) for i in range(min(self.size("train"), len(self.config.tasks)))),
                      default=0)
        return longest if longest >= limit else 0
