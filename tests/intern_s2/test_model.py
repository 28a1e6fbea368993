"""The Intern-S2 family against its public reference (issue 23, "Conversion and fidelity" and
"Inference"): a random ``Qwen3_5MoeForCausalLM`` saved by ``transformers`` imports into our model
and gives the reference's logits to fp32 round-off; the released multimodal layout imports the
same text weights (vision tower and MTP head skipped, and said so); the engine's chunked prefill
and one-token decode (conv + recurrent state per Gated DeltaNet layer, paged KV for the
attention layers) equal the full forward, and greedy generation equals ``transformers``'
``generate`` token for token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_s2.checkpoint.hf.convert import load_hf_checkpoint
from megatron_s2.models.family import family_of
from tests.intern_s2.conftest import ExecutorRequest, incremental_logits

IDS = torch.randint(0, 128, (2, 45), generator=torch.Generator().manual_seed(5))


def _ours(hf_dir):
    cfg, state, report = load_hf_checkpoint(hf_dir, progress=False)
    model = family_of(cfg).build_model(cfg).eval()
    model.load_state_dict(state, strict=True)
    return cfg, model, report


def test_imported_model_computes_the_references_logits(hf_reference):
    reference, path = hf_reference
    cfg, model, report = _ours(path)
    assert cfg.family == "intern_s2" and cfg.mixers == ("linear_attention",) * 3 + ("full_attention",)
    assert report.skipped == {}
    with torch.no_grad():
        want, got = reference(IDS).logits, model(IDS)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_released_multimodal_layout_imports_the_same_text_model(hf_reference, tmp_path):
    """The released checkpoints nest the text config and prefix the text tensors with
    ``model.language_model.``; vision and MTP tensors are skipped with a count."""
    _, path = hf_reference
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    renamed = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
               for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    release = tmp_path / "release"
    release.mkdir()
    save_file(renamed, release / "model.safetensors")
    (release / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "architectures": [
        "Qwen3_5MoeForConditionalGeneration"], "text_config": {**config, "model_type": "qwen3_5_moe_text"},
        "vision_config": {"depth": 1}}))
    cfg, text_state, _ = load_hf_checkpoint(path, progress=False)
    cfg2, release_state, report = load_hf_checkpoint(release, progress=False)
    assert cfg2.replace(name=cfg.name) == cfg
    assert report.skipped == {"model.visual.": 1, "mtp.": 1}
    assert all(torch.equal(release_state[k], text_state[k]) for k in text_state)


def test_chunked_prefill_and_decode_equal_the_full_forward(hf_reference):
    """Two requests of different lengths batched together (ragged rows), prefill in chunks of 7
    then one token at a time, against the full forward's logits at every position."""
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.models.family.engine import Chunk

    cfg, model, _ = _ours(hf_reference[1])
    executor = family_of(cfg).executor(model, EngineConfig(max_num_seqs=2, max_model_len=64, page_tokens=4),
                                       torch.device("cpu"))
    seqs = [IDS[0, :40].tolist(), IDS[1, :23].tolist()]
    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]
    got, requests = incremental_logits(executor, seqs, prompt_lens=[12, 9], chunk=7)
    for i in range(2):
        err = (got[i] - full[i]).abs().max() / full[i].abs().max()
        assert err < 1e-5, (i, float(err))
    # the state of a request exports and restores exactly: continuing from it gives the same logits
    state = executor.export_state(requests[1])
    twin = ExecutorRequest(seqs[1] + [7])
    executor.import_state(twin, state)
    requests[1].tokens = seqs[1] + [7]
    (a,), (b,) = (executor.forward([Chunk(r, len(seqs[1]), 1, "last")]) for r in (requests[1], twin))
    assert torch.equal(a.logits, b.logits)


@pytest.mark.slow
def test_engine_greedy_generation_equals_transformers_generate(hf_reference):
    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams

    reference, path = hf_reference
    _, model, _ = _ours(path)
    prompts = [IDS[0, :9].tolist(), IDS[1, :17].tolist(), IDS[0, 20:24].tolist()]
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, page_tokens=4, prefill_chunk=6))
    results = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        assert result.token_ids == theirs[0, len(prompt):].tolist()


def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(hf_reference, tmp_path):
    """Our checkpoint -> Hugging Face folder (fused in_proj_qkv / conv1d, per-expert tensors) ->
    ``Qwen3_5MoeForCausalLM.from_pretrained``: the reference's logits again; importing the export
    gives back every tensor bit for bit."""
    from transformers import Qwen3_5MoeForCausalLM

    from megatron_s2.checkpoint.hf.convert import export_model_state

    reference, path = hf_reference
    cfg, state, _ = load_hf_checkpoint(path, progress=False)
    export_model_state(state, cfg, tmp_path / "export", progress=False)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["megatron_s2"]["model"]["family"] == "intern_s2"
    loaded = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)
    _, back, _ = load_hf_checkpoint(tmp_path / "export", progress=False)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    # the export without our block (as a third party would strip it) reads the same model
    del config["megatron_s2"]
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    cfg2, again, _ = load_hf_checkpoint(tmp_path / "export", progress=False)
    assert cfg2.replace(name=cfg.name) == cfg and all(torch.equal(again[k], state[k]) for k in state)


@pytest.mark.slow
def test_preempted_requests_recompute_their_state_and_finish_as_if_alone(hf_reference):
    """A page pool too small for every request at once: the scheduler preempts, the executor
    frees and later rebuilds the request's recurrent state and pages, and each greedy
    continuation equals the one the request gets with the engine to itself."""
    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams

    _, model, _ = _ours(hf_reference[1])
    prompts = [IDS[0, :14].tolist(), IDS[1, :11].tolist(), IDS[0, 25:37].tolist()]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tight = InferenceEngine(model, EngineConfig(max_num_seqs=3, max_model_len=32, page_tokens=4, num_pages=12,
                                                prefill_chunk=8))
    preempted, preempt = [], tight._preempt
    tight._preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    together = tight.generate(prompts, params)
    assert preempted, "the pool was meant to be too small for all three requests"
    for prompt, result in zip(prompts, together):
        alone = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=32, page_tokens=4))
        assert result.token_ids == alone.generate([prompt], params)[0].token_ids


def test_speculative_decoding_is_refused_without_a_drafter(hf_reference):
    """The family has no speculative drafter: ``speculative`` is a one-line configuration error at
    engine construction, not a failure in the first decode step."""
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.inference import EngineConfig, InferenceEngine

    _, model, _ = _ours(hf_reference[1])
    with pytest.raises(ConfigError, match="speculative: the intern_s2 model family has no speculative drafter"):
        InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=32, page_tokens=4, speculative=True))
