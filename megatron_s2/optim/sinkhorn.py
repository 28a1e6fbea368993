"""Sinkhorn-balanced momentum update for embeddings, prediction head and Engram tables
(report §2.5, Eq. 7; hyper-parameters §4.2.2: K = 11, tau = 1e-3, eps = 1e-20, gamma = 0.18).

The update follows Muon's workflow with Sinkhorn balancing in place of Newton-Schulz. For a
table W of m rows (token / n-gram ids) and n hidden columns, with Nesterov momentum update
G^ (:mod:`.momentum`), Eq. 7 asks for diagonal D_r, D_c with

    Delta = sqrt(n) * U^(K) = sqrt(n) * D_r G^ D_c,
    (1/n) sum_j Delta_ij^2 ~= 1  (row RMS),      (1/m) sum_i Delta_ij^2 ~= 1  (column RMS),

and the parameter moves by W <- W - gamma * eta * Delta, without weight decay.

The report's Algorithm 1 is not in our copy; this is our reconstruction from Eq. 7 and §2.5:

1. Row mask: rho_i = ||G^_i||_2; rows with rho_i <= tau * mean_i(rho_i) (mean over all m rows)
   are masked: their update is exactly zero and they take no part in the column statistics.
   ``m_active`` counts the unmasked rows.
2. U^(0) = G^ with masked rows zeroed. Steps k = 1..K alternate, starting with a row step:
   odd k:  every row is scaled to unit l2 norm,            U_i  <- U_i  / (||U_i||  + eps);
   even k: every column is scaled to l2 norm sqrt(m_active / n),
                                                          U_:j <- U_:j * sqrt(m_active / n) / (||U_:j|| + eps).
   With K = 11 the last step is a row step, so unmasked rows of U^(K) have unit l2 norm
   exactly ("the factor sqrt(n) converts unit row l2 norm into unit row-wise RMS") and the
   column condition holds approximately, with the RMS taken over the m_active unmasked rows
   (Eq. 7 writes 1/m; with masked rows contributing zeros, only 1/m_active is attainable).
3. Delta = sqrt(n) * U^(K).

Balancing is invariant to the scale of G^, so G^ is first divided by its largest magnitude,
which keeps the squared entries of tiny gradients inside float32's range. Leading dimensions
beyond the last two are independent tables. For row-partitioned tables (vocabulary- or
engram-parallel), pass ``process_group``: the mean row norm, the active-row count and the
column norms are then reduced over the group, so every rank computes its rows of the global
Delta.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_s2.optim.momentum import nesterov_momentum_

__all__ = ["sinkhorn_balance", "sinkhorn_update", "SinkhornMomentum"]


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


@torch.no_grad()
def sinkhorn_balance(
    update: torch.Tensor,
    iters: int = 11,
    tau: float = 1e-3,
    eps: float = 1e-20,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Balanced update Delta (float32, shape of ``update`` = ``(..., m_rows, n_cols)``) of Eq. 7."""
    if update.ndim < 2:
        raise ValueError(f"Sinkhorn balancing needs (..., rows, cols) tables, got shape {tuple(update.shape)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    rows, cols = update.shape[-2], update.shape[-1]
    table = update.to(torch.float32, copy=True)

    largest = torch.linalg.vector_norm(table, float("inf"), dim=(-2, -1), keepdim=True)  # no |G| temporary
    scale = _all_reduce(largest, process_group, dist.ReduceOp.MAX)
    table.div_(torch.where(scale > 0, scale, torch.ones_like(scale)))

    row_norm = torch.linalg.vector_norm(table, dim=-1)  # rho_i, (..., m)
    totals = torch.stack([row_norm.sum(-1), torch.full_like(row_norm[..., 0], rows)], dim=-1)
    _all_reduce(totals, process_group)
    mean_row_norm = totals[..., 0] / totals[..., 1]
    active = row_norm > tau * mean_row_norm.unsqueeze(-1)
    table.mul_(active.unsqueeze(-1))
    active_rows = _all_reduce(active.sum(-1, dtype=torch.float32), process_group)
    column_target = torch.sqrt(active_rows / cols).unsqueeze(-1)  # (..., 1)

    for step in range(iters):
        if step % 2 == 0:
            table.div_(torch.linalg.vector_norm(table, dim=-1, keepdim=True) + eps)
        else:
            column_sq = torch.linalg.vector_norm(table, dim=-2).square()
            column_norm = _all_reduce(column_sq, process_group).sqrt()
            table.mul_((column_target / (column_norm + eps)).unsqueeze(-2))
    return table.mul_(math.sqrt(cols))


@torch.no_grad()
def sinkhorn_update(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    iters: int = 11,
    tau: float = 1e-3,
    eps: float = 1e-20,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Advance ``momentum_buffer`` with ``grad`` and return Delta (the caller applies -gamma * lr)."""
    update = nesterov_momentum_(momentum_buffer, grad, momentum, nesterov)
    delta = sinkhorn_balance(update, iters=iters, tau=tau, eps=eps, process_group=process_group)
    return delta.to(momentum_buffer.dtype)


class SinkhornMomentum(torch.optim.Optimizer):
    """Nesterov momentum + Sinkhorn balancing, W <- W - lr_scale * lr * Delta; no weight decay.

    ``row_groups`` maps a parameter holding a row shard of a larger table to the process group
    over which its rows are partitioned (kept outside the param groups so that the state dict
    stays plain data).
    """

    def __init__(
        self,
        params,
        lr: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        lr_scale: float = 0.18,
        iters: int = 11,
        tau: float = 1e-3,
        eps: float = 1e-20,
        row_groups: Mapping[torch.Tensor, dist.ProcessGroup | None] | None = None,
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or lr_scale <= 0 or iters < 1 or not 0 <= tau < 1 or eps <= 0:
            raise ValueError(f"invalid Sinkhorn hyper-parameters: lr={lr}, momentum={momentum}, "
                             f"lr_scale={lr_scale}, iters={iters}, tau={tau}, eps={eps}")
        defaults = dict(lr=lr, lr_mult=1.0, momentum=momentum, nesterov=nesterov, lr_scale=lr_scale,
                        iters=iters, tau=tau, eps=eps)
        super().__init__(params, defaults)
        self.row_groups = dict(row_groups or {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("SinkhornMomentum needs dense gradients; build the embedding with sparse=False")
                state = self.state[param]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                delta = sinkhorn_update(
                    param.grad, state["momentum_buffer"], momentum=group["momentum"], nesterov=group["nesterov"],
                    iters=group["iters"], tau=group["tau"], eps=group["eps"],
                    process_group=self.row_groups.get(param),
                )
                param.add_(delta.to(param.dtype), alpha=-group["lr_scale"] * group["lr"])
        return loss
