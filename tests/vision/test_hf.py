"""Hugging Face conversion of the vision pathway: names and shapes against the independent
restatement of the reference's (``tests/hf/test_mapping.py::reference_vision_tensors``), export
-> import round trip, and a vision release read into a text-only config (skipped, reported)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state, load_hf_checkpoint
from megatron_s2.models.v41.model import build_model
from tests.hf.test_mapping import reference_tensors, reference_vision_tensors, table_tensors


def test_names_and_shapes_match_the_reference(vision_cfg):
    ours, ref = table_tensors(vision_cfg), reference_tensors(vision_cfg)
    vision = reference_vision_tensors(vision_cfg)
    assert len(vision) == 3 + 8 * vision_cfg.vision_n_layers + 4 + 3
    assert {n: s for n, s in ours.items() if n in vision} == vision
    assert set(ours) - {n for n in ours if n.endswith("ffn.gate.bias_vl")} == set(ref)


def test_export_import_round_trip(vision_cfg, tmp_path):
    state = build_model(vision_cfg, seed=5).state_dict()
    result = export_model_state(state, vision_cfg, tmp_path / "hf", progress=False)
    names = set()
    for f in result.files:
        names |= set(load_file(f))
    assert {"vision.blocks.1.attn.wqkv.bias", "vision.patch_embed.proj.weight", "aligner.w1.weight",
            "aligner.w2.bias", "image_newline"} <= names
    assert not any(n.startswith("vision.tower") for n in names)
    text = json.loads((result.directory / "config.json").read_text())["text_config"]
    assert (text["vision_n_layers"], text["vision_patch_size"], text["image_token_id"]) == (2, 4, 100)
    assert text["vision_max_wh_ratio"] is None
    cfg, back = import_model_state(result.directory)
    assert cfg == vision_cfg and set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name].to(t.dtype), t), name


def test_vision_release_into_a_text_only_config_is_skipped_and_reported(vision_cfg, tmp_path):
    state = build_model(vision_cfg, seed=5).state_dict()
    result = export_model_state(state, vision_cfg, tmp_path / "hf", progress=False)
    path = result.directory / "config.json"
    data = json.loads(path.read_text())
    data.pop("megatron_s2")  # the release's own form: text_config only
    data["text_config"]["vision_n_layers"] = 0
    path.write_text(json.dumps(data))
    cfg, text_state, report = load_hf_checkpoint(result.directory, progress=False)
    assert cfg.vision_n_layers == 0 and not any(n.startswith("vision.") for n in text_state)
    assert report.skipped["vision."] == 3 + 8 * vision_cfg.vision_n_layers and report.skipped["aligner."] == 4
    assert report.skipped["image_start"] == report.skipped["image_newline"] == 1
