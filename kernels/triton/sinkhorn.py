"""mHC's Sinkhorn-Knopp iterations in one Triton program per block of matrices (report §2.4.1,
Eq. 4). Oracle: :func:`megatron_s2.kernels.sinkhorn.sinkhorn_reference` (equal to float32
rounding: the sums are taken in the program's order, not the matmul's).

The row softmax stays one PyTorch operator (its bits are the reference's); the program adds
eps, normalises the columns, then runs ``iters - 1`` rounds of rows and columns on its
``BLOCK_M`` matrices held in registers, dividing with ``tl.div_rn`` (IEEE round-to-nearest, as
PyTorch divides; Triton's ``/`` on float32 is the approximate division on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sinkhorn_triton"]


@triton.jit
def _sinkhorn_kernel(m_ptr, out_ptr, count, iters, eps, N: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    mats = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    offs = mats[:, None, None] * (N * N) + rows[None, :, None] * N + cols[None, None, :]
    mask = (mats[:, None, None] < count) & (rows[None, :, None] < N) & (cols[None, None, :] < N)
    # padding (rows / columns past n, matrices past count) holds 0: it adds nothing to any sum
    m = tl.where(mask, tl.load(m_ptr + offs, mask=mask, other=0.0) + eps, 0.0)
    m = tl.div_rn(m, tl.sum(m, axis=1)[:, None, :] + eps)          # columns
    for _ in range(iters - 1):
        m = tl.div_rn(m, tl.sum(m, axis=2)[:, :, None] + eps)      # rows
        m = tl.div_rn(m, tl.sum(m, axis=1)[:, None, :] + eps)      # columns
    tl.store(out_ptr + offs, m, mask=mask)


def sinkhorn_triton(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` float32 logits -> the projected matrices (forward only)."""
    shape, n = logits.shape, logits.size(-1)
    soft = logits.reshape(-1, n, n).softmax(-1).contiguous()
    out = torch.empty_like(soft)
    count = soft.size(0)
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, 1024 // (block_n * block_n)))  # about 1,024 values per program
    if count:
        _sinkhorn_kernel[(triton.cdiv(count, block_m),)](soft, out, count, iters, eps, N=n, BLOCK_N=block_n,
                                                        BLOCK_M=block_m)
    return out.reshape(shape)
