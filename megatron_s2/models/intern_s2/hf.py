"""The Qwen3.5-MoE checkpoint format of the Intern-S2 family: tensor names here, ``config.json``
in :mod:`.hf_config`.

Reference: ``transformers``' ``qwen3_5_moe`` implementation. Two layouts are read:

* ``Qwen3_5MoeForCausalLM`` (``model_type: qwen3_5_moe_text``; tensors ``model.layers.*``) —
  what ``save_pretrained`` writes for the text model, and what our export writes;
* the released multimodal checkpoints (``model_type: qwen3_5_moe``, ``text_config`` nested;
  tensors ``model.language_model.layers.*``). Their vision tower (``model.visual.*``) and
  multi-token-prediction head (``mtp.*``) are not part of this family's text backbone: import
  skips them and its report says how many tensors it skipped.

On disk every routed expert is its own ``mlp.experts.{e}.{gate,up,down}_proj`` (the reference
fuses them in memory only); we keep them grouped ``[E, ...]``. The reference fuses the Gated
DeltaNet q / k / v projections (``in_proj_qkv``) and their convolution (``conv1d``, ``[C, 1, K]``);
we keep q, k and v apart so that each splits over tensor parallelism by its own heads.

Text-only positions make the reference's multimodal RoPE (``mrope_section``) the ordinary
rotate-half RoPE on the first ``partial_rotary_factor`` of each head (all three position
streams are equal), which is what the family computes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from megatron_s2.models.family.hf import HFAdapter
from megatron_s2.models.family.mapping_registry import MappingRegistry
from megatron_s2.models.family.param_mapping import DirectMapping, FusedPartMapping, GroupedExpertMapping
from megatron_s2.models.intern_s2.config import InternS2Config
from megatron_s2.models.intern_s2.hf_config import config_from_hf, config_to_hf

__all__ = ["QwenMoEAdapter", "TEXT_PREFIX", "RELEASE_PREFIX", "SKIPPED"]

TEXT_PREFIX, RELEASE_PREFIX = "model.", "model.language_model."
SKIPPED = {"model.visual.": "the vision tower (not part of the text backbone)",
           "mtp.": "the multi-token-prediction head (not part of the text backbone)"}
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def _qkv_rows(cfg: InternS2Config) -> list[int]:
    return [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim]


def _mappings(prefix: str) -> list:
    L, H = "layers.{layer}.", prefix + "layers.{layer}."
    la, ha = L + "linear_attn.", H + "linear_attn."
    out = [
        DirectMapping("embedding.word_embeddings.weight", prefix + "embed_tokens.weight"),
        DirectMapping("final_norm.weight", prefix + "norm.weight"),
        DirectMapping("output_layer.weight", "lm_head.weight"),
        DirectMapping(L + "input_norm.weight", H + "input_layernorm.weight"),
        DirectMapping(L + "post_mixer_norm.weight", H + "post_attention_layernorm.weight"),
        *[FusedPartMapping(la + f"{p}_proj.weight", ha + "in_proj_qkv.weight", part=i, rows=_qkv_rows)
          for i, p in enumerate("qkv")],
        *[FusedPartMapping(la + f"conv_{p}", ha + "conv1d.weight", part=i, rows=_qkv_rows, insert_dim=1)
          for i, p in enumerate("qkv")],
        *[DirectMapping(la + f"{p}_proj.weight", ha + f"in_proj_{p}.weight") for p in "zba"],
        DirectMapping(la + "A_log", ha + "A_log", keep_fp32=True),          # float32 in the release,
        DirectMapping(la + "dt_bias", ha + "dt_bias"),
        DirectMapping(la + "norm.weight", ha + "norm.weight", keep_fp32=True),  # as the gated norm's weight
        DirectMapping(la + "out_proj.weight", ha + "out_proj.weight"),
        *[DirectMapping(L + f"attention.{p}.weight", H + f"self_attn.{p}.weight")
          for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")],
        DirectMapping(L + "moe.router.weight", H + "mlp.gate.weight"),
        GroupedExpertMapping(L + "moe.experts.w1", H + "mlp.experts.{expert}.gate_proj.weight"),
        GroupedExpertMapping(L + "moe.experts.w3", H + "mlp.experts.{expert}.up_proj.weight"),
        GroupedExpertMapping(L + "moe.experts.w2", H + "mlp.experts.{expert}.down_proj.weight"),
        *[DirectMapping(L + f"moe.shared_expert.{p}.weight", H + f"mlp.shared_expert.{p}.weight")
          for p in ("gate_proj", "up_proj", "down_proj")],
        DirectMapping(L + "moe.shared_expert_gate.weight", H + "mlp.shared_expert_gate.weight"),
    ]
    return out


@lru_cache(maxsize=None)
def _registry(prefix: str) -> MappingRegistry:
    return MappingRegistry(_mappings(prefix), SKIPPED)


class QwenMoEAdapter(HFAdapter):
    training_only_keys = frozenset({"initializer_range", "router_aux_loss_coef"})

    @property
    def registry(self) -> MappingRegistry:
        return _registry(TEXT_PREFIX)

    def registry_for(self, config: dict[str, Any]) -> MappingRegistry:
        nested = config.get("model_type") == "qwen3_5_moe" and isinstance(config.get("text_config"), dict)
        return _registry(RELEASE_PREFIX if nested else TEXT_PREFIX)

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") in MODEL_TYPES

    def config_to_hf(self, cfg: InternS2Config, torch_dtype: str) -> dict[str, Any]:
        return config_to_hf(cfg, torch_dtype)

    def config_from_hf(self, config: dict[str, Any]) -> InternS2Config:
        return config_from_hf(config)
