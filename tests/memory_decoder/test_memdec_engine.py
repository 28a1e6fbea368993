"""The Memory Decoder in the continuous-batching engine (megatron_s2/inference/engine.py with
``memory_decoder=``): the backbone and the memory each run their own family executor and cache over
the same chunks, and every sampled token's distribution equals the full-forward fusion of the same
tokens (MemoryDecoder.full_forward) — batched, with chunked prefill, under preemption, for an
Intern-S2 hybrid backbone and for a V4.1 backbone, with an Intern-S2 memory. Settings the engine
cannot honour with a plug-in are refused with one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import ConfigError, from_mapping
from megatron_s2.inference import InferenceEngine, SamplingParams
from megatron_s2.inference.memory_decoder import MemoryDecoder
from megatron_s2.models.family import family_of
from megatron_s2.models.memory_decoder import MemoryRouter

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"
TOL = dict(rtol=0, atol=1e-5)


def _model(recipe: str, seed: int, **changes):
    raw = {**yaml.safe_load((MODELS / f"{recipe}.yaml").read_text()), **changes}
    cfg = from_mapping(ModelSchema, raw)
    model = family_of(cfg).build_model(cfg)
    model.init_weights(seed)
    return model.eval().requires_grad_(False)


def _plugin(backbone, seed: int = 2) -> MemoryDecoder:
    memory = _model("intern_s2_tiny", seed, name="memdec-tiny", hidden_size=32, layers=2, full_attention_interval=2)
    router = MemoryRouter(backbone.config.hidden_size, memory.config.hidden_size)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a router whose lambda moves with the features (a fresh one is constant)
        router.out.weight.copy_(torch.randn(router.out.weight.shape, generator=g) * 0.3)
    return MemoryDecoder(memory, router.eval())


def _check_against_full_forward(plugin, backbone, prompts, results, logprobs: int):
    """Every generated token: greedy under the fused distribution, its log-prob and top-N those of
    the full-forward fusion of prompt + output."""
    lams = []
    for prompt, r in zip(prompts, results):
        assert r.token_ids, r
        seq = torch.tensor([prompt + r.token_ids])
        ref = plugin.full_forward(backbone, seq)
        rows = ref.fused[0, len(prompt) - 1:-1]
        lams.append(ref.lam[0, len(prompt) - 1:-1])
        assert r.token_ids == rows.argmax(-1).tolist()
        chosen = rows.gather(-1, torch.tensor(r.token_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.logprobs), chosen, **TOL)
        for row, top in zip(rows, r.top_logprobs):
            values, ids = row.topk(logprobs)
            assert [t for t, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, **TOL)
    assert float(torch.cat(lams).std()) > 1e-3  # lambda really varies per token: the mix is not a constant


@pytest.mark.parametrize("backbone_name", ["intern_s2_tiny", "tiny"])
def test_batched_chunked_prefill_equals_full_forward_fusion(backbone_name):
    torch.manual_seed(0)
    backbone = _model(backbone_name, 1)
    plugin = _plugin(backbone)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (13, 5, 21)]
    # three requests decoded together, prompts in chunks of 4 (at most 6 prompt tokens a step)
    config = EngineConfig(max_num_seqs=3, max_model_len=40, prefill_chunk=4, max_prefill_tokens=6, page_tokens=8)
    engine = InferenceEngine(backbone, config, memory_decoder=plugin)
    results = engine.generate(prompts, SamplingParams(max_tokens=7, temperature=0, logprobs=3))
    _check_against_full_forward(plugin, backbone, prompts, results, 3)
    assert engine.memory_executor.admitted == 0 and engine.executor.stats()  # both states released


def test_preempted_requests_recompute_both_caches_and_keep_the_fused_tokens():
    backbone = _model("intern_s2_tiny", 1)
    plugin = _plugin(backbone)
    prompts = [list(range(5, 5 + n)) for n in (20, 18, 22)]
    # 11 usable pages of 4 tokens (each model's pool) for 3 requests growing to ~30 tokens
    engine = InferenceEngine(backbone, EngineConfig(max_num_seqs=3, max_model_len=40, page_tokens=4, num_pages=12,
                                                    prefill_chunk=8, max_prefill_tokens=16), memory_decoder=plugin)
    preempted = []
    real = engine._preempt
    engine._preempt = lambda req: (preempted.append(req.request_id), real(req))
    results = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, logprobs=2))
    assert preempted
    _check_against_full_forward(plugin, backbone, prompts, results, 2)
    assert engine.memory_executor.pool.num_free == engine.executor.pool.num_free == 11


def test_sampling_draws_from_the_fused_distribution_reproducibly():
    """A seeded draw is a function of (seed, position) and the fused distribution: the same tokens
    with the request alone or next to others; the reported log-prob is the fused one."""
    backbone = _model("intern_s2_tiny", 1)
    plugin = _plugin(backbone)
    prompt = list(range(7, 19))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    alone = InferenceEngine(backbone, EngineConfig(max_num_seqs=1, max_model_len=40), memory_decoder=plugin)
    together = InferenceEngine(backbone, EngineConfig(max_num_seqs=2, max_model_len=40, prefill_chunk=4,
                                                      max_prefill_tokens=4), memory_decoder=plugin)
    a = alone.generate([prompt], params)[0]
    b = together.generate([prompt, list(range(30, 45))], [params, SamplingParams(max_tokens=9, temperature=0)])[0]
    assert a.token_ids == b.token_ids
    ref = plugin.full_forward(backbone, torch.tensor([prompt + a.token_ids])).fused[0, len(prompt) - 1:-1]
    chosen = ref.gather(-1, torch.tensor(a.token_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(a.logprobs), chosen, **TOL)


def test_settings_the_engine_cannot_honour_with_a_plugin_are_refused():
    backbone = _model("tiny", 1)
    plugin = _plugin(backbone)
    with pytest.raises(ConfigError, match=r"^speculative: .*memory decoder"):
        InferenceEngine(backbone, EngineConfig(max_model_len=64, speculative=True), memory_decoder=plugin)
    with pytest.raises(ConfigError, match=r"^prefix_caching: .*memory decoder"):
        InferenceEngine(backbone, EngineConfig(max_model_len=64, prefix_caching=True), memory_decoder=plugin)
    engine = InferenceEngine(backbone, EngineConfig(max_model_len=64), memory_decoder=plugin)
    with pytest.raises(ValueError, match=r"^cache_state: .*memory decoder"):
        engine.add_request([3, 4, 5], cache_state={"num_computed": torch.tensor([2])})
    with pytest.raises(ValueError, match=r"^images: .*memory decoder"):
        engine.add_request([3, 4, 5], images=[object()])
    # a plug-in made for another backbone: another width (the router's input), another vocabulary
    other = _model("intern_s2_tiny", 1, hidden_size=48)
    with pytest.raises(ConfigError, match=r"router .* hidden_size"):
        InferenceEngine(other, EngineConfig(max_model_len=64), memory_decoder=plugin)
    wide = _model("intern_s2_tiny", 1, vocab_size=256)
    with pytest.raises(ConfigError, match=r"vocab_size 128, the backbone 256"):
        InferenceEngine(wide, EngineConfig(max_model_len=64), memory_decoder=_plugin(_model("intern_s2_tiny", 1)))
    # same width and vocabulary, but the plug-in records a backbone of another architecture
    shallow = _model("intern_s2_tiny", 1, layers=2, full_attention_interval=2)
    recorded = _plugin(shallow)
    recorded.backbone_config = _model("intern_s2_tiny", 1).config
    with pytest.raises(ConfigError, match=r"^--memory-decoder: .*another architecture"):
        InferenceEngine(shallow, EngineConfig(max_model_len=64), memory_decoder=recorded)


@pytest.mark.parametrize("command, extra, message", [
    ("generate", ["--prompt", "x"], "--memory-decoder: /nonexistent/router does not exist"),
    ("generate", ["--prompt", "x", "--speculative"], "--memory-decoder: cannot be combined with --speculative"),
    ("serve", ["--prefix-caching"], "--memory-decoder: cannot be combined with --prefix-caching"),
    # an empty value (an unset shell variable) must not silently serve the plain backbone
    ("generate", ["--prompt", "x"], "--memory-decoder: empty path"),
    ("serve", [], "--memory-decoder: empty path"),
])
def test_cli_refuses_memory_decoder_flags_in_one_line_before_loading(tmp_path, capsys, command, extra, message):
    from megatron_s2.cli import main

    plugin = ("/nonexistent/router" if "does not exist" in message else "" if "empty path" in message
              else str(tmp_path))
    assert main([command, str(tmp_path / "no-backbone"), "--memory-decoder", plugin, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_server_tokens_logprobs_and_prompt_logprobs_are_the_fused_ones():
    """``serve --memory-decoder``'s engine behind the HTTP server (in-process): the token endpoint's
    greedy tokens, their log-probs and the prompt's log-probs are those of the full-forward fusion."""
    import httpx

    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.serve import ServeConfig, ServerThread, build_state

    backbone = _model("intern_s2_tiny", 1)
    plugin = _plugin(backbone)
    tokenizer = CharTokenizer()
    assert tokenizer.vocab_size <= backbone.config.vocab_size
    state = build_state(backbone, tokenizer, "tiny", ServeConfig(disconnect_poll_s=0.05),
                        EngineConfig(max_num_seqs=2, max_model_len=48, prefill_chunk=4, max_prefill_tokens=8),
                        model_name="tiny", memory_decoder=plugin)
    prompt = [5, 40, 41, 42, 43, 50, 51, 9, 12]
    with ServerThread(state) as server:
        r = httpx.post(f"{server.url}/inference/v1/generate", timeout=120, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 2,
                                                     "prompt_logprobs": 2, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = out["choices"][0]["token_ids"]
    ref = plugin.full_forward(backbone, torch.tensor([prompt + ids])).fused[0]
    got = torch.tensor([e["logprob"] for e in out["choices"][0]["logprobs"]["content"]])
    assert ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()
    torch.testing.assert_close(got, ref[len(prompt) - 1:-1].gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1), **TOL)
    entries = out["prompt_logprobs"]
    assert entries[0] is None
    scored = torch.tensor([entries[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))])
    torch.testing.assert_close(scored, ref[:len(prompt) - 1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1)).squeeze(-1),
                               **TOL)
