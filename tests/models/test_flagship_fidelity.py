"""recipes/models/flagship.yaml states the released DeepSeek-V4.1-Flash configuration.

Source of the values below: the released model's ``config.json`` (``text_config``), as
reproduced by public fixtures of DeepSeek-V4.1-Flash (e.g. test fixtures of ports that parse
the release: ``compress_rope_theta: 160000``, ``rope_scaling: {rope_type: yarn, factor: 16,
original_max_position_embeddings: 65536}``, ``routed_scaling_factor: 1.5``,
``engram_pad_token_id: 2``, ``rms_norm_eps: 1e-20``). Where the reference inference code's
``ModelArgs`` defaults differ (40000, no YaRN / factor 40, 1.0, 0), the release wins: an
imported release checkpoint must give the same logits as our model built from the recipe.
"""

from __future__ import annotations

import json

import pytest

from megatron_s2.models.v41.hf.config_json import config_from_hf, config_to_hf

# (config.json text_config key, its released value, our V41Config field)
RELEASED = [
    ("compress_rope_theta", 160000, "compress_rope_theta"),
    ("rope_scaling.original_max_position_embeddings", 65536, "rope_scaling_original_seq_len"),
    ("rope_scaling.factor", 16, "rope_scaling_factor"),
    ("routed_scaling_factor", 1.5, "moe_route_scale"),
    ("engram_pad_token_id", 2, "engram_pad_id"),
    ("rope_theta", 10000, "rope_theta"),
    ("rms_norm_eps", 1e-20, "norm_eps"),
    ("vocab_size", 129280, "vocab_size"),
    ("hidden_size", 5120, "hidden_size"),
    ("moe_intermediate_size", 2304, "moe_ffn_hidden_size"),
    ("n_routed_experts", 384, "num_routed_experts"),
    ("num_experts_per_tok", 6, "moe_topk"),
    ("swiglu_limit", 10.0, "swiglu_limit"),
    ("sliding_window", 128, "window_size"),
    ("index_n_heads", 32, "index_num_heads"),
    ("index_topk", 512, "index_topk"),
    ("candidate_topk_blocks", 2048, "candidate_topk_blocks"),
    ("candidate_block_size", 8, "candidate_block_size"),
    ("hc_sinkhorn_iters", 20, "hc_sinkhorn_iters"),
    ("engram_vocab_size", 16000000, "engram_table_size"),
]


@pytest.mark.parametrize("key, released, field", RELEASED, ids=[r[0] for r in RELEASED])
def test_flagship_states_the_released_value(flagship_cfg, key, released, field):
    assert getattr(flagship_cfg, field) == released


def test_flagship_exports_the_released_text_config(flagship_cfg):
    text = config_to_hf(flagship_cfg, "bfloat16")["text_config"]
    for key, released, _ in RELEASED:
        node = text
        for part in key.split("."):
            node = node[part]
        assert node == released, key
    assert text["rope_scaling"]["rope_type"] == "yarn"


def test_importing_the_released_values_gives_the_flagship(flagship_cfg):
    """A release-style text_config (no megatron_s2 block) carrying these values rebuilds the
    flagship recipe's values (the plan is derived from the per-layer lists)."""
    text = json.loads(json.dumps(config_to_hf(flagship_cfg, "bfloat16")["text_config"]))
    text.pop("num_encoder_layers")
    imported = config_from_hf({"text_config": text})
    for _, released, field in RELEASED:
        assert getattr(imported, field) == released, field
    assert imported.plan.summary() == flagship_cfg.plan.summary()
