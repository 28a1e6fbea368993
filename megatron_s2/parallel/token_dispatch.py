"""Dropless token dispatch and combine for expert and expert-tensor parallelism.

Every (token, selected expert) pair becomes one row; nothing is dropped or padded.

dispatch:
  1. **permute** — the N*K rows are sorted by global expert id (stable, so rows of one expert
     keep token order); the combine weight of each row travels with it.
  2. **expert parallel** (``groups.ep``) — experts are held in contiguous blocks of
     ``E / ep`` per ep rank, so the sorted block is already ordered by destination rank.
     Per-(rank, expert) counts are exchanged first, then rows and weights go through one
     variable-split all-to-all each. Received rows arrive as [source rank][local expert] and
     are regrouped to [local expert][source rank].
  3. **expert tensor parallel** (``groups.etp``) — the etp ranks hold the same experts, each
     a 1/etp slice of the FFN width, and (like every rank of the dispatch domain) route
     different tokens. The rows for the local experts are all-gathered over etp and regrouped
     to [local expert][etp rank]; every etp rank then runs all of them through its width
     slice (W1/W3 column-split, W2 row-split) and the partial outputs are reduce-scattered
     back. This is Megatron-core's all-to-all-then-all-gather order: the all-to-all moves
     each row once, and the etp collectives run over the (usually intra-node) etp group.

combine undoes the steps in reverse (reduce-scatter over etp, inverse all-to-all, unpermute)
and sums the K expert outputs of every token in a fixed order, so the result is
deterministic (no scatter-add).

Every rank of the dispatch domain must route *different* tokens; the MoE layer guarantees
this by splitting tokens over tp (e.g. :mod:`megatron_s2.models.v41.moe.moe_layer`; any family's MoE
layer can use it the same way).
All collectives are autograd-aware, so expert-weight gradients on a rank are the sums of
the contributions of every token dispatched to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_s2.parallel.all_to_all import (
    all_gather_rows,
    all_to_all,
    exchange_counts,
    gather_counts,
    reduce_scatter_rows,
)
from megatron_s2.parallel.groups import Group
from megatron_s2.kernels.precision import cast

__all__ = ["DispatchState", "DispatchedTokens", "AllToAllTokenDispatcher"]


@dataclass
class DispatchState:
    """Everything combine needs to send expert outputs back to their tokens."""

    num_tokens: int
    topk: int
    sort_order: torch.Tensor                   # [N*K] assignment row of each expert-sorted row
    ep_splits: tuple[list[int], list[int]] | None = None   # (rows sent per ep rank, rows received)
    ep_regroup: torch.Tensor | None = None     # received order -> local-expert order
    etp_sizes: list[int] | None = None         # rows contributed by each etp rank
    etp_regroup: torch.Tensor | None = None    # gathered order -> local-expert order


@dataclass
class DispatchedTokens:
    tokens: torch.Tensor            # [M, hidden] rows for the local experts, grouped by expert
    probs: torch.Tensor             # [M] combine weight of each row
    tokens_per_expert: list[int]    # rows per local expert
    state: DispatchState


def regroup_permutation(counts: torch.Tensor) -> torch.Tensor:
    """Rows laid out in chunks ordered [a][b] with ``counts[a, b]`` rows each: the index that
    reorders them to chunks ordered [b][a] (``rows[perm]``)."""
    a, b = counts.shape
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(a, b).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    out_starts = torch.cumsum(sizes, 0) - sizes
    total = int(flat.sum())
    pos = torch.arange(total, device=counts.device)
    return pos - torch.repeat_interleave(out_starts, sizes, output_size=total) \
        + torch.repeat_interleave(starts, sizes, output_size=total)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class AllToAllTokenDispatcher:
    def __init__(self, num_experts: int, ep: Group, etp: Group):
        if num_experts % ep.size:
            raise ValueError(f"ep={ep.size} does not divide num_routed_experts={num_experts}")
        self.num_experts, self.ep, self.etp = num_experts, ep, etp
        self.num_local_experts = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> DispatchedTokens:
        """``tokens`` [N, hidden], ``probs`` / ``indices`` [N, K] -> rows for the local experts."""
        rows, weights, counts, state = self._permute(tokens, probs, indices)
        local_counts = counts.view(self.ep.size, self.num_local_experts)[self.ep.rank]
        if self.ep.active:
            rows, weights, local_counts = self._exchange_over_ep(rows, weights, counts, state)
        if self.etp.active:
            rows, weights, local_counts = self._gather_over_etp(rows, weights, local_counts, state)
        return DispatchedTokens(rows, weights, local_counts.tolist(), state)

    def _permute(self, tokens, probs, indices):
        """One row per (token, selected expert), sorted by expert id (stable)."""
        n, k = indices.shape
        flat_ids = indices.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        rows = tokens.unsqueeze(1).expand(n, k, tokens.size(-1)).reshape(n * k, tokens.size(-1))[order]
        weights = probs.reshape(-1)[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        return rows, weights, counts, DispatchState(num_tokens=n, topk=k, sort_order=order)

    def _exchange_over_ep(self, rows, weights, counts, state):
        """Send each expert block to its ep rank; regroup the received rows by local expert."""
        send = counts.view(self.ep.size, self.num_local_experts)
        recv = exchange_counts(send, self.ep)  # [source rank, local expert]
        sent, received = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = all_to_all(rows, received, sent, self.ep)
        weights = all_to_all(weights, received, sent, self.ep)
        state.ep_splits, state.ep_regroup = (sent, received), regroup_permutation(recv)
        return rows[state.ep_regroup], weights[state.ep_regroup], recv.sum(0)

    def _gather_over_etp(self, rows, weights, local_counts, state):
        """All-gather the local experts' rows of every etp rank; regroup by local expert."""
        gathered = gather_counts(local_counts, self.etp)  # [etp rank, local expert]
        state.etp_sizes = gathered.sum(1).tolist()
        rows = all_gather_rows(rows, state.etp_sizes, self.etp)
        weights = all_gather_rows(weights, state.etp_sizes, self.etp)
        state.etp_regroup = regroup_permutation(gathered)
        return rows[state.etp_regroup], weights[state.etp_regroup], gathered.sum(0)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """[M, hidden] expert outputs (weighted, grouped by local expert) -> [N, hidden] per-token
        sums over the K selected experts, in at least float32."""
        y = expert_output
        if state.etp_regroup is not None:
            y = reduce_scatter_rows(y[_inverse(state.etp_regroup)], state.etp_sizes, self.etp)
        if state.ep_regroup is not None:
            sent, received = state.ep_splits
            y = all_to_all(y[_inverse(state.ep_regroup)], sent, received, self.ep)
        y = y[_inverse(state.sort_order)]
        acc = torch.float64 if y.dtype is torch.float64 else torch.float32  # promote_types, no operator call
        return cast(y, acc).view(state.num_tokens, state.topk, y.size(-1)).sum(dim=1)
