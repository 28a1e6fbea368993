"""The Qwen3.5-MoE checkpoint format of the Intern-S2 family: ``config.json`` and tensor names.

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

from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping
from megatron_s2.models.family.hf import BLOCK_KEY, HFAdapter
from megatron_s2.models.family.mapping_registry import MappingRegistry
from megatron_s2.models.family.param_mapping import DirectMapping, FusedPartMapping, GroupedExpertMapping
from megatron_s2.models.intern_s2.config import InternS2Config

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
        DirectMapping(la + "A_log", ha + "A_log"),
        DirectMapping(la + "dt_bias", ha + "dt_bias"),
        DirectMapping(la + "norm.weight", ha + "norm.weight"),
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


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if config.get("model_type") == "qwen3_5_moe" and text is not None:
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        return text
    return config


class QwenMoEAdapter(HFAdapter):
    @property
    def registry(self) -> MappingRegistry:
        return _registry(TEXT_PREFIX)

    def registry_for(self, config: dict[str, Any]) -> MappingRegistry:
        nested = config.get("model_type") == "qwen3_5_moe" and isinstance(config.get("text_config"), dict)
        return _registry(RELEASE_PREFIX if nested else TEXT_PREFIX)

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") in MODEL_TYPES

    def config_to_hf(self, cfg: InternS2Config, torch_dtype: str) -> dict[str, Any]:
        return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "dtype": torch_dtype,
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.layers,
                "layer_types": list(cfg.mixers), "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                    "partial_rotary_factor": cfg.partial_rotary_factor},
                "linear_conv_kernel_dim": cfg.linear_conv_kernel, "linear_key_head_dim": cfg.linear_key_head_dim,
                "linear_value_head_dim": cfg.linear_value_head_dim,
                "linear_num_key_heads": cfg.linear_num_key_heads,
                "linear_num_value_heads": cfg.linear_num_value_heads,
                "num_experts": cfg.num_routed_experts, "num_experts_per_tok": cfg.moe_topk,
                "moe_intermediate_size": cfg.moe_ffn_hidden_size,
                "shared_expert_intermediate_size": cfg.shared_expert_ffn_hidden_size,
                "router_aux_loss_coef": cfg.router_aux_loss_coef, "rms_norm_eps": cfg.norm_eps,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "initializer_range": cfg.init_std, "max_position_embeddings": 262144,
                BLOCK_KEY: {"format_version": 1, "model": to_mapping(cfg)}}

    def config_from_hf(self, config: dict[str, Any]) -> InternS2Config:
        block = config.get(BLOCK_KEY)
        if isinstance(block, dict):
            return from_mapping(InternS2Config, block.get("model"), f"{BLOCK_KEY}.model")
        c = _text_config(config)
        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if c.get(key, want) != want:
                raise ConfigError(f"config.json: {key}={c[key]!r} is not supported by the intern_s2 family "
                                  f"(the Qwen3.5-MoE architecture has {want!r})")
        if c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            raise ConfigError("config.json: tie_word_embeddings=true is not supported by the intern_s2 family "
                              "(its head is untied)")
        rope = c.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("config.json: rope_parameters must be an object")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters.rope_type={rope['rope_type']!r}; only the default "
                              "RoPE is supported by the intern_s2 family")
        try:
            layers = c["num_hidden_layers"]
            return InternS2Config(
                name=str(c.get("_name_or_path") or config.get("_name_or_path") or "qwen3_5_moe"),
                vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], layers=layers,
                layer_types=tuple(c.get("layer_types") or ()),
                full_attention_interval=c.get("full_attention_interval", 4),
                num_attention_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                partial_rotary_factor=rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)),
                rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"],
                linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
                linear_conv_kernel=c.get("linear_conv_kernel_dim", 4),
                num_routed_experts=c["num_experts"], moe_topk=c["num_experts_per_tok"],
                moe_ffn_hidden_size=c["moe_intermediate_size"],
                shared_expert_ffn_hidden_size=c.get("shared_expert_intermediate_size", 0),
                router_aux_loss_coef=c.get("router_aux_loss_coef", 0.001), norm_eps=c.get("rms_norm_eps", 1e-6),
                init_std=c.get("initializer_range", 0.02))
        except KeyError as exc:
            raise ConfigError(f"config.json: a Qwen3.5-MoE config needs '{exc.args[0]}'") from None
        except TypeError as exc:
            raise ConfigError(f"config.json: a Qwen3.5-MoE field has the wrong type ({exc})") from None

