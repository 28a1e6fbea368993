"""``config.json`` of the Qwen3.5-MoE format <-> :class:`~.config.InternS2Config`.

Reading follows ``transformers``' ``Qwen3_5MoeTextConfig`` (a strict dataclass): a key left out
takes *its* default (``head_dim`` 256, a 512-wide shared expert — not what our recipe defaults
would give), and a value of the wrong JSON type is refused, one line naming the key. The keys
without a reference default that a model cannot do without (sizes, head counts, experts) must be
present.

Our exports also carry the lossless ``megatron_s2`` block, which wins on import; ``transformers``
reads the Hugging Face keys beside it. A hand edit of one of those keys would make the two
readers load different models, so a disagreement is refused instead of ignored.
"""

from __future__ import annotations

import json
import math
from typing import Any

from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping
from megatron_s2.models.family.hf import BLOCK_KEY
from megatron_s2.models.intern_s2.config import FULL, LINEAR, InternS2Config

__all__ = ["config_to_hf", "config_from_hf", "text_config", "FORMAT_VERSION"]

FORMAT_VERSION = 1
"""Version of the ``megatron_s2`` block this reader understands."""

REQUIRED = object()

FIELDS = (  # (our field, config.json key, the reference's default or REQUIRED)
    ("vocab_size", "vocab_size", REQUIRED),
    ("hidden_size", "hidden_size", REQUIRED),
    ("layers", "num_hidden_layers", REQUIRED),
    ("num_attention_heads", "num_attention_heads", REQUIRED),
    ("num_kv_heads", "num_key_value_heads", REQUIRED),
    ("head_dim", "head_dim", 256),
    ("linear_num_key_heads", "linear_num_key_heads", REQUIRED),
    ("linear_num_value_heads", "linear_num_value_heads", REQUIRED),
    ("linear_key_head_dim", "linear_key_head_dim", REQUIRED),
    ("linear_value_head_dim", "linear_value_head_dim", REQUIRED),
    ("linear_conv_kernel", "linear_conv_kernel_dim", 4),
    ("num_routed_experts", "num_experts", REQUIRED),
    ("moe_topk", "num_experts_per_tok", REQUIRED),
    ("moe_ffn_hidden_size", "moe_intermediate_size", REQUIRED),
    ("shared_expert_ffn_hidden_size", "shared_expert_intermediate_size", 512),
    ("full_attention_interval", "full_attention_interval", 4),
    ("router_aux_loss_coef", "router_aux_loss_coef", 0.001),
    ("norm_eps", "rms_norm_eps", 1e-6),
    ("init_std", "initializer_range", 0.02),
)
FLOATS = {"router_aux_loss_coef", "norm_eps", "init_std"}

UNCHECKED = {BLOCK_KEY, "architectures", "model_type", "dtype", "initializer_range", "max_position_embeddings"}
"""Keys of an export that may differ from the block without changing the model."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: the release nests them under ``text_config``."""
    text = config.get("text_config")
    if config.get("model_type") == "qwen3_5_moe" and text is not None:
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        return text
    return config


def config_to_hf(cfg: InternS2Config, torch_dtype: str) -> dict[str, Any]:
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
            BLOCK_KEY: {"format_version": FORMAT_VERSION, "model": to_mapping(cfg)}}


def config_from_hf(config: dict[str, Any]) -> InternS2Config:
    """The model a ``config.json`` describes (module docstring); ConfigError naming the key."""
    block = config.get(BLOCK_KEY)
    if block is not None:
        return _from_block(block, config)
    c = text_config(config)
    for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if c.get(key, want) != want:
            raise ConfigError(f"config.json: {key}={c[key]!r} is not supported by the intern_s2 family "
                              f"(the Qwen3.5-MoE architecture has {want!r})")
    if c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)) is not False:
        raise ConfigError("config.json: tie_word_embeddings=true is not supported by the intern_s2 family "
                          "(its head is untied)")
    fields = {ours: _read(c, key, default, float if ours in FLOATS else int) for ours, key, default in FIELDS}
    layer_types, rope = _layer_types(c), _rope(c)  # these name their config.json key themselves
    try:
        return InternS2Config(name=str(c.get("_name_or_path") or config.get("_name_or_path") or "qwen3_5_moe"),
                              layer_types=layer_types, **rope, **fields)
    except ConfigError as exc:  # the model's own check names our field; say which file it came from
        raise ConfigError(f"config.json describes a model the intern_s2 family cannot build: {exc}") from None


def _read(c: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    if key not in c:
        if default is REQUIRED:
            raise ConfigError(f"config.json: a Qwen3.5-MoE config needs '{key}'")
        return default
    value = c[key]
    if kind is int and type(value) is not int:  # bool is an int subclass; 128.0 is not a size
        raise ConfigError(f"config.json: {key} must be an integer, got {json_repr(value)}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise ConfigError(f"config.json: {key} must be a finite number, got {json_repr(value)}")
    return float(value) if kind is float else value


def _layer_types(c: dict[str, Any]) -> tuple[str, ...]:
    types = c.get("layer_types")
    if types is None:  # the reference derives the pattern from full_attention_interval
        return ()
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"config.json: layer_types must be a list of '{LINEAR}' / '{FULL}' strings, got "
                          f"{json_repr(types)}")
    return tuple(types)


def _rope(c: dict[str, Any]) -> dict[str, float]:
    rope = c.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError("config.json: rope_parameters must be an object")
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json: rope_parameters.rope_type={rope['rope_type']!r}; only the default "
                          "RoPE is supported by the intern_s2 family")
    out = {}  # older configs keep the two values at the top level
    for ours, key, default in (("rope_theta", "rope_theta", 10000.0), ("partial_rotary_factor",
                                                                        "partial_rotary_factor", 0.25)):
        where = rope if key in rope else c
        out[ours] = _read(where, key, default, float) if key in where else default
    return out


def _from_block(block: Any, config: dict[str, Any]) -> InternS2Config:
    if not isinstance(block, dict):
        raise ConfigError(f"config.json: {BLOCK_KEY} must be an object")
    version = block.get("format_version", 0)
    if type(version) is not int or version > FORMAT_VERSION:
        raise ConfigError(f"config.json: {BLOCK_KEY} format_version {json_repr(version)} is newer than this reader "
                          f"({FORMAT_VERSION}); update megatron_s2")
    cfg = from_mapping(InternS2Config, block.get("model"), f"{BLOCK_KEY}.model")
    expected, text = config_to_hf(cfg, "float32"), text_config(config)
    for key, want in expected.items():
        if key in UNCHECKED or key not in text:
            continue
        got = text[key]
        if key == "rope_parameters" and isinstance(got, dict):  # it may carry extra (mrope) entries
            got = {k: got.get(k) for k in want}
        if got != want:
            raise ConfigError(f"config.json: {key}={json_repr(text[key])} disagrees with the {BLOCK_KEY} block "
                              f"({json_repr(want)}); the file was edited by hand: restore it, or delete the "
                              f"{BLOCK_KEY} block to import the Hugging Face keys")
    return cfg


def json_repr(value: Any) -> str:
    """A value as config.json spells it (true, null, "x"), for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
