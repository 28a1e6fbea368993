"""Manifold-constrained hyper-connections with Single-Pass mixing (report §2.4.1, Eq. 2-6).

Every token carries ``n = hc_mult`` residual streams ``X in R^{n x d}``. Each sublayer
(attention and MoE alike) owns a coefficient predictor H (Eq. 4) that maps the streams to

* ``pre``  (A, 1 x n): input mixing ``y = sum_i pre_i X_i`` ("collapse", Eq. 5),
* ``post`` (C, n x 1): how much of the sublayer output F goes to each stream,
* ``comb`` (B, n x n): residual mixing, projected onto the doubly stochastic matrices by
  Sinkhorn-Knopp,

and the streams are updated as ``X'_j = post_j F + sum_i comb[i, j] X_i`` ("expand", Eq. 3).
Single-Pass mHC (Eq. 6) shifts the input mixing by one sublayer: sublayer l collapses its
input with the ``pre`` predicted by sublayer l-1, so the coefficients of X_l no longer gate
the computation on X_l. The first sublayer of the model uses a one-hot ``pre`` on stream 0,
and the model's final collapse uses the last sublayer's ``pre`` (wired in ``block.py`` / ``model.py``).

Predictor semantics follow the public DeepSeek-V4.1-Flash inference code (so released
weights import unchanged): the normalisation weight is folded into ``fn``, one RMS statistic
per token over all ``n*d`` values is applied *after* the projection (§2.4.1, "the RMS division
is applied after the projection"), then ``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``,
``comb = sinkhorn(softmax(.))``. Everything here runs in float32 (precision map); collapse
and expand return the dtype of the streams.

Training initialisation (the reference only loads weights; this follows the mHC paper and
Megatron-core's ``HyperConnectionModule``: small gating factors so that training starts from
the static part of the mapping, with that static part chosen to reproduce a pre-norm residual
network at step 0):

* ``fn ~ N(0, init_std)`` -- the dynamic, token-dependent part of the logits;
* ``scale = 0.01`` for all three groups (the mHC paper's gating factor alpha), so the
  dynamic part starts at ~1 % of the logits and grows only as training finds it useful;
* ``base``: ``pre`` logits ``logit(1/n)`` (pre = 1/n: collapse averages the streams),
  ``post`` logits 0 (post = 1: each stream receives the full sublayer output), ``comb``
  logits ``log(9 (n - 1))`` on the diagonal and 0 elsewhere (softmax rows 0.9 / 0.1/(n-1),
  already doubly stochastic: comb starts near the identity, yet off-diagonal mixing keeps a
  non-vanishing softmax gradient). With the embedding repeated on all streams every stream
  holds ``x + F(x)`` after the first sublayer, i.e. the network starts as a standard
  pre-norm residual stack.

Under sequence parallelism the streams are sequence-sharded, the predictor is token-local
and needs no communication; the parallel plan marks its parameters tp-partial under SP, so
the gradient finaliser all-reduces their partial gradients over tensor parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatron_s2.kernels.precision import cast
from megatron_s2.kernels.sinkhorn import sinkhorn, sinkhorn_reference as _sinkhorn
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.init import constant_init, normal_init
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.placement import mark_param

__all__ = [
    "HyperConnection",
    "collapse",
    "expand",
    "expand_embedding",
    "one_hot_pre",
    "sinkhorn_knopp",
    "split_coefficients",
]

SCALE_INIT = 0.01
"""Initial gating factor of the dynamic part of the pre / post / comb logits."""
COMB_DIAG_INIT = 0.9
"""Initial diagonal of each row of softmax(comb logits)."""


def _wide(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in float32, or float64 if any of them is (gradcheck)."""
    dt = torch.float64 if any(t.dtype is torch.float64 for t in ts) else torch.float32
    return [cast(t, dt) for t in ts]


class _SinkhornKnopp(torch.autograd.Function):
    """Sinkhorn-Knopp that stores only its input and re-runs the iterations in backward.

    Plain autograd through ``iters`` rounds keeps about ``2 iters n^2`` floats per token and
    sublayer alive until backward (640 at n = 4, 20 iterations); recomputing them costs a few
    n x n operations per token.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return sinkhorn(logits, iters, eps)  # the fused kernel where one runs; backward differentiates the reference

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(_sinkhorn(x, ctx.iters, ctx.eps), x, grad)
        return g, None, None


def sinkhorn_knopp(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``[..., n, n]`` logits towards the doubly stochastic matrices.

    Row softmax + eps, a column normalisation, then ``iters - 1`` rounds of row and column
    normalisation (each dividing by the sum + eps). The last step normalises columns, so
    column sums are 1 up to eps and row sums converge with ``iters``.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn_knopp: iters must be >= 1, got {iters}")
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return sinkhorn(logits, iters, eps)  # inference: no autograd.Function overhead per sublayer
    return _SinkhornKnopp.apply(logits, iters, eps)


def split_coefficients(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
                       iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[..., (2+n)n]`` raw mixes -> ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]``."""
    # all (2+n)n logits in one multiply-add, each group's scale repeated over its logits: the
    # same products and sums as group by group (same bits), 11 operators per sublayer, not 20
    logits = mixes * scale[_group_index(n, scale.device)] + base
    pre = torch.sigmoid(logits[..., :n]) + eps
    post = 2.0 * torch.sigmoid(logits[..., n:2 * n])
    return pre, post, sinkhorn_knopp(logits[..., 2 * n:].unflatten(-1, (n, n)), iters, eps)


