"""Engram row lookup: gather table rows by hash id and fake-quantise them to FP8 (report §2.4.2,
§3.1.3 "stored and fetched in FP8") — the PyTorch reference and the dispatch to Triton.

The Engram module (:mod:`megatron_s2.models.v41.engram.module`) reads, for every token, the
rows ``[T, head_dim]`` of its ``T`` = orders x heads hashed N-grams, fake-quantised to E4M3
with one power-of-two scale per 32 channels (the table's storage format), and feeds their
*concatenation* ``[T * head_dim]`` to ``linear_kv``. Which fused operation saves traffic:

* **gather + dequantise + straight-through step** (what this kernel does). The reference
  materialises the gathered rows, then the quantiser's float copy, ``b / scale``, the clamp,
  the FP8 cast and back, ``q * scale``, the cast to the table dtype, ``deq - x`` and
  ``x + (deq - x)`` — about ten passes over ``[tokens, T, head_dim]``. The kernel reads each
  addressed row once from the table and writes the quantised row once.
* **not a sum over heads**: the heads' rows meet different column blocks of ``linear_kv``'s
  weight (``kv = sum_t W_t r_t``), so summing rows before the GEMM would change the model;
  the sum over heads *is* that GEMM. (The original Engram's multi-head embedding sums
  nothing either.)

Backward (the table is trained, Sinkhorn update): the quantiser is straight-through, so the
gradient of a table row is the sum of the output gradients of the tokens that read it —
the embedding backward. The Triton backward sorts the ids once (stable, so each row's
contributions are summed in token order) and one program sums each addressed row's
gradients in float32 and writes the row: deterministic, no atomics, no ``[N, width]``
float32 temporary.

Engram-parallel tables (rows partitioned over ``parallel.engram_parallel``) keep their
all-to-all lookup (:func:`megatron_s2.models.v41.engram.table.distributed_lookup`) and the
separate quantiser; this fused path serves the unpartitioned table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_s2.kernels.dispatch import use_triton
from megatron_s2.kernels.quantize import fake_quant_reference

__all__ = ["FP8_ROW_BLOCK", "fp8_row_block", "engram_rows_reference", "engram_rows"]

FP8_ROW_BLOCK = 32
"""Channels sharing one power-of-two scale in FP8 table rows."""


def fp8_row_block(width: int) -> int:
    """Scale block of a ``width``-channel row: 32, or the whole row when 32 does not divide it."""
    return FP8_ROW_BLOCK if width % FP8_ROW_BLOCK == 0 else width


def engram_rows_reference(ids: torch.Tensor, weight: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Rows ``weight[ids]`` ``[*ids.shape, width]``, FP8 fake-quantised (straight-through) when
    ``fp8``: the oracle of the Triton kernel."""
    rows = F.embedding(ids, weight)
    return fake_quant_reference(rows, "fp8", fp8_row_block(weight.size(1))) if fp8 else rows


def engram_rows(ids: torch.Tensor, weight: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Dispatch: the fused Triton gather (+ FP8) on CUDA tensors when Triton imports, else the
    reference (:mod:`megatron_s2.kernels.dispatch`)."""
    if not use_triton(ids, weight):
        return engram_rows_reference(ids, weight, fp8)
    from megatron_s2.kernels.triton.engram import engram_rows_triton

    return engram_rows_triton(ids, weight, fp8_row_block(weight.size(1)) if fp8 else 0)
