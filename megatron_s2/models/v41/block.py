"""One backbone block: [Engram] -> mHC(attention) -> mHC(MoE) (report §2.1, §2.4).

The residual stream is n parallel copies X_l in R^{n x d} (mHC, §2.4.1). Each sublayer (the
attention and the MoE) has a coefficient predictor H producing (A, B, C); the stream is
updated as X <- B X + C F(A' X). With **Single-Pass mHC** (Eq. 6) the input mix A' is the
one produced by the *previous* sublayer, so each sublayer's input no longer waits for its
own coefficient reduction; with the multi-pass form (Eq. 2–5) A' = A of the current
sublayer. An Engram module, where the plan places one (§2.4.2), writes its gated n-gram
memory into the streams before the block. Nothing is handed to the CED decoder besides the
streams: the first decoder block's normalised attention input *is* H_{L/2} (§2.2, Eq. 1), and
its attention compresses exactly that (see :mod:`.attention.csa2`).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_s2.models.v41.layer_plan import LayerSpec
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.mhc import collapse
from megatron_s2.models.v41.parallel_plan import apply_plan
from megatron_s2.models.v41.spec import BlockSubmodules, build_module
from megatron_s2.parallel.groups import ParallelGroups

__all__ = ["V41Block"]


class V41Block(nn.Module):
    PLAN_SECTION = "block"

    def __init__(self, config: V41Config, spec: LayerSpec, groups: ParallelGroups, submodules: BlockSubmodules):
        super().__init__()
        self.config, self.spec = config, spec
        self.layer_number = spec.index
        self.engram = build_module(submodules.engram, config, spec.index, groups) if spec.has_engram else None
        self.attn_hc = build_module(submodules.hyper_connection, config, groups)
        self.attn_norm = submodules.norm(config.hidden_size, config.norm_eps)
        self.attention = build_module(submodules.attention, config, spec, groups, linears=submodules.linears)
        self.mlp_hc = build_module(submodules.hyper_connection, config, groups)
        self.mlp_norm = submodules.norm(config.hidden_size, config.norm_eps)
        experts = {k: v for k, v in (("experts", submodules.experts), ("shared_expert", submodules.shared_expert))
                   if v is not None}
        self.mlp = build_module(submodules.mlp, config, spec.index, groups, **experts)
        apply_plan(self, groups, config)

    def forward(self, x: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [b, s, n, d] streams; pre: [b, s, n] input mix handed over by the previous
        sublayer. Returns the new streams and the mix for the next block."""
        if self.engram is not None:
            x = self.engram(x, ctx)
        single = self.config.mhc_single_pass
        # Each sublayer returns its own A; under Single-Pass mHC (Eq. 6) the NEXT sublayer
        # collapses with it, otherwise (Eq. 2) every sublayer uses its own.
        x, attn_pre = self.attn_hc(x, lambda h: self.attention(self.attn_norm(h), ctx), pre if single else None)
        x, mlp_pre = self.mlp_hc(x, lambda h: self.mlp(self.mlp_norm(h), ctx), attn_pre if single else None)
        return x, mlp_pre

    def attention_input(self, x: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The normalised input this block's attention reads for streams ``x`` and handed-over
        mix ``pre`` (what :meth:`forward` feeds it), without running the block. Decoder SWA
        Bounded Replay uses it to compress the CED decoder's global KV for every prompt token
        while the decoder itself runs only over the replayed tail (§3.2.2)."""
        if self.engram is not None:
            x = self.engram(x, ctx)
        if not self.config.mhc_single_pass:
            pre = self.attn_hc.coefficients(x)[0]
        return self.attn_norm(collapse(x, pre))
