"""``config.json`` <-> :class:`V41Config`.

Written layout::

    {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
     "torch_dtype": ..., "text_config": {...},            # Hugging Face spelling
     "megatron_s2": {"format_version": 1, "model": {...}}} # our V41Config, lossless

``text_config`` describes the architecture in the spelling of the release's ``config.json``
(as reproduced by public fixtures of DeepSeek-V4.1-Flash; the top-level structure and the
Hugging Face key names are **not confirmed** against the official repository). The reference
``inference/model.py`` documents its ``ModelArgs`` field names as "exactly the config JSON
keys" (those *are* confirmed), so import also accepts a flat config in that spelling
(``dim``, ``n_layers``, ``kv_source_layers``, ...; :data:`MODELARGS_ALIASES`).

Import prefers the lossless ``megatron_s2`` block and cross-checks it against
``text_config`` (an edited config.json is an error naming the key). Without it, the layer
plan is derived from the per-layer lists the reference uses: ``compress_ratios`` (0 = sliding
window only), ``kv_source_layer_ids`` (Full: compresses its own main KV),
``index_source_layer_ids`` (Full or Reindex: runs its own indexer; other CSA2 layers Reuse),
``candidate_source_layer_id`` (the Hierarchical Sparse Indexer's source, which our plan makes
the first decoder Full layer — so the encoder is the layers below it). Quantisation-aware
paths (FP4 main KV, FP8 SWA KV, MXFP4 indexer, FP8 Engram rows) are switched on, as the
reference runs them at inference.

The vision pathway (§2.1.1) is described by the release's flat keys ``vision_n_layers`` (0 = text
only), ``vision_dim``, ``vision_n_heads``, ``vision_inter_dim``, ``vision_patch_size``,
``vision_downsample_ratio``, ``vision_max_n_token``, ``vision_min_pixels``, ``vision_max_wh_ratio``,
``vision_rope_theta`` and ``image_token_id`` — the reference ``ModelArgs`` names, which are our
``V41Config`` field names; releases that nest them in a ``vision_config`` block are not read.
"""

from __future__ import annotations

from typing import Any

from megatron_s2.models.v41.layer_plan import CSA2Mode
from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "FORMAT_VERSION", "MODELARGS_ALIASES", "config_to_hf", "config_from_hf",
           "text_config"]

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
FORMAT_VERSION = 1

# ModelArgs (inference/config.json) spelling -> Hugging Face text_config spelling.
MODELARGS_ALIASES = {
    "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps",
    "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor", "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
}
_ROPE_ALIASES = {"rope_factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                 "original_seq_len": "original_max_position_embeddings"}


def text_config(cfg: V41Config) -> dict[str, Any]:
    """The architecture in the release's ``text_config`` spelling."""
    from megatron_s2.models.v41.engram.hashing import EngramHasher

    plan = cfg.plan
    cand = next((s.index for s in plan if s.is_candidate_source), -1)
    hasher = EngramHasher.from_config(cfg) if cfg.engram_layers else None
    return {
        "model_type": f"{MODEL_TYPE}_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_encoder_layers": cfg.num_encoder_layers,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.window_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": {"rope_type": "yarn", "factor": cfg.rope_scaling_factor, "beta_fast": cfg.rope_beta_fast,
                         "beta_slow": cfg.rope_beta_slow,
                         "original_max_position_embeddings": cfg.rope_scaling_original_seq_len},
        # the release lists the drafter's uncompressed sliding-window blocks after the backbone's
        "compress_ratios": [s.compress_ratio for s in plan] + [0] * cfg.dspark_layers,
        "kv_source_layer_ids": [s.index for s in plan if s.mode is CSA2Mode.FULL],
        "index_source_layer_ids": [s.index for s in plan if s.runs_indexer],
        "index_n_heads": cfg.index_num_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "candidate_source_layer_id": cand, "candidate_topk_blocks": cfg.candidate_topk_blocks if cand >= 0 else 0,
        "candidate_block_size": cfg.candidate_block_size if cand >= 0 else 0,
        "n_routed_experts": cfg.num_routed_experts, "n_shared_experts": cfg.num_shared_experts,
        "num_experts_per_tok": cfg.moe_topk, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "scoring_func": cfg.moe_score_func, "norm_topk_prob": cfg.moe_norm_topk_prob,
        "routed_scaling_factor": cfg.moe_route_scale, "swiglu_limit": cfg.swiglu_limit, "gate_temp": 1.0,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "engram_layer_ids": list(cfg.engram_layers),
        "engram_num_embeddings": [hasher.num_rows(i) for i in cfg.engram_layers] if hasher else [],
        "engram_max_ngram_size": cfg.engram_max_ngram if cfg.engram_layers else 1,
        "engram_vocab_size": cfg.engram_table_size, "engram_n_heads": cfg.engram_num_heads,
        "engram_head_dim": cfg.engram_head_dim, "engram_pad_token_id": cfg.engram_pad_id,
        "tie_word_embeddings": False,
        **_dspark_keys(cfg),
        **_vision_keys(cfg),
    }


