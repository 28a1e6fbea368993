"""The DSpark drafter's structure (report §2.4.3): released names and config keys, parameter
accounting, no gradient into the backbone, and the teacher-forced training view."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.v41.accounting import count_parameters, dspark_parameters
from megatron_s2.models.v41.model import build_model
from tests.dspark.conftest import dspark_config


def test_config_refuses_impossible_drafters():
    with pytest.raises(ConfigError, match="dspark_target_layer_ids: layer 8 is outside"):
        dspark_config(dspark_target_layer_ids=[6, 8])
    with pytest.raises(ConfigError, match="dspark_moe_topk"):
        dspark_config(dspark_moe_topk=5)
    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        dspark_config(dspark_noise_token_id=128)


def test_parameter_count_matches_the_built_drafter(dspark_cfg):
    model = build_model(dspark_cfg, seed=0)
    built = sum(p.numel() for p in model.dspark.parameters())
    total, active = dspark_parameters(dspark_cfg)
    assert count_parameters(dspark_cfg).dspark == built == total
    assert count_parameters(dspark_cfg).backbone == sum(p.numel() for n, p in model.named_parameters()
                                                        if not n.startswith(("dspark.", "layers.1.engram",
                                                                             "layers.5.engram")))
    assert active < total


def test_drafter_objective_never_reaches_the_backbone(dspark_cfg):
    model = build_model(dspark_cfg, seed=0)
    model.capture_dspark = True
    tokens = torch.randint(0, 127, (2, 20), generator=torch.Generator().manual_seed(0))
    mb = {"tokens": tokens}
    ctx = model.make_context(mb)
    logits = model(tokens, ctx)
    tf, policy = model.dspark_teacher_forced(logits, mb, ctx)
    (tf.logits.logsumexp(-1).mean() + tf.confidence.mean() - (tf.logits * policy.softmax(-1)).sum(-1).mean()).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("dspark."))
    grads = {n: p.grad for n, p in model.dspark.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]


def test_teacher_forced_blocks_stay_inside_their_document(dspark_cfg):
    model = build_model(dspark_cfg, seed=0)
    model.capture_dspark = True
    tokens = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(1))
    doc = torch.tensor([[0] * 5 + [1] * 7])
    mb = {"tokens": tokens, "doc_ids": doc}
    ctx = model.make_context(mb)
    tf, policy = model.dspark_teacher_forced(model(tokens, ctx), mb, ctx)
    k = dspark_cfg.dspark_block_size
    assert tf.logits.shape == (1, 11, k, 128) and policy.shape == tf.logits.shape
    # anchor 2 (doc 0): positions 3, 4 stay in doc 0, 5 and 6 cross into doc 1
    assert tf.valid[0, 2].tolist() == [True, True, False, False]
    # anchor 9: rows 10, 11 exist, 12 and 13 lie past the sequence
    assert tf.valid[0, 9].tolist() == [True, True, False, False]
    assert tf.target_rows[2].tolist() == [3, 4, 5, 6]
    # a block's drafts depend only on its own document: change doc 1, anchor 2's valid rows keep their logits
    tokens2 = tokens.clone()
    tokens2[0, 7:] = (tokens2[0, 7:] + 1) % 127
    mb2 = {"tokens": tokens2, "doc_ids": doc}
    ctx2 = model.make_context(mb2)
    tf2, _ = model.dspark_teacher_forced(model(tokens2, ctx2), mb2, ctx2)
    torch.testing.assert_close(tf2.logits[0, 1, :2], tf.logits[0, 1, :2], rtol=0, atol=1e-5)  # GEMM batching rounding


def test_release_names_round_trip(dspark_cfg, tmp_path):
    from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state

    state = build_model(dspark_cfg, seed=3).state_dict()
    result = export_model_state(state, dspark_cfg, tmp_path / "hf", progress=False)
    from safetensors.torch import load_file

    names = set()
    for f in result.files:
        names |= set(load_file(f))
    assert not any(n.startswith("dspark") for n in names)
    for name in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.1.norm.weight", "mtp.1.hc_head_fn",
                 "mtp.1.markov_head.markov_w1.weight", "mtp.1.markov_head.markov_w2.weight",
                 "mtp.1.confidence_head.proj.weight", "mtp.0.attn.wkv.weight", "mtp.1.ffn.experts.3.w2.weight",
                 "mtp.0.ffn.gate.weight", "mtp.0.hc_attn_fn"):
        assert name in names, name
    text = json.loads((result.directory / "config.json").read_text())["text_config"]
    assert text["num_nextn_predict_layers"] == 2 and text["dspark_target_layer_ids"] == [5, 6, 7]
    assert text["dspark_n_routed_experts"] == 4 and text["dspark_n_activated_experts"] == 2
    assert len(text["compress_ratios"]) == dspark_cfg.num_layers + 2
    cfg, back = import_model_state(result.directory)
    assert cfg.dspark_layers == 2 and cfg.dspark_noise_token_id == 127 and cfg.dspark_markov_rank == 8
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name].to(t.dtype), t), name
