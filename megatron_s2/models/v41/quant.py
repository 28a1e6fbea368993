"""Fake quantisation for quantisation-aware training (report §2.4.4).

* **FP4 main KV** — E2M1 values with one E4M3 scale per 16 channels and no second-level
  global scale (NVFP4 minus its global scale). The largest representable magnitude is
  448 x 6 = 2688, far above the KV latent's bound (~sqrt(512) after RMSNorm and RoPE).
* **MXFP4 indexer Q/K** — E2M1 values with one E8M0 (power-of-two) scale per 32 channels,
  the OCP format DeepSeek-V4 uses for the indexer.
* **FP8 SWA KV** — E4M3 values with one power-of-two scale per 32 channels.

Each function returns ``x + (dequant(quant(x)) - x).detach()``: the forward sees the
quantised values, the backward is the straight-through identity. Rounding follows the
reference inference kernels: round-to-nearest-even onto the E2M1 grid, E4M3 scales by
casting ``amax / 6``, power-of-two scales rounded up.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_MAX", "E4M3_MAX", "FP4_MAIN_KV_MAX", "round_e2m1", "fake_quant_fp4_e4m3",
           "fake_quant_mxfp4", "fake_quant_fp8", "ceil_pow2"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP4_MAIN_KV_MAX = E4M3_MAX * E2M1_MAX  # 2688: dynamic range without a global scale (§2.4.4)

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to the even code), saturating at +-6."""
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=x.device)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = x.float().abs().clamp_max(E2M1_MAX)
    idx = torch.bucketize(mag, mids)  # value == midpoint goes to the lower code
    tie = (idx < len(_E2M1_MIDPOINTS)) & (mag == mids[idx.clamp_max(len(_E2M1_MIDPOINTS) - 1)])
    idx = idx + (tie & (idx % 2 == 1)).long()  # ...unless the lower code is odd: round to even
    return torch.copysign(grid[idx], x.float())


def ceil_pow2(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v (v > 0), i.e. an E8M0 scale rounded up."""
    mant, exp = torch.frexp(v.float())
    return torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Detached float32 blocks: the gradient is straight-through, so autograd keeps none of the
    quantiser's intermediates alive."""
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.detach().float().unflatten(-1, (-1, block))


def _ste(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    deq = deq.flatten(-2).to(x.dtype)
    return x + (deq - x).detach()


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 values, one E4M3 scale per ``block`` channels, no global scale (main KV, §2.4.4)."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -9)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return _ste(x, round_e2m1(b / scale) * scale)


def fake_quant_mxfp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 values, one E8M0 (power-of-two, rounded up) scale per ``block`` channels."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0 ** -126)
    scale = ceil_pow2(amax / E2M1_MAX)
    return _ste(x, round_e2m1(b / scale) * scale)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E4M3 values, one power-of-two scale per ``block`` channels (SWA KV, §2.4.4)."""
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = ceil_pow2(amax / E4M3_MAX)
    q = (b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return _ste(x, q * scale)