def _dspark_keys(cfg: V41Config) -> dict[str, Any]:
    """The DSpark drafter's keys of the release (§2.4.3); none without a drafter."""
    if not cfg.dspark_layers:
        return {"num_nextn_predict_layers": 0}
    return {"num_nextn_predict_layers": cfg.dspark_layers, "dspark_block_size": cfg.dspark_block_size,
            "dspark_noise_token_id": cfg.dspark_noise_token_id,
            "dspark_target_layer_ids": list(cfg.dspark_target_layer_ids),
            "dspark_markov_rank": cfg.dspark_markov_rank, "dspark_n_routed_experts": cfg.dspark_num_routed_experts,
            "dspark_n_activated_experts": cfg.dspark_moe_topk}


VISION_KEYS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
               "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio",
               "vision_rope_theta", "image_token_id")
"""The vision keys of the release's config.json (§2.1.1): our ``V41Config`` fields of the same names."""


def _vision_keys(cfg: V41Config) -> dict[str, Any]:
    """The vision pathway's keys of the release; only ``vision_n_layers: 0`` without one."""
    if not cfg.vision_n_layers:
        return {"vision_n_layers": 0}
    return {k: getattr(cfg, k) for k in VISION_KEYS}


def has_vision(text: dict) -> bool:
    """Whether a release config (``text_config``) describes a vision tower."""
    return bool(int(text.get("vision_n_layers", 0) or 0))


def _vision_fields(text: dict) -> dict[str, Any]:
    """Our vision fields from a release config; keys it omits take the reference's defaults."""
    if not has_vision(text):
        return {"vision_n_layers": 0}
    return {k: text[k] for k in VISION_KEYS if k in text}


def has_drafter(text: dict) -> bool:
    """Whether a release config (``text_config``) describes a DSpark drafter."""
    fields = _dspark_fields(_normalise(text))
    return bool(fields["dspark_layers"])


def _dspark_fields(text: dict) -> dict[str, Any]:
    """Our drafter fields from a release config (``n_mtp_layers`` is the reference's ModelArgs
    spelling of ``num_nextn_predict_layers``); no drafter when neither names a count or no
    target layers are given."""
    layers = int(text.get("num_nextn_predict_layers", text.get("n_mtp_layers", 0)) or 0)
    targets = tuple(int(i) for i in text.get("dspark_target_layer_ids", ()) or ())
    if not layers or not targets:
        return {"dspark_layers": 0}
    return dict(dspark_layers=layers, dspark_block_size=int(text.get("dspark_block_size", 5)),
                dspark_noise_token_id=int(text.get("dspark_noise_token_id", 0)), dspark_target_layer_ids=targets,
                dspark_markov_rank=int(text.get("dspark_markov_rank", 256)),
                dspark_num_routed_experts=int(text.get("dspark_n_routed_experts", text.get("n_routed_experts"))),
                dspark_moe_topk=int(text.get("dspark_n_activated_experts", text.get("num_experts_per_tok"))))


