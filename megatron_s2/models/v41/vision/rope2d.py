"""2D rotary position embedding of the vision tower (report §2.1.1: "we replace standard
absolute positional embeddings with 2D-RoPE").

A patch at row ``i``, column ``j`` of its image's grid rotates each head vector in the
reference's half-split layout: channel ``c`` pairs with ``c + head_dim / 2`` (the first half
against the second, not adjacent pairs). Of the ``head_dim / 2`` rotation frequencies the first
half turn with the row index and the second half with the column index, each over the
frequencies ``theta^(-2k / (head_dim / 2))``, ``k = 0 .. head_dim / 4 - 1``. A query-key score
therefore depends on the two patches' positions only through their offset ``(di, dj)`` — the
property that lets the tower take any resolution (tests/vision/test_tower.py).
"""

from __future__ import annotations

import torch

__all__ = ["rope_2d_tables", "apply_rope_2d"]


def rope_2d_tables(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each float32 [n_h * n_w, 1, head_dim / 2], for an ``n_h x n_w`` grid in reading order."""
    rot = head_dim // 2  # rotated pairs per head
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot)
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [N, rot]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [N, heads, head_dim] in float32 (half-split pairs), back in its dtype."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
