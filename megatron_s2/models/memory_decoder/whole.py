"""What the Memory Decoder reads of a family model, whole on every rank of the model's layout
(Intern-S2 walkthrough Ch. 2: the datastore keys and the router features are the normalised last
hidden state h [b, s, d]; Eq. 1-4 compare distributions over the *whole* vocabulary).

Under tensor parallelism the LM head returns this rank's vocabulary shard [b, s, V/tp]
(:class:`~megatron_s2.parallel.vocab.VocabParallelHead`), and under sequence parallelism the last
hidden state is this rank's slice of the sequence [b, s/tp, d]. Both are gathered over tp: the
vocabulary is small next to the hidden state times the sequence (V = 128 on the tiny recipes), and
every tp rank then computes the same objective from the same tensors. The gathers are
differentiable with the gradient split back (each rank keeps its own shard's share): the
objective is identical on every tp rank, so each rank's gradient of the whole is already the full
one — a reduce-scatter would count it tp times. With tp = 1 both are the identity.
"""

from __future__ import annotations

import torch

from megatron_s2.parallel.mappings import gather_from_group, gather_sequence

__all__ = ["whole_vocabulary", "whole_sequence"]


def whole_vocabulary(logits: torch.Tensor, groups) -> torch.Tensor:
    """The logits [b, s, V] of every vocabulary entry from this rank's shard [b, s, V/tp]."""
    return gather_from_group(logits, groups.tp, dim=-1)


def whole_sequence(hidden: torch.Tensor, groups) -> torch.Tensor:
    """The last hidden state [b, s, d] of every position from this rank's (sequence-parallel) slice."""
    return gather_sequence(hidden, groups.tp, dim=1) if groups.sequence.sp else hidden
