"""Vocabulary-parallel embedding, LM head and cross-entropy (explicit tensor-parallel group).

The vocabulary is split into contiguous shards over tp. The embedding looks up the rows it
owns and sums the partial results over tp (reduce-scatter over the sequence under SP); the
LM head produces this rank's vocabulary shard of the logits in float32 (precision map); the
cross-entropy combines the shards with three small all-reduces (max, sum-exp, target logit)
and never materialises the full logits. Megatron-core's versions read global groups; these
take the group and run on CPU with gloo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.placement import mark_param
from megatron_s2.parallel.sequence import SequenceSharding

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: Group, sequence_parallel: bool = False):
        super().__init__()
        if vocab_size % tp.size:
            raise ValueError(f"vocabulary {vocab_size} does not split over tp={tp.size}")
        self.tp, self.seq = tp, SequenceSharding.of(tp, sequence_parallel=sequence_parallel)
        self.part = vocab_size // tp.size
        self.start = tp.rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, dim))
        mark_param(self.weight, (vocab_size, dim), [(0, tp.rank, tp.size)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.part)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.seq.exit_tp_region(y)


class VocabParallelHead(nn.Module):
    """Prediction head producing this rank's vocabulary shard of the logits (float32)."""

    def __init__(self, vocab_size: int, dim: int, tp: Group, sequence_parallel: bool = False):
        super().__init__()
        self.tp, self.seq = tp, SequenceSharding.of(tp, sequence_parallel=sequence_parallel)
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, dim))
        mark_param(self.weight, (vocab_size, dim), [(0, tp.rank, tp.size)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.seq.enter_tp_region(h).float(), self.weight.float())


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: Group, start: int):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        gmax = mappings.all_reduce_max(local_max, tp)
        shifted = logits - gmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = mappings.all_reduce_sum(exp.sum(-1), tp)
        part = logits.size(-1)
        local = target - start
        inside = (local >= 0) & (local < part)
        picked = torch.gather(shifted, -1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        picked = mappings.all_reduce_sum(picked.masked_fill(~inside, 0.0), tp)
        loss = torch.log(sum_exp) - picked
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local.clamp(0, part - 1), inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: Group) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from vocabulary-sharded logits [b, s, V/tp]."""
    if not tp.active:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target, tp, tp.rank * logits.size(-1))
