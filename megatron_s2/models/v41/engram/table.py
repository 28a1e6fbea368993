"""Engram embedding table partitioned by row over the engram-parallel group (report §3.1.3).

"Engram embedding tables are partitioned by row across dedicated process groups of engram
parallel size." The group (``ParallelGroups.engram``) consists of ranks that hold the same
model shard but process *different tokens* (data x context parallel replicas), so a lookup is
a distributed gather:

1. each rank deduplicates the rows it needs (sorted, so the exchange is deterministic) and
   sends each id to the rank owning it (all-to-all of ids);
2. owners read their rows and send them back (all-to-all of rows);
3. in backward, the gradient of every requested row is summed locally per unique id, sent
   back to the owner along the same route in reverse, and the owner accumulates the
   contributions of all requesting ranks into its partition (in rank order: deterministic).

The table's gradient is then complete for the tokens of the engram group; replicas of the same
partition (``ParallelGroups.engram_replica``) still have to be all-reduced, which the gradient
finaliser does for parameters placed ``engram_rows`` (replicas: the Engram replica group).
This per-call lookup serves inference and modules used on their own; training prefetches the
rows of the whole local batch and returns their gradients after the backbone backward, as the
report does (:mod:`.prefetch`).

**Row padding.** The concatenated table of a layer has ``sum(primes)`` rows. Rows are padded
to a multiple of :data:`ENGRAM_ROW_ALIGN` (256), a constant, so that the parameter's full shape
(and with it initialisation, checkpoints and gradient gathering) does not depend on the layout;
any engram-parallel size dividing 256 is supported and others are rejected with a message.
Padding rows are zero, never addressed and never receive gradient.

**FP8 rows** (§2.4.2 "the embedding tables ... use FP8 precision", §3.1.3 "stored and fetched
in FP8"): with ``engram_fp8_tables`` the fetched rows are fake-quantised to E4M3 with one
power-of-two (E8M0) scale per 32 channels -- the reference's storage format -- or one scale per
row when the row width is not a multiple of 32. The gradient is straight-through.

**Initialisation**: ``N(0, init_std)`` like the token embedding (both are trained with the
Sinkhorn-balanced update of §2.5). Rows are generated in blocks of :data:`INIT_BLOCK_ROWS` from
per-block generators, so a rank can produce its own rows without materialising the full table
(``param.init_shard_fn``); ``param.init_fn`` produces the same values for the full tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_s2.kernels import engram_rows, fake_quant_fp8
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.placement import mark_param
from megatron_s2.parallel.sharding import name_seed

__all__ = [
    "ENGRAM_ROW_ALIGN",
    "INIT_BLOCK_ROWS",
    "EngramTable",
    "distributed_lookup",
    "fake_quant_rows",
    "padded_rows",
    "table_init",
]

ENGRAM_ROW_ALIGN = 256
"""Table rows are padded to a multiple of this (layout-independent) number."""
INIT_BLOCK_ROWS = 1 << 16
"""Rows generated from one generator during initialisation."""
FP8_BLOCK = 32
"""Channels sharing one power-of-two scale in FP8 rows."""


def padded_rows(rows: int, align: int = ENGRAM_ROW_ALIGN) -> int:
    return -(-rows // align) * align


def table_init(num_rows: int, std: float, block_rows: int = INIT_BLOCK_ROWS
               ) -> tuple[Callable[[torch.Tensor, torch.Generator], None],
                          Callable[[torch.Tensor, int, torch.Generator], None]]:
    """``(init_fn(full, gen), init_shard_fn(local, first_row, gen))`` drawing the same values.

    Row block ``j`` (rows ``[j B, (j+1) B)``) is drawn from a generator seeded by
    ``(base, j)``, ``base`` being the first draw of ``gen``; rows ``>= num_rows`` are zero.
    """

    def init_shard(local: torch.Tensor, first_row: int, gen: torch.Generator) -> None:
        base = int(torch.randint(0, 2 ** 62, (1,), generator=gen, device="cpu"))
        local.zero_()
        lo, hi = first_row, min(first_row + local.size(0), num_rows)
        for block in range(lo // block_rows, -(-hi // block_rows) if hi > lo else 0):
            b_lo, b_hi = block * block_rows, min((block + 1) * block_rows, num_rows)
            g = torch.Generator(device="cpu").manual_seed(name_seed(base, f"rows{block}"))
            rows = torch.randn(b_hi - b_lo, local.size(1), generator=g, device="cpu") * std
            s_lo, s_hi = max(lo, b_lo), min(hi, b_hi)
            local[s_lo - first_row:s_hi - first_row] = rows[s_lo - b_lo:s_hi - b_lo].to(local.dtype)

    def init_full(full: torch.Tensor, gen: torch.Generator) -> None:
        init_shard(full, 0, gen)

    return init_full, init_shard


def fake_quant_rows(rows: torch.Tensor) -> torch.Tensor:
    """E4M3 rows, one power-of-two scale per 32 channels (per row if the width is not a multiple)."""
    width = rows.size(-1)
    return fake_quant_fp8(rows, FP8_BLOCK if width % FP8_BLOCK == 0 else width)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.pg)
    return out


class _DistributedLookup(torch.autograd.Function):
    """Row gather from a table partitioned over ``group`` (module docstring, steps 1-3)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, group: Group, rows_per_rank: int):
        uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        owner = torch.div(uniq, rows_per_rank, rounding_mode="floor")
        send = torch.bincount(owner, minlength=group.size)
        if send.numel() > group.size:
            raise ValueError(f"Engram row id {int(uniq[-1])} is outside the table's "
                             f"{rows_per_rank * group.size} (padded) rows")
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group.pg)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        local_ids = _all_to_all(uniq, recv_splits, send_splits, group) - group.rank * rows_per_rank
        fetched = _all_to_all(weight.detach().index_select(0, local_ids), send_splits, recv_splits, group)
        ctx.save_for_backward(inverse, local_ids)
        ctx.group, ctx.splits, ctx.weight_shape, ctx.num_uniq = group, (send_splits, recv_splits), weight.shape, uniq.numel()
        return fetched.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, local_ids = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        grad_uniq = grad.new_zeros((ctx.num_uniq, grad.size(-1))).index_put_((inverse,), grad, accumulate=True)
        grad_rows = _all_to_all(grad_uniq, recv_splits, send_splits, ctx.group)
        grad_weight = grad.new_zeros(ctx.weight_shape).index_put_((local_ids,), grad_rows, accumulate=True)
        return None, grad_weight, None, None


