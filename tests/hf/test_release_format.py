"""Import of a checkpoint in the released DeepSeek-V4.1-Flash format.

The fixture writes `tiny` the way the release stores it (reference ``inference/model.py``):
a flat ``config.json`` in ``ModelArgs`` spelling (no ``megatron_s2`` block, no num_encoder_layers:
the encoder is derived from ``candidate_source_layer``), FP8 E4M3 linear weights with E8M0
32x32 block scales, FP4 (packed E2M1) routed experts with one E8M0 scale per 32 inputs, the
Engram table in FP8 with per-row scales, other weights in bfloat16, no ``bias_vl``, plus drafter (``mtp.*``) and vision tensors that the backbone skips.
The imported state must equal the dequantised values bitwise, so the logits equal those of
the model holding exactly the released weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_s2.models.v41.hf.context import ConversionContext
from megatron_s2.checkpoint.hf.convert import load_hf_checkpoint
from megatron_s2.checkpoint.hf.quant import dequantize, quantize_fp4, quantize_fp8
from megatron_s2.models.v41.hf.mapping import V41_REGISTRY
from megatron_s2.checkpoint.hf.verify import fixed_inputs, logits_divergence, model_logits
from tests.hf.conftest import load_model, trained_state

FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight", "indexer.wq_b.weight",
       "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight", "engram.wkv.weight")
FP32 = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "attn_sink",
        "gate.bias", "compressor.wkv.weight", "compressor.wgate.weight")


def modelargs_config(cfg) -> dict:
    """The release's inference/config.json spelling (ModelArgs field names)."""
    plan = cfg.plan
    from megatron_s2.models.v41.engram.hashing import EngramHasher

    hasher = EngramHasher.from_config(cfg)
    return {
        "vocab_size": cfg.vocab_size, "dim": cfg.hidden_size, "moe_inter_dim": cfg.moe_ffn_hidden_size,
        "n_layers": cfg.num_layers, "n_mtp_layers": 1, "n_heads": cfg.num_attention_heads,
        "n_routed_experts": cfg.num_routed_experts, "n_shared_experts": 1, "n_activated_experts": cfg.moe_topk,
        "score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "route_scale": 1.0,
        "swiglu_limit": cfg.swiglu_limit, "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.head_dim,
        "rope_head_dim": cfg.rope_head_dim, "norm_eps": cfg.norm_eps, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "window_size": cfg.window_size,
        "compress_ratios": [s.compress_ratio for s in plan] + [0],
        "kv_source_layers": [s.index for s in plan if s.mode.value == "full"],
        "index_source_layers": [s.index for s in plan if s.runs_indexer],
        "compress_rope_theta": cfg.compress_rope_theta, "original_seq_len": 0, "rope_theta": cfg.rope_theta,
        "rope_factor": 40, "beta_fast": 32, "beta_slow": 1,
        "index_n_heads": cfg.index_num_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "candidate_source_layer": next(s.index for s in plan if s.is_candidate_source),
        "candidate_topk_blocks": cfg.candidate_topk_blocks, "candidate_block_size": cfg.candidate_block_size,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "engram_layer_ids": list(cfg.engram_layers),
        "engram_num_embeddings": [hasher.num_rows(i) for i in cfg.engram_layers],
        "engram_max_ngram_size": cfg.engram_max_ngram, "engram_vocab_size": cfg.engram_table_size,
        "engram_n_heads": cfg.engram_num_heads, "engram_head_dim": cfg.engram_head_dim,
        "engram_pad_id": cfg.engram_pad_id, "dtype": "fp8", "expert_dtype": "fp4", "scale_fmt": "ue8m0",
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    # the reference runs the quantisation-aware paths at inference: the imported config has them on
    cfg = load_model("tiny", fp4_main_kv=True, fp8_swa_kv=True, fp4_indexer=True, engram_fp8_tables=True)
    state = trained_state(cfg, seed=11)
    # the release has no bias_vl: make ours equal to its substitute
    for name in list(state):
        if name.endswith("image_expert_bias"):
            state[name] = state[name.replace("image_expert_bias", "expert_bias")].clone()
    views, elided = V41_REGISTRY.export_views(state, ConversionContext(cfg))
    assert len(elided) == 8
    files, values = {}, {}
    for name, (view, _) in views.items():
        w = view.float()
        if ".experts." in name and ".shared_experts." not in name:
            q, s = quantize_fp4(w)
        elif name.endswith(FP8):
            q, s = quantize_fp8(w)
        elif name.endswith("engram.embed.weight"):
            q, s = quantize_fp8(w, row_block=1)
        else:
            q, s = (w if name.endswith(FP32) else w.to(torch.bfloat16)), None
        files[name] = q
        values[name] = dequantize(q, s) if s is not None else q.float()
        if s is not None:
            files[name[: -len("weight")] + "scale"] = s
    files["mtp.0.attn.wq_a.weight"] = torch.zeros(cfg.q_lora_rank, cfg.hidden_size, dtype=torch.bfloat16)
    files["vision.blocks.0.attn.wqkv.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    files["image_start"] = torch.zeros(cfg.hidden_size, dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("release")
    names = sorted(files)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: files[n].contiguous() for n in part}, out / file)
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(modelargs_config(cfg)))
    # the state a model holding exactly the released weights has (dequantised, float32)
    expected = {}
    for name, t in state.items():
        mapping, bindings = V41_REGISTRY.resolve(name)
        hf = mapping.hf_names(bindings, ConversionContext(cfg))
        if name in elided:
            hf = [mapping.fallback.hf.format(**bindings)]
            expected[name] = values[hf[0]]
        else:
            expected[name] = mapping.from_hf({n: values[n] for n in hf}, bindings, ConversionContext(cfg), t.shape)
    return cfg, out, expected


def test_release_imports_exactly(release):
    cfg, directory, expected = release
    got_cfg, state, report = load_hf_checkpoint(directory, progress=False)
    assert got_cfg.plan.summary() == cfg.plan.summary()
    assert got_cfg.num_encoder_layers == 4 and got_cfg.fp4_main_kv and got_cfg.fp4_indexer and got_cfg.fp8_swa_kv
    assert (report.dequantized, report.skipped) == (8 * 3 * 8 + 8 * 7 + 4 + 2 * 2, {"mtp.": 1, "vision.": 1, "image_start": 1})
    assert {o for o, _ in report.fallbacks} == {n for n in state if n.endswith("image_expert_bias")}
    for name, t in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], t.float()), name
    ids = fixed_inputs(cfg)
    max_abs, kl = logits_divergence(model_logits(got_cfg, expected, ids), model_logits(got_cfg, state, ids))
    assert max_abs == 0.0 and kl == 0.0


def test_release_with_a_later_decoder_full_layer_is_refused(release, tmp_path):
    """A decoder Full layer compresses its own attention input; only the first decoder layer's
    input is H_(L/2) (CED, §2.2), so a plan with a later one is refused by the layer plan."""
    cfg, directory, _ = release
    import shutil

    bad = shutil.copytree(directory, tmp_path / "bad")
    conf = json.loads((bad / "config.json").read_text())
    conf["candidate_source_layer"] = 4
    conf["num_encoder_layers"] = 2  # layers 2.. are decoder: layer 4 is Full but not the first decoder layer
    (bad / "config.json").write_text(json.dumps(conf))
    from megatron_s2.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"layer 4 \(full, m=1\) is a Full layer inside the decoder"):
        load_hf_checkpoint(bad, progress=False)
