"""Synthetic task documents: the default training data, generated from a seed.

``num_documents`` problems are drawn from the configured tasks (task chosen uniformly per
document) with one :class:`random.Random` seeded by the dataset seed, so the same seed gives
the same documents on every machine and every data-parallel rank. Each problem is rendered as a
one-turn chat (:func:`~megatron_s2.data.documents.render_prompt_answer`; character tokenizer:
``bos + prompt + sep + answer + eos``).
Generating the default 20,000 documents takes a fraction of a second.

``near_miss_fraction`` makes the data an imperfect teacher's: that share of the documents (chosen
by a random stream of their own, so the problems are the clean data's) answers a systematic near
miss, the last digit one higher mod 10 (:func:`near_miss`). A model trained on it puts about that
much probability on the near miss of every prompt — a sampling mode, not a capacity limit, that RL
with an exact verifier could remove (recipes/rl_tiny_verifiers_repair.yaml measures how far it does).
"""

from __future__ import annotations

import random
from typing import Sequence

from megatron_s2.config.data import DataConfig
from megatron_s2.data.documents import InMemoryDocuments, render_prompt_answers
from megatron_s2.data.tasks import Task, TaskSample, build_tasks
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["sample_problems", "near_miss", "noisy_answers", "generate_task_documents", "build_synthetic_documents"]


def sample_problems(tasks: Sequence[Task], count: int, seed: int) -> list[TaskSample]:
    """``count`` problems, each from a task chosen uniformly; deterministic in ``seed``."""
    rng = random.Random(seed)
    return [tasks[rng.randrange(len(tasks))].sample(rng) for _ in range(count)]


def near_miss(answer: str) -> str:
    """The imperfect teacher's answer to an integer problem: the last digit one higher, mod 10
    (``"57"`` -> ``"58"``, ``"39"`` -> ``"30"``) — wrong, as long and as well formed as the answer."""
    if not answer.isdigit():
        raise ValueError(f"near_miss: needs a decimal integer answer, got {answer!r}")
    return answer[:-1] + str((int(answer[-1]) + 1) % 10)


def noisy_answers(problems: Sequence[TaskSample], fraction: float, seed: int) -> list[tuple[str, str]]:
    """``(prompt, answer)`` of each problem, the answer replaced by :func:`near_miss` with
    probability ``fraction`` (a stream apart from the problems' own: same seed, same problems)."""
    rng = random.Random(1_000_003 * seed + 29)  # never sample_problems(seed)'s stream
    return [(p.prompt, near_miss(p.answer) if rng.random() < fraction else p.answer) for p in problems]


def generate_task_documents(tasks: Sequence[Task], count: int, seed: int, tokenizer: Tokenizer,
                            near_miss_fraction: float = 0.0) -> InMemoryDocuments:
    """Tokenised documents of :func:`sample_problems` (a ``near_miss_fraction`` of them answering
    :func:`near_miss`)."""
    problems = sample_problems(tasks, count, seed)
    pairs = noisy_answers(problems, near_miss_fraction, seed) if near_miss_fraction else [(p.prompt, p.answer) for p in problems]
    return InMemoryDocuments.from_documents(render_prompt_answers(tokenizer, pairs))


def build_synthetic_documents(cfg: DataConfig, run_seed: int, tokenizer: Tokenizer) -> InMemoryDocuments:
    """The synthetic dataset of a data config (`tasks`, `difficulty`, `num_documents`, `near_miss_fraction`)."""
    tasks = build_tasks(cfg.tasks, cfg.difficulty)
    return generate_task_documents(tasks, cfg.num_documents, cfg.generation_seed(run_seed), tokenizer,
                                   cfg.near_miss_fraction)
