"""A verifiers (0.4.0, ``verifiers.v1``) environment as a rollout dataset (``environment.kind: verifiers``).

The environment is built exactly as verifiers builds one for an eval or a prime-rl run — a
``vf.SingleAgentEnv`` over the configured taskset (``environment.taskset``: plugin id + that
taskset's config) and agent (``environment.agent``: harness, runtime, limits). To the
orchestrator it is a :class:`~megatron_s2.posttrain.orchestrator.PromptSource`: prompt ``i`` is
the taskset's task ``i``. Its episodes are run by
:class:`~megatron_s2.posttrain.rollout.vf_backend.VerifiersBackend` against our server over the
co-located engine; the rubric (the taskset's ``@vf.reward`` functions) scores them.

A verifiers taskset has no split: the held-out tasks of ``eval`` come from a second taskset config
(``environment.eval_taskset``, e.g. the embedded tasks' ``split: eval``) played by the same agent,
minus any task whose opening chat is a training task's (held out = never trained on).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.envs.base import PromptSet, Split

__all__ = ["VerifiersEnvironment", "resolve_plugin_path"]

_ROOT = Path(__file__).resolve().parents[3]


def resolve_plugin_path(path: str, what: str) -> Path:
    """``path`` relative to the working directory, then to the project root."""
    for candidate in (Path(path), _ROOT / path):
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(f"{what}: {path} is not a folder (relative paths: working directory, then the project "
                      f"root {_ROOT}); give the folder that holds the taskset's plugin module")


def _add_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def _first_line(exc: BaseException) -> str:
    """The one line that says what is wrong: a pydantic error's first field and message (its own
    first line is only "1 validation error for SingleAgentEnvConfig"), a plugin's syntax error's
    file:line, else the exception's first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            e = errors()[0]
            return f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    if isinstance(exc, SyntaxError):
        return f"syntax error in {exc.filename}:{exc.lineno}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class VerifiersEnvironment(PromptSet):
    """A verifiers taskset x agent; prompts = its tasks (module docstring)."""

    def __init__(self, name: str, config, tokenizer, *, what: str = "rollout.environment"):
        from megatron_s2.posttrain.envs.vf_tasks import plugin_dir

        self.name, self.config, self.tokenizer = name, config, tokenizer
        _add_path(plugin_dir())  # the embedded tasks' id, megatron_s2_tasks
        if config.plugin_path:
            _add_path(resolve_plugin_path(config.plugin_path, f"{what}.plugin_path"))
        self.env, self.tasks = self._build(config.taskset, f"{what}.taskset")
        self.eval_env, self.eval_tasks, self.eval_dropped = None, [], 0
        if config.eval_taskset:  # the same agent on the held-out tasks: a second env, its own interception
            self.eval_env, tasks = self._build(config.held_out_taskset(), f"{what}.eval_taskset")
            seen = {_opening(t) for t in self.tasks}
            self.eval_tasks = [t for t in tasks if _opening(t) not in seen]  # held out = never trained on
            self.eval_dropped = len(tasks) - len(self.eval_tasks)

    def _build(self, taskset: dict, what: str):
        import verifiers.v1 as vf

        agent = {"runtime": {"type": "subprocess"}, **self.config.agent}
        try:
            env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=dict(taskset), agent=agent))
            tasks = list(env.taskset)
        # OSError / AttributeError: a field verifiers reads at construction, e.g. its `system_prompt` file
        except (ImportError, ValueError, TypeError, KeyError, SyntaxError, OSError, AttributeError) as exc:
            first = _first_line(exc).removeprefix("taskset.")  # `what` already names the taskset
            raise ConfigError(f"{what}: verifiers cannot build the environment {taskset.get('id')!r} ({first}); check "
                              "the taskset id / config, agent and plugin_path") from None
        if not tasks:
            raise ConfigError(f"{what}: the taskset {taskset.get('id')!r} has no tasks")
        return env, tasks

    def size(self, split: Split) -> int:
        return len(self.tasks) if split == "train" else len(self.eval_tasks)

    def env_of(self, split: Split):
        """``(verifiers env, its tasks)`` of ``split``."""
        return (self.env, self.tasks) if split == "train" else (self.eval_env, self.eval_tasks)

    def prompt_messages(self, index: int, split: Split = "train") -> list[dict]:
        """The task's opening chat (system prompt + user prompt) as the harness is expected to send it."""
        return _messages(self.env_of(split)[1][index])

    def prompt_tokens(self, index: int, effort: int | None = None) -> list[int]:
        """The rendered opening chat (informational: the trained ids come from the trace)."""
        try:
            return list(self.tokenizer.apply_chat_template(self.prompt_messages(index), add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a prompt the template cannot render is still a valid task
            return []

    def longest_prompt_from(self, limit: int, split: Split = "train", efforts=(None,)) -> int:
        """The longest rendered opening chat of ``split`` (the harness may send a longer one: its
        trace, not this, is what the engine sees)."""
        longest = 0
        for index in range(self.size(split)):
            try:
                longest = max(longest, len(self.tokenizer.apply_chat_template(self.prompt_messages(index, split),
                                                                              add_generation_prompt=True)))
            except Exception:  # noqa: BLE001 - as prompt_tokens
                continue
        return longest if longest >= limit else 0


def _messages(task) -> list[dict]:
    data = task.data
    system = getattr(data, "system_prompt", None)
    messages = [{"role": "system", "content": system}] if system else []
    prompt = data.prompt
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]


def _opening(task) -> str:
    """A task's opening chat as a comparable key."""
    return json.dumps(_messages(task), sort_keys=True, default=str)
