"""Sinkhorn-Knopp projection of mHC's residual-mixing logits (report §2.4.1, Eq. 4: ``comb =
sinkhorn(softmax(.))``) — the PyTorch reference and the dispatch to Triton.

Every sublayer of the backbone projects its ``n x n`` logits (n = ``hc_mult``, 4) per token
towards the doubly stochastic matrices: row softmax + eps, one column normalisation, then
``iters - 1`` rounds of row and column normalisation, each dividing by the sum + eps. The
matrices are tiny, so the cost is per operator, not per flop: the reference spends two
operators per normalisation (the sums as one batched matmul against ones, then the division),
``2 (2 iters - 1)`` = 78 per sublayer at 20 iterations, 1,872 of a decode step's operators on
``small`` — launches that dominate a GPU decode step. The Triton kernel
(:mod:`megatron_s2.kernels.triton.sinkhorn`) runs every normalisation of a block of matrices
in one program: the softmax (one operator, so its bits are PyTorch's) and one launch per
sublayer. The sums are taken in another order than the matmul's, so the results equal the
reference's to float32 rounding (``tests/kernels/test_triton_sinkhorn.py``).
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.dispatch import use_triton

__all__ = ["sinkhorn", "sinkhorn_reference"]

_OPERANDS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_OPERANDS_ENTRIES = 16


def _operands(batch: int, n: int, eps: float, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The constant operands of the sums (eps ``[1,1,1]``, ones ``[B,n,1]`` and ``[B,1,n]``),
    built once per shape: 5 operators per sublayer otherwise (120 per decode step of ``small``).
    Constants without autograd history, so sharing them across calls is safe; a few shapes only
    (decode batches and prefill chunks), the oldest dropped first."""
    key = (batch, n, eps, dtype, device)
    hit = _OPERANDS.get(key)
    if hit is None:
        ones = torch.ones(1, n, 1, dtype=dtype, device=device)
        hit = (torch.full((1, 1, 1), eps, dtype=dtype, device=device), ones.expand(batch, n, 1),
               ones.view(1, 1, n).expand(batch, 1, n))
        if len(_OPERANDS) >= _OPERANDS_ENTRIES:
            _OPERANDS.pop(next(iter(_OPERANDS)))
        _OPERANDS[key] = hit
    return hit


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` logits -> the projected matrices (the semantics; differentiable)."""
    # Each normalisation is two operators: the sums + eps as one batched matmul against ones
    # (baddbmm), then the division.
    shape, n = logits.shape, logits.size(-1)
    m = logits.reshape(-1, n, n).softmax(-1) + eps
    e, ones_col, ones_row = _operands(m.size(0), n, eps, m.dtype, m.device)
    m = m / torch.baddbmm(e, ones_row, m)  # columns
    for _ in range(iters - 1):
        m = m / torch.baddbmm(e, m, ones_col)  # rows
        m = m / torch.baddbmm(e, ones_row, m)  # columns
    return m.reshape(shape)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Dispatch (no autograd through the kernel: the caller's backward recomputes with the
    reference): the Triton kernel on float32 CUDA tensors when Triton imports, else the reference."""
    if logits.dtype is torch.float32 and use_triton(logits):
        from megatron_s2.kernels.triton.sinkhorn import sinkhorn_triton

        return sinkhorn_triton(logits, iters, eps)
    return sinkhorn_reference(logits, iters, eps)
