"""Rotary position embedding on the trailing ``rope_head_dim`` channels (report §2.3).

Adjacent channel pairs are rotated as complex numbers (the reference's interleaved
convention). CSA2 layers use ``compress_rope_theta`` (optionally with YaRN) for queries, the
window KV and compressed entries; a compressed entry j takes the position of the first
token of its group, j * m. The attention output has the query rotation removed again
(``inverse=True``) so the value side stays in one shared rotated form. Always float32.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict

import torch
from torch.utils.weak import WeakIdKeyDictionary

from megatron_s2.kernels.precision import cast, wide

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


# cos / sign-folded sin tables of recent small position tensors (decode steps): every layer of a
# step rotates its queries, its output and its new keys at the same positions, so the ~8
# operators that build the tables ran ~40 times per step for the same values. Keyed by the
# objects themselves (weak references + version counters), so a reused id or an in-place
# update never hits; only position tensors of at most _MEMO_TOKENS entries are kept, so a
# training sequence's tables are never held past their forward. Every attention layer owns its
# ``inv_freq`` buffer, so the frequencies are keyed by their values (read once per buffer and
# version): keyed by identity, a step of ``small`` rebuilt the tables 24 times.
_MEMO: OrderedDict[tuple, tuple] = OrderedDict()
_MEMO_ENTRIES = 16
_MEMO_TOKENS = 4096
_FREQ_KEYS = WeakIdKeyDictionary()  # inv_freq buffer -> (version, key)


def _freq_key(inv_freq: torch.Tensor) -> tuple:
    """The values of an ``inv_freq`` buffer as a hashable key (read once per buffer version)."""
    hit = _FREQ_KEYS.get(inv_freq)
    if hit is None or hit[0] != inv_freq._version:
        hit = _FREQ_KEYS[inv_freq] = (inv_freq._version, (inv_freq.dtype, tuple(inv_freq.tolist())))
    return hit[1]


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, device: torch.device,
            ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``positions x inv_freq`` in the channel layout of the rotated pairs:
    cos = (c0, c0, c1, c1, ...), sin = (-s0, s0, -s1, s1, ...), unsqueezed to ``ndim`` dims."""
    key = (id(positions), _freq_key(inv_freq), device, ndim, torch.is_inference_mode_enabled())
    hit = _MEMO.get(key)
    if hit is not None:
        pos_ref, pos_version, cos, sin = hit
        if pos_ref() is positions and positions._version == pos_version:
            return cos, sin
    freq = inv_freq if inv_freq.device == device else inv_freq.to(device)
    angles = cast(positions, torch.float32).unsqueeze(-1) * freq  # [b, s, rd/2]
    c, s = angles.cos(), angles.sin()
    cos = torch.stack((c, c), dim=-1).flatten(-2)
    sin = torch.stack((-s, s), dim=-1).flatten(-2)
    while cos.dim() < ndim:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if positions.numel() <= _MEMO_TOKENS:
        _MEMO[key] = (weakref.ref(positions), positions._version, cos, sin)
        while len(_MEMO) > _MEMO_ENTRIES:
            _MEMO.popitem(last=False)
    return cos, sin


_SWAP: dict[tuple[int, torch.device], torch.Tensor] = {}


def _swap_index(rd: int, device: torch.device) -> torch.Tensor:
    """Channel order (1, 0, 3, 2, ...) of ``rd`` channels: the pairs swapped (built once per device)."""
    idx = _SWAP.get((rd, device))
    if idx is None:
        idx = _SWAP[(rd, device)] = torch.arange(rd, device=device).view(-1, 2).flip(-1).flatten()
    return idx


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels of ``x``.

    x: [b, s, ..., d]; positions: [b, s] (int or float). Returns a new tensor in x.dtype.
    Each pair (e, o) becomes (e cos - o sin, e sin + o cos), computed as
    ``tail * cos + swap(tail) * sin`` with swap(e, o) = (o, e) and the sign folded into the
    table — the same products and sums, so the same bits as the pairwise form.
    """
    rd = 2 * inv_freq.numel()
    cos, sin = _tables(positions, inv_freq, x.device, x.dim())
    head, tail = x[..., :-rd], wide(x[..., -rd:])
    swapped = tail.index_select(-1, _swap_index(rd, x.device))  # one gather, not unflatten/flip/flatten
    rot = tail * cos - swapped * sin if inverse else tail * cos + swapped * sin
    return torch.cat((head, cast(rot, x.dtype)), dim=-1)
