"""Fine-grained FP8 GEMMs, DeepSeek-V3 style, on ``torch._scaled_mm`` (no Transformer Engine).

Quantisation (E4M3, scale = amax / 448 per tile, float32 scales):

* activations and output gradients: **1 x B tiles** along the contraction dimension
  (B = ``block``, 128 in the recipe);
* weights: **B x B blocks** — the same blocks serve the forward GEMM and, transposed, the
  input-gradient GEMM.

The three GEMMs of ``y = x W^T`` (x ``[M, K]``, W ``[N, K]``)::

    forward  y  = x  W^T     x: 1xB tiles along K      W: BxB blocks
    dgrad    dx = dy W       dy: 1xB tiles along N     W^T: the same BxB blocks, transposed
    wgrad    dW = dy^T x     dy^T, x^T: 1xB tiles along M (tokens), i.e. Bx1 tiles of dy and x

(M is zero-padded to a multiple of B for wgrad; zero rows add nothing.) Every product of
FP8 values is accumulated in float32 per B-wide slice of the contraction and the slices are
summed in float32 — the "promotion to CUDA cores every 128 elements" of DeepSeek-V3.

**How it runs.** ``torch._scaled_mm`` in the pinned torch accepts tensor-wise and row-wise
scales on CPU but not block-wise ones (checked: "Invalid scaling configuration"), so the
tile-scaled GEMM is computed as one row-wise-scaled ``_scaled_mm`` per B-wide slice of the
contraction: for slice ``k`` the A scale is the column ``s_a[:, k]`` ([M, 1]) and the B scale
the row ``s_b[:, k]`` ([1, N], a weight block's scale repeated over its B rows). This is the
same arithmetic as a block-scaled GEMM (each slice is a plain FP8 dot product times two
scales). On CUDA, :func:`blockwise_mm` first tries the one-call block-scaled
``torch.nn.functional.scaled_mm`` (``BlockWise1x128`` / ``BlockWise128x128``); the first call
per (device, scaling pair) checks it against the per-slice path and falls back to the
per-slice path if it raises or disagrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["E4M3_MAX", "quantize_tiles", "quantize_blocks", "dequantize_tiles", "dequantize_blocks",
           "blockwise_mm", "fp8_linear", "fp8_shape_supported"]

E4M3_MAX = 448.0
_EPS = 1e-12


def quantize_tiles(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (E4M3 [M, K], float32 scales [M, K / block]): one scale per 1 x block tile."""
    m, k = x.shape
    t = x.detach().float().view(m, k // block, block)
    scale = (t.abs().amax(-1) / E4M3_MAX).clamp_min(_EPS)
    q = (t / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (E4M3 [N, K], float32 scales [N / block, K / block]): one per block x block."""
    n, k = w.shape
    t = w.detach().float().view(n // block, block, k // block, block)
    scale = (t.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(_EPS)
    q = (t / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(n, k), scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    m, k = q.shape
    return (q.to(dtype).view(m, scale.size(1), -1) * scale.to(dtype).unsqueeze(-1)).view(m, k)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    n, k = q.shape
    nb, kb = scale.shape
    return (q.to(dtype).view(nb, n // nb, kb, k // kb) * scale.to(dtype)[:, None, :, None]).view(n, k)


def _per_slice_mm(qa, sa, qb, sb_rows, block):
    """sum_k diag(sa[:, k]) (qa_k qb_k^T) diag(sb_rows[:, k]) in float32 (module docstring)."""
    m, n = qa.size(0), qb.size(0)
    out = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    for kb in range(sa.size(1)):
        sl = slice(kb * block, (kb + 1) * block)
        out += torch._scaled_mm(qa[:, sl].contiguous(), qb[:, sl].contiguous().t(),
                                scale_a=sa[:, kb:kb + 1].contiguous(), scale_b=sb_rows[:, kb].reshape(1, n).contiguous(),
                                out_dtype=torch.float32)
    return out


_ONE_CALL_OK: dict[tuple, bool] = {}


def _one_call_mm(qa, sa, qb, sb, b_blocks: bool):
    recipe_b = F.ScalingType.BlockWise128x128 if b_blocks else F.ScalingType.BlockWise1x128
    # Hopper kernels want the 1x128 scales "outer-dim major": [rows, K/128] with stride (1, rows).
    sa_t = sa.t().contiguous().t()
    sb_arg = sb if b_blocks else sb.t().contiguous().t()
    return F.scaled_mm(qa, qb.t(), sa_t, F.ScalingType.BlockWise1x128, sb_arg, recipe_b, output_dtype=torch.float32)


def blockwise_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, block: int,
                 b_blocks: bool) -> torch.Tensor:
    """``A B^T`` in float32 for A ``[M, K]`` with 1 x block tiles (``sa [M, K/block]``) and
    B ``[N, K]`` with block x block blocks (``b_blocks``: ``sb [N/block, K/block]``) or 1 x block
    tiles (``sb [N, K/block]``)."""
    sb_rows = sb.repeat_interleave(block, dim=0) if b_blocks else sb
    if qa.is_cuda and block == 128:
        key = (qa.device.index, b_blocks)
        if _ONE_CALL_OK.get(key, True):
            try:
                out = _one_call_mm(qa, sa, qb, sb, b_blocks)
                if key not in _ONE_CALL_OK:  # first use: check against the per-slice arithmetic
                    _ONE_CALL_OK[key] = bool(torch.allclose(out, _per_slice_mm(qa, sa, qb, sb_rows, block),
                                                            rtol=1e-3, atol=1e-3))
                if _ONE_CALL_OK[key]:
                    return out
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                _ONE_CALL_OK[key] = False
    return _per_slice_mm(qa, sa, qb, sb_rows, block)


def _pad_rows(t: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-t.size(0)) % block
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, block):
        qx, sx = quantize_tiles(x2d, block)
        qw, sw = quantize_blocks(weight, block)
        ctx.save_for_backward(x2d, qw, sw)
        ctx.block, ctx.weight_dtype = block, weight.dtype
        return blockwise_mm(qx, sx, qw, sw, block, True).to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2d, qw, sw = ctx.saved_tensors
        block = ctx.block
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg, sg = quantize_tiles(grad, block)  # 1 x B along N
            dx = blockwise_mm(qg, sg, qw.t().contiguous(), sw.t().contiguous(), block, True).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            qgt, sgt = quantize_tiles(_pad_rows(grad, block).t().contiguous(), block)  # dy^T: 1 x B along M
            qxt, sxt = quantize_tiles(_pad_rows(x2d, block).t().contiguous(), block)  # x^T: 1 x B along M
            dw = blockwise_mm(qgt, sgt, qxt, sxt, block, False).to(ctx.weight_dtype)
        return dx, dw, None


def fp8_shape_supported(in_features: int, out_features: int, block: int) -> bool:
    """Both GEMM dimensions of the weight must be whole blocks."""
    return in_features % block == 0 and out_features % block == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``F.linear(x, weight)`` with the fine-grained FP8 recipe (forward and backward);
    ``x [..., K]``, ``weight [N, K]``; output in ``x.dtype``."""
    if not fp8_shape_supported(weight.size(1), weight.size(0), block):
        raise ValueError(f"FP8 blockwise GEMM: weight {tuple(weight.shape)} is not made of {block}x{block} blocks")
    lead = x.shape[:-1]
    y = _FP8Linear.apply(x.reshape(-1, x.size(-1)), weight, block)
    return y.view(*lead, weight.size(0))
