"""Engram rows prefetched for a whole step, gradients returned once (report §3.1.3).

"Engram lookup indices depend solely on the input token sequence", so the rows a stage will
read are known before its first micro-batch runs. :class:`EngramPrefetch` hashes every local
micro-batch of the step for every Engram layer on this rank, deduplicates the row ids per
table and fetches them from their owners in **one** exchange for all layers (all-to-all of
per-(owner, table) counts, of ids, of rows). Micro-batches then read their rows from this
local cache. In backward the row gradients accumulate in the cache (buffered); after the
backbone backward of the whole step :meth:`EngramPrefetch.return_grads` sends them to their
owners in one more all-to-all, where each owner adds the contributions of every requesting
rank (in rank order) to its partition's gradient.

Against a lookup per micro-batch and layer (``EngramTable.forward``: three all-to-alls in
forward, one in backward) a step makes 4 collectives over the engram group instead of
``4 x micro-batches x Engram layers``, moves each distinct row once per step instead of once
per micro-batch that reads it, and none of them sits between the micro-batches' compute.
The numbers are the same up to summation order (row gradients are summed over micro-batches
before they travel). Recomputation reads the same cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megatron_s2.models.v41.engram.module import Engram
from megatron_s2.parallel.groups import Group

if TYPE_CHECKING:
    from megatron_s2.models.v41.context import ForwardContext

__all__ = ["EngramPrefetch"]


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.pg)
    return out


class EngramPrefetch:
    """The rows of one step's local batch for every Engram layer of this rank (module docstring)."""

    def __init__(self, modules: list[Engram], ids: dict[int, torch.Tensor]):
        self.modules = {m.layer_number: m for m in modules}
        self.group: Group = modules[0].table.group
        layers = sorted(self.modules)
        tables = [self.modules[layer].table for layer in layers]
        g = self.group.size
        uniq = [torch.unique(ids[layer].reshape(-1), sorted=True) for layer in layers]
        # send order: destination rank, then table (ids of one table and owner are contiguous)
        counts = [torch.bincount(torch.div(u, t.rows_per_rank, rounding_mode="floor"), minlength=g)
                  for u, t in zip(uniq, tables)]
        for layer, c in zip(layers, counts):
            if c.numel() > g:
                raise ValueError(f"Engram layer {layer}: a row id lies outside the table's (padded) rows")
        send_counts = torch.stack(counts, dim=1)  # [g, tables]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group.pg)
        starts = [torch.cumsum(c, 0) - c for c in send_counts.t()]  # per table: offset of each owner's ids
        send_ids = torch.cat([uniq[t][starts[t][r]:starts[t][r] + send_counts[r, t]]
                              for r in range(g) for t in range(len(tables))])
        out_splits, in_splits = recv_counts.sum(1).tolist(), send_counts.sum(1).tolist()
        got_ids = _all_to_all(send_ids, out_splits, in_splits, self.group)
        # owner side: rows for every (source rank, table) chunk, in the order they came
        chunks = torch.split(got_ids, recv_counts.reshape(-1).tolist())
        self._served = [(t, chunk - self.group.rank * tables[t].rows_per_rank)
                        for (r, t), chunk in zip(((r, t) for r in range(g) for t in range(len(tables))), chunks)]
        rows_out = torch.cat([tables[t].weight.detach().index_select(0, local) for t, local in self._served])
        rows_in = _all_to_all(rows_out, in_splits, out_splits, self.group)
        # requester side: back to table order (per table, owners ascending = sorted ids)
        by_chunk = torch.split(rows_in, send_counts.reshape(-1).tolist())
        self.tables, self.layers, self.uniq = tables, layers, dict(zip(layers, uniq))
        self.rows: dict[int, torch.Tensor] = {}
        for t, layer in enumerate(layers):
            rows = torch.cat([by_chunk[r * len(tables) + t] for r in range(g)])
            self.rows[layer] = rows.requires_grad_(tables[t].weight.requires_grad)
        self._splits = (out_splits, in_splits, send_counts)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def for_step(cls, model: torch.nn.Module, micro_batches: list[dict],
                 make_context: Callable[[dict], "ForwardContext"]) -> "EngramPrefetch | None":
        """Prefetch for every Engram module of ``model`` whose table is partitioned (engram
        group > 1), or None when there is none."""
        modules = [m for m in model.modules() if isinstance(m, Engram) and m.table.group.active]
        if not modules:
            return None
        ids: dict[int, list[torch.Tensor]] = {m.layer_number: [] for m in modules}
        for mb in micro_batches:
            ctx = make_context(mb)
            for m in modules:
                ids[m.layer_number].append(m.hash_ids(ctx)[0].reshape(-1))
        return cls(modules, {layer: torch.cat(parts) for layer, parts in ids.items()})

    # ---- forward ---------------------------------------------------------------------------
    def lookup(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[*ids.shape, width]`` of Engram layer ``layer`` (FP8-quantised like the table's)."""
        uniq = self.uniq[layer]
        pos = torch.searchsorted(uniq, ids.reshape(-1))
        if pos.numel() and (int(pos.max()) >= uniq.numel() or not torch.equal(uniq[pos], ids.reshape(-1))):
            raise ValueError(f"Engram layer {layer}: a row id was not prefetched for this step")
        rows = self.rows[layer].index_select(0, pos).view(*ids.shape, -1)
        return self.modules[layer].table.quantize(rows)

    def holds(self, layer: int) -> bool:
        return layer in self.rows

    # ---- after the backbone backward -----------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward (the family-model ``prepare_step`` protocol)."""
        self.return_grads()

    def return_grads(self) -> None:
        """Send the buffered row gradients to their owners and add them to the partitions'
        gradients (one all-to-all for every layer)."""
        if not any(t.weight.requires_grad for t in self.tables):
            return
        out_splits, in_splits, send_counts = self._splits
        g, n = self.group.size, len(self.tables)
        per_table = []
        for layer in self.layers:
            rows = self.rows[layer]
            per_table.append(rows.grad if rows.grad is not None else torch.zeros_like(rows))
        chunks = [torch.split(grad, send_counts[:, t].tolist()) for t, grad in enumerate(per_table)]
        send = torch.cat([chunks[t][r] for r in range(g) for t in range(n)])
        got = torch.split(_all_to_all(send, out_splits, in_splits, self.group), [len(i) for _, i in self._served])
        for t, table in enumerate(self.tables):
            if not table.weight.requires_grad:
                continue
            # every requesting rank's contributions, in rank order (deterministic accumulation)
            local = torch.cat([ids for (u, ids) in self._served if u == t])
            grads = torch.cat([grad for (u, _), grad in zip(self._served, got) if u == t])
            update = torch.zeros_like(table.weight).index_put_((local,), grads, accumulate=True)
            table.weight.grad = update if table.weight.grad is None else table.weight.grad.add_(update)
