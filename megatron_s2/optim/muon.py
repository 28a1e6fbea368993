"""Muon and head-wise Muon (report §2.5, §4.2.2).

One Muon step for a weight matrix W with gradient G (§4.2.2: mu = 0.95, wd = 0.1, RMS 0.18):

    G^  = Nesterov momentum of G                              (see :mod:`.momentum`)
    O   = NewtonSchulz(G^)                                     (~ polar factor U V^T)
    D   = update_rms * sqrt(max(rows, cols)) * O               (RMS matching)
    W  <- W * (1 - lr * wd) - lr * D                           (decoupled weight decay)

An exactly orthogonal rows x cols matrix has RMS 1 / sqrt(max(rows, cols)), so D has RMS
``update_rms`` (0.18) and the AdamW learning rate can be reused (Moonlight-style matching).
The default five Muon Newton-Schulz steps leave singular values in [0.68, 1.14] rather than at
one, so D's RMS is 0.18 * sqrt(mean s^2), typically 0.15-0.16; ``ns_polish_steps = 2`` makes
it 0.18 to within 0.1 % (see :mod:`.newton_schulz`).

Tensor layouts (:func:`as_matrix_batch`):

* 2-D ``[out, in]``: one matrix.
* 3-D ``[batch, out, in]`` (e.g. grouped MoE experts ``[num_experts, out, in]``): a batch of
  independent matrices, each orthogonalised and RMS-matched on its own.
* >= 4-D (e.g. convolution filters ``[out, in, kh, kw]``): one matrix ``[out, in * kh * kw]``.

**Head-wise Muon** (§2.5): a Query (or Key) projection stacks ``head_split`` heads along its
output rows, ``[heads * head_dim, in]``. Vanilla Muon uses one preconditioner for all heads;
head-wise Muon splits the rows into ``head_split`` blocks of ``head_dim`` rows and treats each
as its own matrix, so each head gets its own orthogonalisation and RMS factor
``update_rms * sqrt(max(head_dim, in))``. ``head_split = 1`` is vanilla Muon.

:func:`muon_update` is a pure function of (gradient, momentum buffer, hyper-parameters) so the
distributed runtime can call it on gathered or head-aligned sharded matrices.
"""

from __future__ import annotations

import math

import torch

from megatron_s2.optim.momentum import nesterov_momentum_
from megatron_s2.optim.newton_schulz import MUON_QUINTIC_COEFFICIENTS, newton_schulz

__all__ = ["NS_DTYPES", "as_matrix_batch", "muon_update", "orthogonalize", "Muon"]

NS_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def as_matrix_batch(tensor: torch.Tensor, head_split: int = 1) -> torch.Tensor:
    """View ``tensor`` as ``(num_matrices, rows, cols)``, splitting rows into ``head_split`` blocks."""
    if tensor.ndim < 2:
        raise ValueError(f"Muon updates matrices; got a tensor of shape {tuple(tensor.shape)}")
    if tensor.ndim == 2:
        batch = tensor.unsqueeze(0)
    elif tensor.ndim == 3:
        batch = tensor
    else:
        batch = tensor.reshape(1, tensor.shape[0], -1)
    count, rows, cols = batch.shape
    if head_split < 1 or rows % head_split:
        raise ValueError(f"cannot split {rows} rows into head_split={head_split} equal head blocks")
    return batch.reshape(count * head_split, rows // head_split, cols)


@torch.no_grad()
def muon_update(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    update_rms: float = 0.18,
    head_split: int = 1,
    ns_dtype: torch.dtype = torch.float32,
    ns_coefficients: tuple[float, float, float] = MUON_QUINTIC_COEFFICIENTS,
    ns_polish_steps: int = 0,
) -> torch.Tensor:
    """Advance ``momentum_buffer`` with ``grad`` and return the RMS-matched Muon update D.

    The update has ``grad``'s shape and the buffer's dtype; the caller applies
    ``W <- W * (1 - lr * wd) - lr * D``.
    """
    update = nesterov_momentum_(momentum_buffer, grad, momentum, nesterov)
    return orthogonalize(update, ns_steps=ns_steps, update_rms=update_rms, head_split=head_split, ns_dtype=ns_dtype,
                         ns_coefficients=ns_coefficients, ns_polish_steps=ns_polish_steps).to(momentum_buffer.dtype)


@torch.no_grad()
def orthogonalize(update: torch.Tensor, *, ns_steps: int = 5, update_rms: float = 0.18, head_split: int = 1,
                  ns_dtype: torch.dtype = torch.float32,
                  ns_coefficients: tuple[float, float, float] = MUON_QUINTIC_COEFFICIENTS,
                  ns_polish_steps: int = 0) -> torch.Tensor:
    """Newton-Schulz orthogonalisation + RMS matching of a momentum update (same shape)."""
    blocks = as_matrix_batch(update, head_split)
    orthogonal = newton_schulz(blocks, ns_steps, ns_coefficients, ns_polish_steps, compute_dtype=ns_dtype)
    scale = update_rms * math.sqrt(max(blocks.shape[-2], blocks.shape[-1]))
    return (orthogonal * scale).reshape(update.shape)


def _gather_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum, decoupled weight decay and update-RMS matching.

    Every param group may set ``head_split`` (default 1 = vanilla Muon); head-wise groups
    split each parameter's rows into that many per-head blocks. ``lr`` is the effective
    learning rate of the group (the hybrid optimiser writes ``base_lr * lr_mult``).
    """

    def __init__(
        self,
        params,
        lr: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        update_rms: float = 0.18,
        ns_steps: int = 5,
        ns_dtype: str = "float32",
        ns_polish_steps: int = 0,
        head_split: int = 1,
        matrix_shards: dict | None = None,
    ) -> None:
        """``matrix_shards`` maps a parameter whose shard cuts its matrix (tensor / expert
        tensor parallelism) to ``(group, dim)``: its momentum update is all-gathered over
        ``group`` along ``dim``, orthogonalised whole on every rank of the group, and each rank
        keeps its slice. This costs one all-gather of the matrix per step and a redundant
        Newton-Schulz on each rank of the group; momentum stays sharded."""
        self.matrix_shards = dict(matrix_shards or {})
        if (lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or update_rms <= 0 or ns_steps < 1
                or ns_polish_steps < 0):
            raise ValueError(f"invalid Muon hyper-parameters: lr={lr}, weight_decay={weight_decay}, "
                             f"momentum={momentum}, update_rms={update_rms}, ns_steps={ns_steps}, "
                             f"ns_polish_steps={ns_polish_steps}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {list(NS_DTYPES)}, got {ns_dtype!r}")
        defaults = dict(lr=lr, lr_mult=1.0, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        update_rms=update_rms, ns_steps=ns_steps, ns_dtype=ns_dtype, ns_polish_steps=ns_polish_steps,
                        head_split=head_split)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                update = nesterov_momentum_(state["momentum_buffer"], param.grad, group["momentum"], group["nesterov"])
                shard = self.matrix_shards.get(param)
                if shard is not None:
                    tp_group, dim = shard
                    update = _gather_dim(update, tp_group, dim)
                update = orthogonalize(update, ns_steps=group["ns_steps"], update_rms=group["update_rms"],
                                       head_split=group["head_split"], ns_dtype=NS_DTYPES[group["ns_dtype"]],
                                       ns_polish_steps=group["ns_polish_steps"])
                if shard is not None:
                    update = update.chunk(tp_group.size, dim=dim)[tp_group.rank]
                if decay:
                    param.mul_(1.0 - lr * decay)
                param.add_(update.to(param.dtype), alpha=-lr)
        return loss
