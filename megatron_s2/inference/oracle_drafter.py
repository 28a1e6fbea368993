"""A drafter whose greedy drafts are always accepted: the upper bound of speculative decoding
(report 003 §2.4.3) on a given engine, for ``bench/speculative.py --oracle`` and the schedule's
tests. It proposes the target's own greedy continuation, recorded from a plain run, and still
runs the real drafter, so drafting costs what it costs."""

from __future__ import annotations

import torch

from megatron_s2.models.family.engine import Drafter

__all__ = ["GreedyOracle"]


class GreedyOracle(Drafter):
    """``inner``: the model's real drafter; ``continuations``: prompt -> prompt + plain greedy
    output (token ids)."""

    def __init__(self, inner: Drafter, continuations: dict[tuple[int, ...], list[int]]):
        self.inner, self.continuations, self.block_size = inner, continuations, inner.block_size

    def propose(self, requests):
        base, hidden = self.inner.propose(requests)
        logits = torch.full_like(base, -1e4)
        for r, req in enumerate(requests):
            future = self.continuations[tuple(req.prompt)][req.num_computed + 1:][:self.block_size]
            for i, token in enumerate(future):
                logits[r, i, token] = 1e4
        return logits, hidden

    def markov(self, previous):
        bias, embed = self.inner.markov(previous)
        return torch.zeros_like(bias), embed  # the oracle's tokens, not the Markov head's

    def confidence(self, hidden, embeds):
        return self.inner.confidence(hidden, embeds)
