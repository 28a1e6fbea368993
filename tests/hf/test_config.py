"""config.json <-> V41Config: lossless round trip, release spellings, refusals."""

from __future__ import annotations

import json

import pytest

from megatron_s2.models.v41.hf.config_json import MODELARGS_ALIASES, config_from_hf, config_to_hf
from megatron_s2.config.schema import ConfigError
from tests.hf.conftest import load_model


@pytest.mark.parametrize("model", ["tiny", "small", "flagship"])
def test_round_trip_is_lossless(model):
    cfg = load_model(model)
    data = json.loads(json.dumps(config_to_hf(cfg, "bfloat16")))
    assert data["architectures"] == ["DeepseekV41ForCausalLM"] and data["text_config"]["num_hidden_layers"] == cfg.num_layers
    assert config_from_hf(data) == cfg


@pytest.mark.parametrize("model", ["tiny", "small", "flagship"])
def test_architecture_from_text_config_alone(model):
    """Without our block the plan (modes, ratios, encoder, candidate source, Engram) is rebuilt
    from the reference's per-layer lists; flat ModelArgs spelling gives the same config."""
    cfg = load_model(model)
    text = config_to_hf(cfg, "float32")["text_config"]
    text.pop("num_encoder_layers")  # the release does not state it: derived from the candidate source
    derived = config_from_hf({"text_config": text})
    assert derived.plan.summary() == cfg.plan.summary()
    same = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "index_topk",
            "candidate_topk_blocks", "moe_topk", "engram_layers", "engram_ngram_orders", "engram_dim_per_order",
            "engram_table_size", "norm_eps", "hc_mult", "swiglu_limit")
    assert {k: getattr(derived, k) for k in same} == {k: getattr(cfg, k) for k in same}
    inverse = {v: k for k, v in MODELARGS_ALIASES.items()}
    flat = {inverse.get(k, k): v for k, v in text.items() if k != "rope_scaling"}
    rope = text["rope_scaling"]
    flat.update(rope_factor=rope["factor"], original_seq_len=rope["original_max_position_embeddings"], beta_fast=32,
                beta_slow=1)
    assert config_from_hf(flat) == derived


def test_edited_config_is_refused():
    data = config_to_hf(load_model("tiny"), "float32")
    data["text_config"]["hidden_size"] = 96
    with pytest.raises(ConfigError, match=r"text_config.hidden_size=96 disagrees"):
        config_from_hf(data)


@pytest.mark.parametrize("edit, message", [
    ({"gate_temp": 2.0}, "gate_temp=2.0 is not supported"),
    ({"engram_num_embeddings": [1000, 1000]}, "lookups would address different rows"),
    ({"candidate_source_layer_id": 1}, r"layer 4 \(full, m=1\) is a Full layer inside the decoder"),
    ({"candidate_source_layer_id": 6, "num_encoder_layers": 4}, "candidate_source_layer_id=6, but with 4 encoder"),
    ({"compress_ratios": [0, 2, 2]}, "compress_ratios lists 3 layers"),
])
def test_unrepresentable_release_configs_are_refused(edit, message):
    text = config_to_hf(load_model("tiny"), "float32")["text_config"]
    text.pop("num_encoder_layers")
    text.update(edit)
    with pytest.raises(ConfigError, match=message):
        config_from_hf({"text_config": text})
