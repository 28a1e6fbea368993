"""Engram row gather + FP8 fake quantisation in Triton, forward and backward.

Oracle: :func:`megatron_s2.kernels.engram.engram_rows_reference` (``F.embedding`` followed by
:func:`megatron_s2.kernels.quantize.fake_quant_fp8`), bit for bit in the forward; the
backward equals the embedding backward (summation in token order, float32).

Forward: the ``N`` looked-up rows are cut into ``N * W / B`` scale blocks of ``B`` channels
(``W`` the row width, ``B`` the scale block, padded to a power of two ``BP`` with masks); a
program handles ``BLOCK_R`` blocks: it loads its rows' hash ids, reads the blocks straight
from the table, quantises them with the rounding helpers of :mod:`.quant` (E4M3 values, one
power-of-two scale per block, exactly the reference's arithmetic) and writes
``x + (deq - x)`` rounded like the reference's straight-through step in the table's dtype.

Backward: ids are sorted once (stable); ``grad_table[u] = sum of grad_out rows reading u``
is computed by one program per distinct id, accumulating float32 in token order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_s2.kernels.triton.quant import _ceil_pow2, _round_e4m3

__all__ = ["engram_rows_triton", "gather_quant_rows", "scatter_row_grads"]


@triton.jit
def _bf16_rne(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), still as float32. Done on
    the bits because the CPU interpreter's float32 -> bfloat16 cast truncates (checked),
    while GPUs and PyTorch round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gather_quant_kernel(IDS, W, OUT, R, W_STRIDE, WIDTH: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr,
                         NB: tl.constexpr, BLOCK_R: tl.constexpr, FP8: tl.constexpr, BF16: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # scale-block index = token * NB + block
    rm = r < R
    token = r // NB
    col0 = (r % NB) * BLOCK
    cols = tl.arange(0, BP)
    cm = rm[:, None] & (cols[None, :] < BLOCK)
    row = tl.load(IDS + token, mask=rm, other=0).to(tl.int64)
    x = tl.load(W + row[:, None] * W_STRIDE + col0[:, None] + cols[None, :], mask=cm, other=0.0)
    out_offs = token[:, None].to(tl.int64) * WIDTH + col0[:, None] + cols[None, :]
    if FP8:
        xf = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xf), 1), 1e-4)
        scale = _ceil_pow2(tl.div_rn(amax, 448.0))
        v = tl.div_rn(xf, scale[:, None])
        neg = (v.to(tl.int32, bitcast=True) >> 31) != 0
        mag = _round_e4m3(tl.minimum(tl.abs(v), 448.0))
        deq = tl.where(neg, -mag, mag) * scale[:, None]
        if BF16:  # the reference's straight-through step in bfloat16: each op rounded to bfloat16
            deq = _bf16_rne(deq)
            diff = _bf16_rne(deq - xf)
            y = _bf16_rne(xf + diff).to(tl.bfloat16)
        else:
            y = (xf + (deq - xf)).to(OUT.dtype.element_ty)
        tl.store(OUT + out_offs, y, mask=cm)
    else:
        tl.store(OUT + out_offs, x, mask=cm)


@triton.jit
def _segment_sum_kernel(GRAD, ORDER, STARTS, COUNTS, UNIQ, GW, GW_STRIDE, WIDTH: tl.constexpr, WP: tl.constexpr,
                        BF16: tl.constexpr):
    u = tl.program_id(0)
    start = tl.load(STARTS + u)
    count = tl.load(COUNTS + u)
    cols = tl.arange(0, WP)
    cm = cols < WIDTH
    acc = tl.zeros([WP], dtype=tl.float32)
    for i in range(0, count):  # token order within the row (stable sort): deterministic
        tok = tl.load(ORDER + start + i).to(tl.int64)
        acc += tl.load(GRAD + tok * WIDTH + cols, mask=cm, other=0.0).to(tl.float32)
    row = tl.load(UNIQ + u).to(tl.int64)
    if BF16:
        acc = _bf16_rne(acc)
    tl.store(GW + row * GW_STRIDE + cols, acc.to(GW.dtype.element_ty), mask=cm)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def gather_quant_rows(ids: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """``weight[ids]`` ``[N, W]`` (``ids`` flat), FP8 fake-quantised with one scale per
    ``block`` channels when ``block > 0`` (forward values of the straight-through estimator)."""
    n, width = ids.numel(), weight.size(1)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(n, width, dtype=weight.dtype, device=weight.device)
    if block and (width % block or weight.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"Engram FP8 rows: width {width} is not a multiple of the scale block {block} "
                         f"or dtype {weight.dtype} is not float32/bfloat16")
    blk = block or min(width, 128)
    while width % blk:
        blk //= 2
    nb = width // blk
    r = n * nb
    block_r = max(1, min(64, 4096 // _pow2(blk)))
    if r:
        _gather_quant_kernel[(triton.cdiv(r, block_r),)](
            ids.contiguous(), weight, out, r, weight.stride(0), WIDTH=width, BLOCK=blk, BP=_pow2(blk), NB=nb,
            BLOCK_R=block_r, FP8=bool(block), BF16=weight.dtype == torch.bfloat16)
    return out


def scatter_row_grads(ids: torch.Tensor, grad: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``grad_table[u] = sum_{t: ids[t] = u} grad[t]`` ``[num_rows, W]`` (float32 sums in token
    order, stored in ``grad``'s dtype)."""
    width = grad.size(1)
    gw = torch.zeros(num_rows, width, dtype=grad.dtype, device=grad.device)
    if ids.numel() == 0:
        return gw
    sorted_ids, order = torch.sort(ids, stable=True)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    _segment_sum_kernel[(uniq.numel(),)](grad.contiguous(), order, starts, counts, uniq, gw, gw.stride(0),
                                         WIDTH=width, WP=_pow2(width), BF16=grad.dtype == torch.bfloat16)
    return gw


class _EngramRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, block: int):
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.size(0)
        return gather_quant_rows(ids, weight.detach(), block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        return None, scatter_row_grads(ids, grad, ctx.num_rows), None


def engram_rows_triton(ids: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """Rows ``[*ids.shape, W]``: gather (+ FP8 with scale block ``block``; 0 = none), autograd-aware."""
    flat = ids.reshape(-1).to(torch.int64)
    return _EngramRows.apply(flat, weight, int(block)).view(*ids.shape, weight.size(1))