def config_to_hf(cfg: V41Config, torch_dtype: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "torch_dtype": torch_dtype,
        "text_config": text_config(cfg),
        "megatron_s2": {"format_version": FORMAT_VERSION, "model": to_mapping(cfg)},
    }


def _normalise(text: dict[str, Any]) -> dict[str, Any]:
    out = {MODELARGS_ALIASES.get(k, k): v for k, v in text.items()}
    rope = dict(out.get("rope_scaling") or {})
    for flat, nested in _ROPE_ALIASES.items():
        if flat in out:
            rope.setdefault(nested, out.pop(flat))
    out["rope_scaling"] = rope
    return out


def _need(text: dict, key: str):
    if key not in text:
        raise ConfigError(f"config.json: text_config has no '{key}'; cannot describe the model without it")
    return text[key]


def _layer_groups(text: dict) -> tuple[tuple[LayerGroupSpec, ...], int, int]:
    n = int(_need(text, "num_hidden_layers"))
    ratios = [int(r) for r in _need(text, "compress_ratios")][:n]
    if len(ratios) != n:
        raise ConfigError(f"config.json: compress_ratios lists {len(ratios)} layers, num_hidden_layers is {n}")
    kv, idx = set(_need(text, "kv_source_layer_ids")), set(_need(text, "index_source_layer_ids"))
    modes = []
    for i, r in enumerate(ratios):
        if r == 0:
            modes.append("swa")
        elif i in kv:
            if i not in idx:
                raise ConfigError(f"config.json: layer {i} compresses its own KV but runs no indexer; "
                                  "this model requires every kv source to be an index source")
            modes.append("full")
        else:
            modes.append("reindex" if i in idx else "reuse")
    groups, start = [], 0
    for i in range(1, n + 1):
        if i == n or ratios[i] != ratios[start]:
            groups.append(LayerGroupSpec(tuple(modes[start:i]), 1, ratios[start]))
            start = i
    cand = int(text.get("candidate_source_layer_id", -1))
    encoder = int(text.get("num_encoder_layers", cand if cand >= 0 else n))
    return tuple(groups), encoder, cand


def _from_text(text: dict, name: str) -> V41Config:
    text = _normalise(text)
    if float(text.get("gate_temp", 1.0)) != 1.0:
        raise ConfigError(f"config.json: gate_temp={text['gate_temp']} is not supported (the router has no temperature)")
    groups, encoder, cand = _layer_groups(text)
    rope = text["rope_scaling"]
    engram_layers = tuple(int(i) for i in text.get("engram_layer_ids", ()))
    heads = int(text.get("engram_n_heads", 0) or 1)
    fields = dict(
        name=name, vocab_size=_need(text, "vocab_size"), hidden_size=_need(text, "hidden_size"),
        num_encoder_layers=encoder, layer_groups=groups,
        num_attention_heads=_need(text, "num_attention_heads"), head_dim=_need(text, "head_dim"),
        rope_head_dim=_need(text, "qk_rope_head_dim"), q_lora_rank=_need(text, "q_lora_rank"),
        o_groups=_need(text, "o_groups"), o_lora_rank=_need(text, "o_lora_rank"),
        window_size=_need(text, "sliding_window"), attn_sink=True,
        rope_theta=text.get("rope_theta", 10000.0), compress_rope_theta=text.get("compress_rope_theta", 40000.0),
        rope_scaling_original_seq_len=rope.get("original_max_position_embeddings", 0),
        rope_scaling_factor=rope.get("factor", 40.0), rope_beta_fast=rope.get("beta_fast", 32),
        rope_beta_slow=rope.get("beta_slow", 1),
        index_num_heads=_need(text, "index_n_heads"), index_head_dim=_need(text, "index_head_dim"),
        index_topk=_need(text, "index_topk"),
        candidate_topk_blocks=text.get("candidate_topk_blocks", 0) if cand >= 0 else 0,
        candidate_block_size=text.get("candidate_block_size", 0) if cand >= 0 else 0,
        num_routed_experts=_need(text, "n_routed_experts"), num_shared_experts=text.get("n_shared_experts", 1),
        moe_topk=_need(text, "num_experts_per_tok"), moe_ffn_hidden_size=_need(text, "moe_intermediate_size"),
        moe_score_func=text.get("scoring_func", "sqrtsoftplus"), moe_norm_topk_prob=text.get("norm_topk_prob", True),
        moe_route_scale=text.get("routed_scaling_factor", 1.0), swiglu_limit=text.get("swiglu_limit", 0.0),
        moe_modality_biases=True, hc_mult=_need(text, "hc_mult"),
        hc_sinkhorn_iters=text.get("hc_sinkhorn_iters", 20), hc_eps=text.get("hc_eps", 1e-6), mhc_single_pass=True,
        engram_layers=engram_layers,
        engram_ngram_orders=tuple(range(2, int(text.get("engram_max_ngram_size", 1)) + 1)) if engram_layers else (2, 3, 4),
        engram_num_heads=heads, engram_dim_per_order=int(text.get("engram_head_dim", 0) or 1) * heads,
        engram_table_size=text.get("engram_vocab_size", 16_000_000), engram_pad_id=text.get("engram_pad_token_id", 0),
        engram_fp8_tables=True, fp4_main_kv=True, fp8_swa_kv=True, fp4_indexer=True,
        norm_eps=_need(text, "rms_norm_eps"),
        **_dspark_fields(text),
        **_vision_fields(text),
    )
    cfg = from_mapping(V41Config, to_mapping(fields), "model")
    _check_derived(cfg, text, cand)
    return cfg


