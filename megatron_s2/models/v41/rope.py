"""Rotary position embedding on the trailing ``rope_head_dim`` channels (report §2.3).

Adjacent channel pairs are rotated as complex numbers (the reference's interleaved
convention). CSA2 layers use ``compress_rope_theta`` (optionally with YaRN) for queries, the
window KV and compressed entries; a compressed entry j takes the position of the first
token of its group, j * m. The attention output has the query rotation removed again
(``inverse=True``) so the value side stays in one shared rotated form. Always float32.
"""

from __future__ import annotations

import math

import torch

from megatron_s2.kernels.precision import wide

__all__ = ["rope_frequencies", "apply_rope"]


def rope_frequencies(dim: int, theta: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """Inverse frequencies [dim/2]; with ``original_seq_len > 0`` the YaRN ramp is applied."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if original_seq_len > 0:
        def corrected(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs.float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels of ``x``.

    x: [b, s, ..., d]; positions: [b, s] (int or float). Returns a new tensor in x.dtype.
    """
    rd = 2 * inv_freq.numel()
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device)  # [b, s, rd/2]
    while angles.dim() < x.dim():
        angles = angles.unsqueeze(-2)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], wide(x[..., -rd:])
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((head, rot.to(x.dtype)), dim=-1)
