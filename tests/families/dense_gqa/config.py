"""The ``model:`` section of the dense GQA family (torch-free: loading a recipe imports only this)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.model_schema import LayoutRequirements, ModelSchema
from megatron_s2.config.schema import ConfigError

__all__ = ["DenseGQAConfig", "CONFIG_CLASS", "FAMILY_NAME"]

FAMILY_NAME = "tests.families.dense_gqa"


@dataclass(frozen=True)
class DenseGQAConfig(ModelSchema):
    """Dense pre-norm transformer: GQA attention with RoPE, SwiGLU MLP, RMSNorm, untied head."""

    family: str = FAMILY_NAME
    name: str = "dense-gqa"
    vocab_size: int = 128
    hidden_size: int = 64
    init_std: float = 0.02
    layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (each serves num_attention_heads / num_kv_heads query heads)."""
    head_dim: int = 16
    """Channels per head."""
    ffn_hidden_size: int = 128
    """SwiGLU intermediate width."""
    rope_theta: float = 10000.0
    """RoPE base (rotate-half convention, as Llama)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_attention_heads="
                              f"{self.num_attention_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim: RoPE rotates channel pairs; {self.head_dim} is odd")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ConfigError("model.norm_eps / init_std / rope_theta: must be positive")

    @property
    def num_layers(self) -> int:
        return self.layers

    def layout_requirements(self) -> LayoutRequirements:
        return LayoutRequirements(tp=((self.num_attention_heads, "query heads"), (self.num_kv_heads, "key/value heads"),
                                      (self.ffn_hidden_size, "MLP width"), (self.vocab_size, "vocabulary entries")))


CONFIG_CLASS = DenseGQAConfig
