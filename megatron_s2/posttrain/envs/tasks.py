"""The embedded verifiable tasks (``megatron_s2/data/tasks.py``) as rollout environments.

* :class:`TaskEnvironment` (``kind: task``) — single turn. The context is rendered exactly as
  the SFT documents were (the tokenizer's chat template up to the answer; ``bos + prompt + sep``
  with the character tokenizer, :func:`~megatron_s2.data.documents.render_prompt_answer`),
  the response is the generated text up to ``eos``, and the reward is the task's exact verifier
  (1.0 correct, 0.0 otherwise; a response cut by the length limit is wrong).
* :class:`RetryTaskEnvironment` (``kind: task_retry``) — multi-turn. After a wrong answer the
  environment appends ``feedback + sep`` (environment tokens, loss-masked) and the policy
  answers again, up to ``max_turns`` calls; reward 1.0 for a first-attempt solution,
  ``1 / turn`` for a later one, 0.0 if never solved. The session is one training sample.

Prompts are drawn from the task's sampler with ``random.Random`` streams keyed by
(environment seed, split), so the train and eval sets are fixed and reproducible; eval prompts
that also occur among the training prompts are dropped (held-out means never trained on).
"""

from __future__ import annotations

import random
from typing import Sequence

from megatron_s2.data.tasks import Task, TaskSample, build_task
from megatron_s2.data.tokenizer import Tokenizer
from megatron_s2.posttrain.advantages.effort import effort_instruction
from megatron_s2.posttrain.envs.base import Environment, Episode, EpisodeStep, Split

__all__ = ["TaskEnvironment", "RetryTaskEnvironment", "task_prompts"]

_EVAL_STREAM = 0x5EED_E7A1


_BOUNDARY_SLACK = 4
"""Tokens a user message may take beyond its UTF-8 bytes where it meets the chat template (a
pre-token straddling the boundary); the templates of recipes/tokenizers delimit it with special
tokens, so none in practice."""


def _render_user_turn(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def task_prompts(task: Task, count: int, seed: int) -> list[TaskSample]:
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(count)]


class _TaskEpisode(Episode):
    def __init__(self, env: "TaskEnvironment", sample: TaskSample, effort: int | None):
        self.env, self.sample, self.effort = env, sample, effort
        self.turn = 0

    def prompt_text(self) -> str:
        """The user message: the task's prompt, after the effort instruction when there is one."""
        return self.sample.prompt if self.effort is None else f"{effort_instruction(self.effort)}\n{self.sample.prompt}"

    def prompt_tokens(self) -> list[int]:
        # the SFT rendering of a one-turn chat up to the answer (char tokenizer: bos prompt sep;
        # a Hugging Face tokenizer: its chat template with the generation prompt)
        return _render_user_turn(self.env.tokenizer, self.prompt_text())

    def verify(self, completion: Sequence[int], finish_reason: str) -> bool:
        tok = self.env.tokenizer
        ids = list(completion)
        if not ids or ids[-1] != tok.eos_id or finish_reason != "stop":
            return False  # cut by the length limit: no final answer
        return self.env.task.verify(self.sample.prompt, tok.decode(ids[:-1]))

    def step(self, completion: Sequence[int], finish_reason: str) -> EpisodeStep:
        self.turn += 1
        ok = self.verify(completion, finish_reason)
        return EpisodeStep(done=True, delta=[], reward=1.0 if ok else 0.0, correct=ok)


class _RetryEpisode(_TaskEpisode):
    def step(self, completion: Sequence[int], finish_reason: str) -> EpisodeStep:
        self.turn += 1
        ok = self.verify(completion, finish_reason)
        if ok:
            return EpisodeStep(done=True, delta=[], reward=1.0 / self.turn, correct=True)
        if self.turn >= self.env.max_turns or finish_reason != "stop":
            return EpisodeStep(done=True, delta=[], reward=0.0, correct=False)
        tok = self.env.tokenizer
        return EpisodeStep(done=False, delta=[*tok.encode(self.env.feedback), tok.sep_id])


class TaskEnvironment(Environment):
    """An embedded task, single turn (module docstring)."""

    episode_type = _TaskEpisode

    def __init__(self, name: str, config, tokenizer: Tokenizer):
        """``config``: an :class:`~megatron_s2.config.posttrain.environment.EnvironmentConfig`."""
        self.name, self.config, self.tokenizer = name, config, tokenizer
        self.task = build_task(config.task, config.difficulty)
        self.max_turns = config.max_turns
        self.feedback = config.feedback
        self._train = task_prompts(self.task, config.num_prompts, config.seed)
        seen = {s.prompt for s in self._train}
        # Held-out prompts: a separate stream, minus anything in the training set.
        pool = task_prompts(self.task, 4 * config.eval_prompts + 16, config.seed ^ _EVAL_STREAM)
        self._eval = [s for s in pool if s.prompt not in seen][:config.eval_prompts]

    def _samples(self, split: Split) -> list[TaskSample]:
        return self._train if split == "train" else self._eval

    def size(self, split: Split) -> int:
        return len(self._samples(split))

    def sample(self, index: int, split: Split = "train") -> TaskSample:
        return self._samples(split)[index]

    def episode(self, index: int, split: Split = "train", effort: int | None = None) -> Episode:
        return self.episode_type(self, self._samples(split)[index], effort)

    def reference_answer(self, index: int, split: Split) -> list[int]:
        return [*self.tokenizer.encode(self._samples(split)[index].answer), self.tokenizer.eos_id]

    @classmethod
    def prompt_tokens_at_most(cls, config, tokenizer: Tokenizer, efforts: Sequence[int | None] = (None,)) -> int:
        """An upper bound on the tokens of every first-turn prompt of an environment of ``config``,
        from the task's longest prompt text, without drawing the prompt sets (a million take tens
        of seconds): every token covers at least one byte of the text, so a prompt has at most the
        empty prompt's tokens + its text's UTF-8 bytes (+ slack at the template boundary)."""
        task = build_task(config.task, config.difficulty)
        instruction = max((len(effort_instruction(e).encode("utf-8")) + 1 for e in efforts if e is not None),
                          default=0)  # "<instruction>\n" before the prompt
        return len(_render_user_turn(tokenizer, "")) + _BOUNDARY_SLACK + instruction + task.max_prompt_chars

    def longest_prompt_from(self, limit: int, split: Split = "train", efforts: Sequence[int | None] = (None,)) -> int:
        """As :meth:`Environment.longest_prompt_from`, in well under a second for a million prompts:
        nothing is tokenized when :meth:`prompt_tokens_at_most` is below ``limit``; otherwise only
        the prompts whose own bound (the same rule on their text) reaches it."""
        if self.prompt_tokens_at_most(self.config, self.tokenizer, efforts) < limit:
            return 0
        overhead = len(_render_user_turn(self.tokenizer, "")) + _BOUNDARY_SLACK
        longest = 0
        for index in range(self.size(split)):
            for effort in efforts:
                episode = self.episode_type(self, self._samples(split)[index], effort)
                text = episode.prompt_text()
                if overhead + len(text.encode("utf-8")) >= limit:  # may not fit: count exactly
                    longest = max(longest, len(_render_user_turn(self.tokenizer, text)))
        return longest if longest >= limit else 0


class RetryTaskEnvironment(TaskEnvironment):
    """An embedded task with retries after feedback (multi-turn, module docstring)."""

    episode_type = _RetryEpisode
