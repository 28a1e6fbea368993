"""Export -> import of the `tiny` model: tensors bitwise, logits equal, and the failure paths.

Logits are compared on fixed inputs (``verify.fixed_inputs``): max |diff| and
KL(source || converted). A lossless export must reproduce them exactly (0 / 0 measured); a
bfloat16 export keeps KL below 1e-2 (measured ~2e-5).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state, load_hf_checkpoint
from megatron_s2.models.family.mapping_registry import ConversionError
from megatron_s2.checkpoint.hf.safetensors_io import INDEX_FILE
from megatron_s2.checkpoint.hf.verify import (VERIFICATION_FILE, VerificationReport, check_reference_logits,
                                              compare_states, fixed_inputs, logits_divergence, model_logits,
                                              reference_logits)
from tests.hf.conftest import trained_state


@pytest.fixture(scope="module")
def exported(tiny_cfg, tiny_state, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    data, _ = reference_logits(tiny_cfg, tiny_state, lossless=True)
    result = export_model_state(tiny_state, tiny_cfg, out, max_shard_bytes=400_000, progress=False,
                                extra_files={VERIFICATION_FILE: data})
    return result


def test_round_trip_is_bitwise_and_logits_match(tiny_cfg, tiny_state, exported):
    cfg, state = import_model_state(exported.directory)
    assert cfg == tiny_cfg
    report = VerificationReport()
    compare_states(tiny_state, state, None, report)
    assert report.tensors_checked == len(tiny_state) and not report.tensor_mismatches
    ids = fixed_inputs(tiny_cfg)
    max_abs, kl = logits_divergence(model_logits(tiny_cfg, tiny_state, ids), model_logits(cfg, state, ids))
    print(f"tiny lossless round trip: max |logit diff| {max_abs:.3e}, KL {kl:.3e}")
    assert max_abs == 0.0 and kl == 0.0
    check, why = check_reference_logits(cfg, state, exported.directory)
    assert why is None and check.passed and check.max_abs_diff == 0.0


def test_sharded_files_and_index(exported):
    directory = exported.directory
    index = json.loads((directory / INDEX_FILE).read_text())
    files = sorted(directory.glob("model-*.safetensors"))
    assert len(files) == len(exported.files) > 1
    assert set(index["weight_map"].values()) == {f.name for f in files}
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "layers.4.ffn.gate.bias_vl" in tensors  # trained: differs from the text bias
    assert tensors["layers.0.ffn.experts.7.w2.weight"].shape == (64, 32)
    assert exported.elided == []


def test_untrained_model_exports_reference_names_only(tiny_cfg, tmp_path):
    from megatron_s2.models.v41.model import build_model

    state = build_model(tiny_cfg, seed=1).state_dict()
    result = export_model_state(state, tiny_cfg, tmp_path / "hf", progress=False)
    assert sorted(result.elided) == sorted(n for n in state if n.endswith("image_expert_bias"))
    cfg, state2, report = load_hf_checkpoint(result.directory, progress=False)
    assert {ours for ours, _ in report.fallbacks} == set(result.elided)
    assert all(torch.equal(state[n], state2[n]) for n in state)


def test_bfloat16_export(tiny_cfg, tiny_state, tmp_path):
    result = export_model_state(tiny_state, tiny_cfg, tmp_path / "bf16", dtype="bfloat16", progress=False)
    raw = {}
    for f in result.files:
        raw.update(load_file(f))
    assert raw["layers.0.attn.wq_b.weight"].dtype == torch.bfloat16
    assert raw["layers.0.hc_attn_fn"].dtype == torch.float32 and raw["layers.0.ffn.gate.bias"].dtype == torch.float32
    cfg, state = import_model_state(result.directory)
    report = VerificationReport()
    compare_states(tiny_state, state, torch.bfloat16, report)
    assert not report.tensor_mismatches
    ids = fixed_inputs(tiny_cfg)
    max_abs, kl = logits_divergence(model_logits(tiny_cfg, tiny_state, ids), model_logits(cfg, state, ids))
    print(f"tiny bfloat16 export: max |logit diff| {max_abs:.3e}, KL {kl:.3e}")
    assert 0 < kl < 1e-2


def _rewrite(directory, name, fn):
    """Apply ``fn`` to the tensor ``name`` inside its shard, in place."""
    index = json.loads((directory / INDEX_FILE).read_text())
    path = directory / index["weight_map"][name]
    tensors = load_file(path)
    tensors = fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_verification_catches_a_corrupted_tensor(exported, tmp_path):
    bad = _copy(exported.directory, tmp_path / "bad")

    def flip(t):
        w = t["layers.2.attn.wq_b.weight"].clone()
        w[:, 0] = -w[:, 0]  # a plausible-looking tensor with the wrong values
        t["layers.2.attn.wq_b.weight"] = w
        return t

    _rewrite(bad, "layers.2.attn.wq_b.weight", flip)
    cfg, state = import_model_state(bad)
    check, _ = check_reference_logits(cfg, state, bad)
    assert not check.passed and check.max_abs_diff > 1e-3


def test_missing_unknown_and_misshapen_tensors_are_refused(exported, tmp_path):
    missing = _copy(exported.directory, tmp_path / "missing")
    _rewrite(missing, "layers.3.ffn.experts.5.w1.weight",
             lambda t: {k: v for k, v in t.items() if k != "layers.3.ffn.experts.5.w1.weight"})
    # the index still lists it: drop it there too, as a hand-edited checkpoint would
    index = json.loads((missing / INDEX_FILE).read_text())
    del index["weight_map"]["layers.3.ffn.experts.5.w1.weight"]
    (missing / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"layers.3.mlp.experts.w1 <- layers.3.ffn.experts.5.w1.weight"):
        import_model_state(missing)

    unknown = _copy(exported.directory, tmp_path / "unknown")
    _rewrite(unknown, "embed.weight", lambda t: {**t, "layers.0.attn.extra_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ConversionError, match="extra_proj"):
        import_model_state(unknown)

    shape = _copy(exported.directory, tmp_path / "shape")
    _rewrite(shape, "layers.1.attn.wkv.weight", lambda t: {**t, "layers.1.attn.wkv.weight": torch.zeros(16, 64)})
    with pytest.raises(ConversionError, match=r"layers.1.attention.linear_kv.weight: the checkpoint gives shape \(16, 64\)"):
        import_model_state(shape)


def test_export_refuses_partial_state_and_existing_directory(tiny_cfg, tiny_state, exported, tmp_path):
    shard = dict(tiny_state)
    shard["layers.0.attention.linear_q_up.weight"] = shard["layers.0.attention.linear_q_up.weight"][:64]
    with pytest.raises(ConversionError, match="a shard, not the full tensor"):
        export_model_state(shard, tiny_cfg, tmp_path / "x", progress=False)
    with pytest.raises(FileExistsError):
        export_model_state(tiny_state, tiny_cfg, exported.directory, progress=False)
    assert not (tmp_path / "x").exists()


def test_nonzero_engram_padding_is_refused(tiny_cfg, tmp_path):
    state = trained_state(tiny_cfg)
    state["layers.1.engram.table.weight"][-1] = 1.0
    with pytest.raises(ValueError, match="padding rows"):
        export_model_state(state, tiny_cfg, tmp_path / "pad", progress=False)
