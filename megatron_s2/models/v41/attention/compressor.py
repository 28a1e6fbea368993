"""CSA2 compressor (report §2.3): m consecutive tokens -> one main-KV entry.

Unlike CSA in DeepSeek-V4, groups do not overlap and carry no absolute positional embedding:
entry j pools tokens j*m .. j*m+m-1 with a per-channel softmax gate,

    c_j = sum_t softmax_t(Z[t]) * C[t],    C = X W^KV,  Z = X W^Z   (Eq. 1 notation),

followed by RMSNorm. With m = 1 the compressor is a plain projection (no gate). A trailing
incomplete group produces no entry (it is not causally complete). The input X is always the
layer's own normalised attention input (as in the released model); for the CED decoder's Full
layer that is attn_norm(H_{L/2}) (§2.2, Eq. 1; ``CSA2Attention.compressor_input``). RoPE and
FP4 QAT are applied by the attention layer, after the index keys are derived from the
RoPE-free latent.

The projections are replicated over tensor-parallel ranks (one latent for all heads) and
run on the locally held tokens; the caller gathers the small latent over the sequence. They
are placed by the attention layer's section of the parallel plan (``compressor.*``).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.kernels.precision import wide
from megatron_s2.parallel.linear import ReplicatedLinear, _LocalGemm, _linear

__all__ = ["Compressor", "pool_groups"]


def pool_groups(kv: torch.Tensor, gate: torch.Tensor, ratio: int) -> torch.Tensor:
    """Softmax-gated pooling of complete groups: [b, s, c] -> [b, s // ratio, c] (float32)."""
    b, s, c = kv.shape
    n = s // ratio
    kv = wide(kv[:, : n * ratio]).view(b, n, ratio, c)
    gate = wide(gate[:, : n * ratio]).view(b, n, ratio, c)
    return (kv * gate.softmax(dim=2)).sum(dim=2)


class Compressor(nn.Module):
    def __init__(self, config: V41Config, ratio: int, *, linears=None):
        super().__init__()
        linear = linears.replicated_linear if linears is not None else ReplicatedLinear
        self.ratio = ratio
        d, hd = config.hidden_size, config.head_dim
        self.linear_kv = linear(d, hd)
        self.linear_gate = linear(d, hd) if ratio > 1 else None
        self.norm = RMSNorm(hd, config.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token projections (run on the locally held tokens): (C, Z).

        With the local GEMM on both, C and Z come from one GEMM over the stacked weights
        ``[W^KV; W^Z]``: the same C, Z and weight gradients, and one ``[s, d]`` input gradient
        ``[dC dZ] [W^KV; W^Z]`` instead of two summed afterwards (equal to float round-off),
        so the layer's backward never holds two of them at once. GEMM backends (FP8, TE) keep
        two products."""
        x = wide(x)
        kv_lin, gate_lin = self.linear_kv, self.linear_gate
        if (gate_lin is not None and type(kv_lin).gemm is _LocalGemm.gemm and type(gate_lin).gemm is _LocalGemm.gemm
                and kv_lin.gemm_dtype == gate_lin.gemm_dtype):
            both = _linear(x, torch.cat([kv_lin.weight, gate_lin.weight]), kv_lin.gemm_dtype)
            return both.split([kv_lin.out_features, gate_lin.out_features], dim=-1)
        kv = kv_lin(x)
        gate = gate_lin(x) if gate_lin is not None else None
        return kv, gate

    def pool(self, kv: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Complete groups of the full sequence -> normalised RoPE-free latents [b, s//m, hd]."""
        latent = wide(kv) if self.ratio == 1 else pool_groups(kv, gate, self.ratio)
        return self.norm(latent)