def distributed_lookup(ids: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows ``ids`` (global row ids, any shape) of a table whose rank-``r`` partition
    ``weight`` holds rows ``[r R, (r+1) R)``; ``[*ids.shape, width]``, autograd-aware."""
    if not group.active:
        return F.embedding(ids, weight)
    flat = _DistributedLookup.apply(ids.reshape(-1), weight, group, weight.size(0))
    return flat.view(*ids.shape, weight.size(1))


class EngramTable(nn.Module):
    """One layer's concatenated Engram table, rows partitioned over ``group``.

    Full (padded) shape ``[padded_rows(num_rows), width]``; this rank holds rows
    ``[rank R, (rank+1) R)`` with ``R = padded / group.size``. ``forward(ids)`` returns the
    rows ``[*ids.shape, width]`` (FP8 fake-quantised when ``fp8``).
    """

    def __init__(self, num_rows: int, width: int, group: Group | None = None, *, fp8: bool = False,
                 init_std: float = 0.006, dtype: torch.dtype = torch.float32):
        super().__init__()
        group = group or Group.single()
        full = padded_rows(num_rows)
        if full % group.size:
            raise ValueError(f"parallel.engram_parallel: {group.size} does not divide the {full} (padded) rows of "
                             f"an Engram table; use a size dividing {ENGRAM_ROW_ALIGN}")
        self.group, self.num_rows, self.width, self.fp8 = group, num_rows, width, fp8
        self.rows_per_rank = full // group.size
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, width, dtype=dtype))
        init_full, init_shard = table_init(num_rows, init_std)
        mark_param(self.weight, (full, width), [(0, group.rank, group.size)], init=init_full, init_shard=init_shard)

    @property
    def first_row(self) -> int:
        return self.group.rank * self.rows_per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.active:  # one fused gather (+ FP8) kernel on GPUs: kernels/engram.py
            return engram_rows(ids, self.weight, self.fp8)
        return self.quantize(distributed_lookup(ids, self.weight, self.group))

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Fetched rows as the model reads them (FP8 fake-quantised when ``fp8``)."""
        return fake_quant_rows(rows) if self.fp8 else rows

    def extra_repr(self) -> str:
        return (f"rows={self.num_rows} (padded {self.rows_per_rank * self.group.size}), width={self.width}, "
                f"engram_parallel={self.group.size}, fp8={self.fp8}")
