"""Accounting from the config alone (megatron_s2.models.v41.accounting, `megatron-s2 account`):
parameter counts agree exactly with instantiated models, and the flagship's KV-cache numbers
follow from §2.4.4 / §4.2.1 by hand (890 bytes per token, the report's abstract).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_s2.models.v41.accounting import account, count_parameters, decode_flops_per_token, kv_bytes
from megatron_s2.models.v41.model import V41Model

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes" / "models"


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- parameter counts against instantiated models -----------------------------------------------
TINY_VARIANTS = {
    "recipe": {},
    "no-sink": dict(attn_sink=False),
    "no-shared-expert": dict(num_shared_experts=0),
    "no-engram": dict(engram_layers=()),
    "no-hierarchical-indexer": dict(candidate_topk_blocks=0),
    "two-streams": dict(hc_mult=2),
    "no-decoder": dict(num_encoder_layers=8),
    "classic-mhc": dict(mhc_single_pass=False),
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_count_matches_tiny_model(tiny_cfg, variant):
    cfg = tiny_cfg.replace(**TINY_VARIANTS[variant])
    counts = count_parameters(cfg)
    assert counts.total == _numel(V41Model(cfg))
    assert counts.total == counts.backbone + counts.engram


def test_count_matches_small_model(small_cfg):
    # construction without initialisation allocates lazily and takes well under a second
    model = V41Model(small_cfg)
    counts = count_parameters(small_cfg)
    assert counts.total == _numel(model)
    engram = sum(p.numel() for n, p in model.named_parameters() if ".engram." in n)
    assert counts.engram == engram
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert counts.moe_routed == routed


@pytest.mark.parametrize("layers, pre, post", [
    (range(4), True, False), (range(4, 8), False, True), (range(2, 6), False, False), ([0, 7], True, True)])
def test_count_matches_pipeline_stages(tiny_cfg, layers, pre, post):
    model = V41Model(tiny_cfg, layers=layers, pre_process=pre, post_process=post)
    assert count_parameters(tiny_cfg, list(layers), pre_process=pre, post_process=post).total == _numel(model)


# ---- flagship KV cache (§2.4.4, §4.2.1) ------------------------------------------------------------------
def test_flagship_global_kv_is_890_bytes_per_token(flagship_cfg):
    # main KV: FP4 E2M1 (0.5 B/value) + one E4M3 byte per 16 channels of the 512-wide latent
    main_entry = 512 / 2 + 512 / 16                     # 288 B
    # index K: MXFP4, E2M1 + one E8M0 byte per 32 of 128 channels
    index_entry = 128 / 2 + 128 / 32                    # 68 B
    # Full layers own the cache: 3 encoder layers at m = 2, one decoder layer at m = 1
    main = 3 * main_entry / 2 + main_entry              # 720 B
    index = 3 * index_entry / 2 + index_entry           # 170 B
    kv = kv_bytes(flagship_cfg)
    assert kv["main_kv_bytes_per_token"] == main == 720
    assert kv["index_k_bytes_per_token"] == index == 170
    assert kv["global_kv_bytes_per_token"] == 890       # report abstract: "890 bytes per token"
    # SWA KV is not persisted (bounded replay, §3.2.1): the persistent cache is the global KV
    assert account(flagship_cfg)["persistent_kv_bytes_per_token"] == 890
    assert (kv["main_kv_format"], kv["index_k_format"]) == ("fp4-e2m1+e4m3/16", "mxfp4-e2m1+e8m0/32")


def test_flagship_swa_state_bytes(flagship_cfg):
    # every layer keeps its own window of 128 FP8 entries (512 B + one scale byte per 32)
    per_entry = 512 + 512 / 32
    assert kv_bytes(flagship_cfg)["swa_state_bytes_per_request"] == 40 * 128 * per_entry == 2_703_360


def test_kv_formats_follow_the_switches(flagship_cfg):
    fp8 = kv_bytes(flagship_cfg.replace(fp4_main_kv=False, fp4_indexer=False, fp8_swa_kv=False))
    assert fp8["main_kv_bytes_per_token"] == 2.5 * (512 + 16)
    assert fp8["index_k_bytes_per_token"] == 2.5 * (128 + 4)
    assert fp8["swa_state_bytes_per_request"] == 40 * 128 * 512 * 2  # bf16
    # FP4 "nearly halves the storage footprint" of the FP8 main KV cache (§2.4.4)
    assert 0.5 < 720 / fp8["main_kv_bytes_per_token"] < 0.6


def test_flagship_activated_parameters(flagship_cfg):
    a = account(flagship_cfg)
    counts = count_parameters(flagship_cfg)
    inactive = counts.moe_routed - counts.moe_routed * 6 // 384
    assert a["activated_params_decode"] == counts.backbone - inactive < a["backbone_params"]
    # CED (§2.2): prefill runs the encoder only, plus the decoder's KV projections
    assert 0.45 < a["activated_params_prefill"] / a["activated_params_decode"] < 0.55
    # the report's totals (552B backbone, 196B Engram, 16B decode / 8B prefill); the slack covers
    # unpublished shapes (vocabulary, projection details), see the closing note of issue 2
    assert abs(a["backbone_params"] / 552e9 - 1) < 0.005
    assert abs(a["engram_params"] / 196e9 - 1) < 0.01
    assert abs(a["activated_params_decode"] / 16e9 - 1) < 0.05
    assert abs(a["activated_params_prefill"] / 8e9 - 1) < 0.05


def test_hierarchical_indexer_bounds_decode_flops(flagship_cfg):
    off = flagship_cfg.replace(candidate_topk_blocks=0)
    # at 4K every Reindex layer's pool (16,384) covers the context: same cost
    assert decode_flops_per_token(flagship_cfg, 4096) == decode_flops_per_token(off, 4096)
    assert decode_flops_per_token(flagship_cfg, 1 << 20) < decode_flops_per_token(off, 1 << 20)
    # with the pool, the per-token growth from 512K to 1M comes from the Full layers only
    grow = decode_flops_per_token(flagship_cfg, 1 << 20) - decode_flops_per_token(flagship_cfg, 1 << 19)
    c = flagship_cfg
    full_scans = 3 * (1 << 19) / 2 + (1 << 19)  # extra entries scored by 3 m=2 and 1 m=1 Full layers
    assert grow == 2 * full_scans * c.index_num_heads * (c.index_head_dim + 1)


# ---- the CLI -----------------------------------------------------------------------------------------
def test_account_cli(flagship_cfg, tiny_cfg, capsys):
    pytest.importorskip("megatron_s2.tools.account", reason="`megatron-s2 account` not in this build")
    from megatron_s2.cli import main

    assert main(["account", f"{RECIPES_DIR}/flagship.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = account(flagship_cfg)
    keys = ["backbone_params", "engram_params", "activated_params_decode", "activated_params_prefill",
            "global_kv_bytes_per_token", "persistent_kv_bytes_per_token", "decode_flops_4k", "decode_flops_1m"]
    for key in keys:
        assert out[key] == want[key], key
    assert out["global_kv_bytes_per_token"] == 890
    assert main(["account", f"{RECIPES_DIR}/tiny.yaml"]) == 0
    text = capsys.readouterr().out
    assert f"{count_parameters(tiny_cfg).backbone:,}" in text
    assert main(["account", f"{RECIPES_DIR}/missing.yaml"]) == 2  # a ConfigError, not a traceback


def test_image_io_criterion_flagship_compute_bound_small_io_bound(capsys):
    """Report §3.1.1: rho < (B_IO/B_GPU)·C. rho of the largest admitted image: flagship 93x93 patches
    of 14 px (1302 px square) behind a 31x31 grid's 994-token span, 3·1302²/994 = 5116 B/token; the
    mm tiny recipe 60 px behind 32 tokens, 337.5 B/token. At 1 GB/s and 400 TFLOP/s per GPU the
    flagship (C ~1.06e11) is compute-bound by ~50x and the tiny one (C ~4.1e6) I/O-bound by ~30x;
    40 GB/s per GPU would hide the tiny one's loading too."""
    from megatron_s2.cli import main

    assert main(["account", f"{RECIPES_DIR}/flagship.yaml", "--json"]) == 0
    flagship = json.loads(capsys.readouterr().out)["image_io_criterion"]
    assert flagship["rho_bytes_per_token"] == pytest.approx(3 * 1302 ** 2 / 994)
    assert flagship["bound_bytes_per_token"] == pytest.approx(1e9 / 400e12 * flagship["flops_per_token"])
    assert flagship["compute_bound"] and flagship["bound_bytes_per_token"] > 40 * flagship["rho_bytes_per_token"]
    tiny_mm = RECIPES_DIR.parent / "pretrain_mm_tiny.yaml"
    assert main(["account", str(tiny_mm), "--json"]) == 0
    tiny = json.loads(capsys.readouterr().out)["image_io_criterion"]
    assert tiny["rho_bytes_per_token"] == 337.5
    assert not tiny["compute_bound"] and tiny["rho_bytes_per_token"] > 20 * tiny["bound_bytes_per_token"]
    assert main(["account", str(tiny_mm), "--io-gbps", "40"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("image I/O criterion") and "B_IO 40 GB/s" in line and line.endswith("compute-bound: "
                                                                                               "loading hides behind compute")
    assert main(["account", f"{RECIPES_DIR}/tiny.yaml"]) == 0
    assert "image I/O criterion" not in capsys.readouterr().out  # no vision tower, no criterion
    assert main(["account", str(tiny_mm), "--gpu-tflops", "0"]) == 2
