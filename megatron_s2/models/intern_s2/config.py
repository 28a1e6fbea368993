"""The ``model:`` section of the Intern-S2 family (torch-free: loading a recipe imports only this).

Fields follow the Hugging Face ``Qwen3_5MoeTextConfig`` (the public reference of the
architecture the walkthrough compares against, seed 000 Ch. 1) under our naming; the
adapter (:mod:`.hf`) maps them both ways. Defaults are a CPU-sized model; the flagship shapes
live in ``recipes/models/intern_s2_*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.model_schema import LayoutRequirements, ModelSchema
from megatron_s2.config.schema import ConfigError

__all__ = ["InternS2Config", "CONFIG_CLASS", "FAMILY_NAME", "LINEAR", "FULL"]

FAMILY_NAME = "intern_s2"
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class InternS2Config(ModelSchema):
    """Hybrid backbone: Gated DeltaNet (linear attention) and gated full-attention token mixers,
    each followed by a routed MoE with a gated shared expert; zero-centred RMSNorm; untied head."""

    family: str = FAMILY_NAME
    name: str = "intern-s2-tiny"
    vocab_size: int = 128
    hidden_size: int = 64
    layers: int = 4
    """Decoder layers."""
    layer_types: tuple[Literal["linear_attention", "full_attention"], ...] = ()
    """Token mixer of every layer; empty: ``full_attention`` every ``full_attention_interval``-th
    layer, Gated DeltaNet elsewhere (the reference's 3 linear : 1 full pattern)."""
    full_attention_interval: int = 4
    """Period of the default hybrid pattern (used when ``layer_types`` is empty)."""
    # ---- gated full attention -------------------------------------------------------------
    num_attention_heads: int = 4
    """Query heads of the full-attention layers (each with an output gate of head_dim)."""
    num_kv_heads: int = 2
    """Key/value heads of the full-attention layers (GQA)."""
    head_dim: int = 16
    """Channels per attention head."""
    partial_rotary_factor: float = 0.25
    """Fraction of each head's channels RoPE rotates (the first ones, rotate-half convention)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    # ---- Gated DeltaNet ------------------------------------------------------------------
    linear_num_key_heads: int = 2
    """Query/key heads of the Gated DeltaNet layers."""
    linear_num_value_heads: int = 4
    """Value heads (a multiple of the key heads: each key head serves a group of value heads)."""
    linear_key_head_dim: int = 8
    """Channels per query/key head (L2-normalised)."""
    linear_value_head_dim: int = 8
    """Channels per value head; the recurrent state of a head is key_dim x value_dim, float32."""
    linear_conv_kernel: int = 4
    """Width of the causal depthwise convolution over q, k and v."""
    gdn_chunk_size: int = 64
    """Tokens per chunk of the chunked (WY) training form of the delta rule."""
    # ---- MoE -------------------------------------------------------------------------------
    num_routed_experts: int = 4
    """Routed experts per MoE layer."""
    moe_topk: int = 2
    """Experts each token selects (softmax scores, renormalised over the selection)."""
    moe_ffn_hidden_size: int = 32
    """SwiGLU width of each routed expert."""
    shared_expert_ffn_hidden_size: int = 48
    """SwiGLU width of the shared expert (0: none); its output is gated by sigmoid(x w_gate)."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (E * sum_e f_e P_e per layer, averaged over layers)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (all norms)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel", "gdn_chunk_size", "num_routed_experts",
                     "moe_topk", "moe_ffn_hidden_size", "full_attention_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.shared_expert_ffn_hidden_size < 0:
            raise ConfigError("model.shared_expert_ffn_hidden_size: must be >= 0 (0: no shared expert)")
        if self.layer_types:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.layers:
                raise ConfigError(f"model.layer_types: {len(self.layer_types)} entries for {self.layers} layers; "
                                  "give one per layer or leave it empty for the default pattern")
            bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
            if bad:
                raise ConfigError(f"model.layer_types: unknown mixer(s) {bad}; use '{LINEAR}' or '{FULL}'")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_attention_heads="
                              f"{self.num_attention_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"model.linear_num_key_heads: {self.linear_num_key_heads} does not divide "
                              f"linear_num_value_heads={self.linear_num_value_heads}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"model.partial_rotary_factor: must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ConfigError(f"model.partial_rotary_factor: head_dim={self.head_dim} x {self.partial_rotary_factor} "
                              f"= {self.rotary_dim} rotated channels; RoPE needs an even number >= 2")
        if self.moe_topk > self.num_routed_experts:
            raise ConfigError(f"model.moe_topk: {self.moe_topk} exceeds num_routed_experts={self.num_routed_experts}")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0 or self.router_aux_loss_coef < 0:
            raise ConfigError("model.norm_eps / init_std / rope_theta: must be positive; router_aux_loss_coef >= 0")

    @property
    def num_layers(self) -> int:
        return self.layers

    @property
    def mixers(self) -> tuple[str, ...]:
        """The token mixer of every layer (``layer_types`` or the default pattern)."""
        if self.layer_types:
            return self.layer_types
        k = self.full_attention_interval
        return tuple(FULL if (i + 1) % k == 0 else LINEAR for i in range(self.layers))

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mixers) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mixers) if t == FULL]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def optimizer_rules(self) -> tuple:
        """Routers and the convolution taps train with AdamW: a softmax router's gradient rows sum
        to zero over the experts (rank <= E-1), so Muon's orthogonalisation would turn the
        missing direction's round-off into a full-size update; a [C, K] depthwise kernel is
        C independent filters, not a matrix. (The rest follows the default table.)"""
        from megatron_s2.config.optimizer import ParamGroupRule

        return (ParamGroupRule("*.moe.router.weight", "adamw"), ParamGroupRule("*.linear_attn.conv_*", "adamw"))

    def layout_requirements(self) -> LayoutRequirements:
        heads = []
        if self.full_layers:
            heads += [(self.num_attention_heads, "query heads"), (self.num_kv_heads, "key/value heads")]
        if self.linear_layers:
            heads += [(self.linear_num_key_heads, "Gated DeltaNet key heads"),
                      (self.linear_num_value_heads, "Gated DeltaNet value heads")]
        if self.shared_expert_ffn_hidden_size:
            heads.append((self.shared_expert_ffn_hidden_size, "shared-expert width"))
        return LayoutRequirements(tp=(*heads, (self.vocab_size, "vocabulary entries")),
                                  ep=((self.num_routed_experts, "routed experts"),),
                                  etp=((self.moe_ffn_hidden_size, "routed-expert width"),), experts=True,
                                  cp_min_chunk=max(self.linear_conv_kernel - 1, 1),  # the conv's halo
                                  recompute=("none", "full"))  # whole blocks: no selective regions


CONFIG_CLASS = InternS2Config