def _check_derived(cfg: V41Config, text: dict, cand: int) -> None:
    plan = cfg.plan
    ours = next((s.index for s in plan if s.is_candidate_source), -1)
    if cand >= 0 and ours != cand:
        raise ConfigError(f"config.json: candidate_source_layer_id={cand}, but with {cfg.num_encoder_layers} encoder "
                          f"layers this model's candidate source is layer {ours}")
    if cand >= 0:
        ref = {s.index for s in plan if s.runs_indexer and s.index > cand}
        mine = {s.index for s in plan if s.candidate_source is not None and not s.is_candidate_source}
        if ref != mine:
            raise ConfigError(f"config.json: the reference restricts layers {sorted(ref)} to the candidate pool, "
                              f"this model's plan restricts {sorted(mine)}")
    rows = [int(r) for r in text.get("engram_num_embeddings", [])]
    if rows:
        from megatron_s2.models.v41.engram.hashing import EngramHasher

        hasher = EngramHasher.from_config(cfg)
        derived = [hasher.num_rows(i) for i in cfg.engram_layers]
        if derived != rows:
            raise ConfigError(f"config.json: engram_num_embeddings={rows}, but this model's hash tables for "
                              f"engram_vocab_size={cfg.engram_table_size} have {derived} rows; lookups would "
                              "address different rows")


def config_from_hf(data: dict[str, Any]) -> V41Config:
    """V41Config of a ``config.json`` (ours, the release's nested form, or ModelArgs' flat form)."""
    if not isinstance(data, dict):
        raise ConfigError("config.json: expected a JSON object")
    block = data.get("megatron_s2")
    text = data.get("text_config", data if "megatron_s2" not in data else None)
    if block is not None:
        if int(block.get("format_version", 0)) > FORMAT_VERSION:
            raise ConfigError(f"config.json: megatron_s2 format_version {block.get('format_version')} is newer "
                              f"than this reader ({FORMAT_VERSION})")
        cfg = from_mapping(V41Config, block.get("model"), "megatron_s2.model")
        if text is not None:
            expected = text_config(cfg)
            for key, value in _normalise(text).items():
                if key in expected and expected[key] != value and not (key == "rope_scaling" and not value):
                    raise ConfigError(f"config.json: text_config.{key}={value!r} disagrees with the megatron_s2 "
                                      f"block ({expected[key]!r}); the file was edited by hand")
        return cfg
    if text is None:
        raise ConfigError("config.json: neither a 'megatron_s2' block nor a 'text_config' describes the model")
    return _from_text(text, str(data.get("_name_or_path") or "imported"))
