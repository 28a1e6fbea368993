"""Synthetic task documents: the default training data, generated from a seed.

``num_documents`` problems are drawn from the configured tasks (task chosen uniformly per
document) with one :class:`random.Random` seeded by the dataset seed, so the same seed gives
the same documents on every machine and every data-parallel rank. Each problem is rendered as a
one-turn chat (:func:`~megatron_s2.data.documents.render_prompt_answer`; character tokenizer:
``bos + prompt + sep + answer + eos``).
Generating the default 20,000 documents takes a fraction of a second.
"""

from __future__ import annotations

import random
from typing import Sequence

from megatron_s2.config.data import DataConfig
from megatron_s2.data.documents import InMemoryDocuments, render_prompt_answers
from megatron_s2.data.tasks import Task, TaskSample, build_tasks
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["sample_problems", "generate_task_documents", "build_synthetic_documents"]


def sample_problems(tasks: Sequence[Task], count: int, seed: int) -> list[TaskSample]:
    """``count`` problems, each from a task chosen uniformly; deterministic in ``seed``."""
    rng = random.Random(seed)
    return [tasks[rng.randrange(len(tasks))].sample(rng) for _ in range(count)]


def generate_task_documents(tasks: Sequence[Task], count: int, seed: int, tokenizer: Tokenizer) -> InMemoryDocuments:
    """Tokenised documents of :func:`sample_problems`."""
    problems = sample_problems(tasks, count, seed)
    return InMemoryDocuments.from_documents(render_prompt_answers(tokenizer, [(p.prompt, p.answer) for p in problems]))


def build_synthetic_documents(cfg: DataConfig, run_seed: int, tokenizer: Tokenizer) -> InMemoryDocuments:
    """The synthetic dataset of a data config (`tasks`, `difficulty`, `num_documents`)."""
    tasks = build_tasks(cfg.tasks, cfg.difficulty)
    return generate_task_documents(tasks, cfg.num_documents, cfg.generation_seed(run_seed), tokenizer)