_GROUP_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}


def _group_index(n: int, device: torch.device) -> torch.Tensor:
    """``[(2+n)n]``: which of the three scales (pre, post, comb) each logit takes."""
    idx = _GROUP_INDEX.get((n, device))
    if idx is None:
        idx = _GROUP_INDEX[(n, device)] = torch.tensor([0] * n + [1] * n + [2] * (n * n), device=device)
    return idx


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Input mixing (Eq. 5): ``[b, s, n, d]`` streams, ``[b, s, n]`` pre -> ``[b, s, d]``."""
    xw, pw = _wide(x, pre)
    y = torch.matmul(pw.unsqueeze(-2), xw).squeeze(-2)  # [b, s, 1, n] @ [b, s, n, d]
    return cast(y, x.dtype)


def expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Residual update (Eq. 3): ``X'_j = post_j F + sum_i comb[i, j] X_i``.

    ``f [b, s, d]``, ``x [b, s, n, d]``, ``post [b, s, n]``, ``comb [b, s, n, n]`` -> ``[b, s, n, d]``.
    """
    fw, xw, pw, cw = _wide(f, x, post, comb)
    out = torch.matmul(cw.transpose(-1, -2), xw).addcmul_(pw.unsqueeze(-1), fw.unsqueeze(-2))
    return cast(out, x.dtype)


def expand_embedding(h: torch.Tensor, n: int) -> torch.Tensor:
    """The embedding ``[b, s, d]`` repeated on all ``n`` streams -> ``[b, s, n, d]``."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def one_hot_pre(x: torch.Tensor) -> torch.Tensor:
    """Input mixing of the model's first sublayer under Single-Pass mHC: stream 0 only."""
    pre = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    pre[..., 0] = 1.0
    return pre


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _base_init(n: int) -> Callable[[torch.Tensor, torch.Generator], None]:
    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        t.zero_()
        t[:n] = _logit(min(1.0 / n, 1.0 - 1e-3))  # pre = 1/n (n = 1: 0.999, no finite logit of 1)
        comb = t[2 * n:].view(n, n)
        if n > 1:
            comb.fill_diagonal_(math.log(COMB_DIAG_INIT / (1.0 - COMB_DIAG_INIT) * (n - 1)))
    return fn


class HyperConnection(nn.Module):
    """The coefficient predictor H of one sublayer (Eq. 4) and its mixing operations.

    Parameters (float32, names as in the reference): ``fn [(2+n)n, n d]``, ``base [(2+n)n]``,
    ``scale [3]``. They are allocated uninitialised; ``initialize_parameters`` fills them
    from their ``init_fn`` (module docstring).
    """

    PLAN_SECTION = "mhc"

    def __init__(self, config: V41Config, groups: ParallelGroups | None = None):
        super().__init__()
        groups = groups or ParallelGroups.single()
        n, d = config.hc_mult, config.hidden_size
        self.n, self.hidden_size = n, d
        self.iters, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.norm_eps
        mix = config.mhc_mix_dim
        self.fn = nn.Parameter(torch.empty(mix, n * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        mark_param(self.fn, (mix, n * d), init=normal_init(config.init_std))
        mark_param(self.base, (mix,), init=_base_init(n))
        mark_param(self.scale, (3,), init=constant_init(SCALE_INIT))
        apply_plan(self, groups, config)

    def mixes(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, n, d]`` -> raw ``[b, s, (2+n)n]``: projection, then one RMS per token."""
        xf, fn = _wide(x, self.fn)
        xf = xf.flatten(-2)
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.norm_eps)
        return (xf @ fn.t()) * r

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [b,s,n], post [b,s,n], comb [b,s,n,n])`` of the streams ``x [b,s,n,d]``."""
        return split_coefficients(self.mixes(x), self.scale, self.base, self.n, self.iters, self.eps)

    collapse = staticmethod(collapse)
    expand = staticmethod(expand)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor],
                pre_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``sublayer`` on the collapsed streams and update them.

        ``pre_in``: the input mixing to use -- the previous sublayer's ``pre`` under
        Single-Pass mHC (Eq. 6), ``None`` for classic mHC (Eq. 2: this sublayer's own ``pre``).
        Returns the new streams and this sublayer's ``pre``.
        """
        pre, post, comb = self.coefficients(x)
        f = sublayer(collapse(x, pre if pre_in is None else pre_in))
        return expand(f, x, post, comb), pre
