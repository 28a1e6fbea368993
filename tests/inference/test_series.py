"""Series in the engine (Intern-S2 report §2.2.1-§2.2.2; walkthrough §2.2.2 "through the engine
and serve"): the encoder's tokens inserted at the placeholder spans during chunked prefill, the
prefix cache keyed on series content, and the numerical forecast from the engine's own prompt
hidden states.

* Incremental decode of a prompt with two series — chunks cutting through the spans — gives the
  whole-sequence forward's logits (``embed(ids, series=)``) at every position, fp32, 1e-5, for
  both families (V4.1 ``tiny`` and ``intern_s2_tiny`` with ``model.timeseries``).
* Prefix caching (V4.1): the same series shares cached pages; the same placeholders with other
  values never do, and the answer stays the full forward's.
* ``forecast=`` returns, with the text, the de-normalised numbers ``predict.forecast`` computes
  out of the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import from_mapping
from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
from megatron_s2.inference.request import Request
from megatron_s2.models.family import family_of
from megatron_s2.models.family.engine import Chunk
from megatron_s2.models.timeseries.encoder import SeriesInput
from megatron_s2.models.timeseries.forecaster import ForecastBranch
from megatron_s2.models.timeseries.insertion import SeriesPlacement
from megatron_s2.models.timeseries.predict import forecast

RTOL = 1e-5
MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"
LANE = {"hidden": 32, "heads": 2, "token_budget": 16, "queries_per_patch": 4, "forecast_context": 32,
        "max_horizon": 16, "forecast_queries": 4, "forecast_layers": 1}


def lane_model(name: str, seed: int = 0, timeseries: bool = True, **changes):
    raw = {**yaml.safe_load((MODELS / f"{name}.yaml").read_text()), **changes}
    if timeseries:
        raw["timeseries"] = LANE
    cfg = from_mapping(ModelSchema, raw)
    torch.manual_seed(seed)
    model = family_of(cfg).build_model(cfg)
    model.init_weights(seed)
    if timeseries:  # the forecasting branch a timeseries_forecast run trains (default init is enough here)
        model.forecaster = ForecastBranch(cfg.timeseries, cfg.hidden_size)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["tiny", "intern_s2_tiny"])
def model(request):
    return lane_model(request.param)


def placeholder(model) -> int:
    return model.config.timeseries.placeholder_id(model.config.vocab_size)


def text(n: int, seed: int) -> list[int]:
    return torch.randint(5, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def series(channels: int, steps: int, seed: int, rate: float | None = 4.0) -> SeriesInput:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(steps, dtype=torch.float32)
    values = 10 * seed + torch.sin(t / (3 + seed))[None] * torch.arange(1, channels + 1)[:, None]
    return SeriesInput(values + 0.1 * torch.randn(channels, steps, generator=g), rate)


def two_series_prompt(model):
    ph = placeholder(model)
    prompt = text(3, 1) + [ph] + text(5, 2) + [ph] + text(4, 3)
    return prompt, [series(2, 40, 1), series(3, 70, 2, rate=None)]


def full_logits(model, tokens, spans):
    ids = torch.tensor([tokens])
    placements = [[SeriesPlacement(s.start, s.data) for s in spans]]
    with torch.no_grad():
        hidden = model.run_layers(model.embed(ids, series=placements), model.make_context({"tokens": ids}))
        return model.head(*hidden)[0]


def incremental_logits(model, tokens, spans, prompt_len, chunk):
    ex = family_of(model.config).executor(model, EngineConfig(max_num_seqs=1, max_model_len=256, page_tokens=8),
                                          torch.device("cpu"))
    req = Request("r", tokens, SamplingParams(), torch.Generator(), 0, series=spans)
    ex.admit(req)
    out = []
    while req.num_computed < len(tokens):
        n = min(chunk, prompt_len - req.num_computed) if req.num_computed < prompt_len else 1
        [res] = ex.forward([Chunk(req, req.num_computed, n, "all")])
        req.num_computed += n
        ex.after_forward(req)
        out.append(res.logits)
    ex.release(req)
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [3, 7])
def test_incremental_decode_with_series_equals_the_full_forward(model, chunk):
    prompt, inputs = two_series_prompt(model)
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, page_tokens=8))
    tokens, spans = engine.prepare_series(prompt, inputs)
    assert [s.length for s in spans] == [16, 16] and tokens.count(placeholder(model)) == 32
    assert all(s.start // chunk != (s.end - 1) // chunk for s in spans)  # chunks cut through every span
    seq = tokens + text(6, 99)  # the prompt, then six teacher-forced decode steps
    got = incremental_logits(model, seq, spans, len(tokens), chunk)
    ref = full_logits(model, seq, spans)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, f"max |decode - forward| / max |forward| = {err:.2e}"
    text_only = full_logits(model, seq, [])
    assert (text_only - ref).abs().max() / ref.abs().max() > 100 * RTOL  # the series really enter


def run(engine, prompt, inputs, max_tokens=4, horizons=None):
    handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), series=inputs,
                           forecast=horizons)
    while engine.has_work():
        engine.step()
    return handle.prompt_token_ids, handle.result()


def test_forecast_through_the_engine_equals_predict_forecast(model):
    prompt, inputs = two_series_prompt(model)
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=2, max_model_len=256, prefill_chunk=5,
                                                 max_prefill_tokens=5, page_tokens=8))
    tokens, result = run(engine, prompt, inputs, horizons=[8, 5])
    _, spans = engine.prepare_series(prompt, inputs)
    placements = [[SeriesPlacement(s.start, s.data) for s in spans]]
    ref = forecast(model, torch.tensor([tokens]), placements, [[(0, len(tokens) - 1)] * 2], [8, 5])
    assert [tuple(f.shape) for f in result.forecast] == [(2, 8), (3, 5)]
    for got, want in zip(result.forecast, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the text is the full forward's greedy continuation, forecast or not
    logits = full_logits(model, tokens + result.token_ids, spans)[len(tokens) - 1:-1]
    assert result.token_ids == logits.argmax(-1).tolist()
    _, plain = run(engine, prompt, inputs)
    assert plain.forecast is None and plain.token_ids == result.token_ids


def test_batched_forecast_requests_each_get_their_own_numbers(model):
    """Two forecast requests prefilled in the same steps (other series, other horizons) and a text
    one beside them: each forecast is its own prompt's ``predict.forecast``."""
    prompt, inputs = two_series_prompt(model)
    other = [series(1, 30, 5), series(2, 90, 6)]
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=3, max_model_len=256, prefill_chunk=6,
                                                 max_prefill_tokens=18, page_tokens=8))
    params = SamplingParams(max_tokens=2, temperature=0)
    handles = [engine.submit(prompt, params, series=inputs, forecast=[3, 7]),
               engine.submit(prompt, params, series=other, forecast=[16, 1]),
               engine.submit(prompt, params, series=other)]
    while engine.has_work():
        engine.step()
    for handle, asked, horizons in zip(handles, (inputs, other), ([3, 7], [16, 1])):
        _, spans = engine.prepare_series(prompt, asked)
        tokens = handle.prompt_token_ids
        ref = forecast(model, torch.tensor([tokens]), [[SeriesPlacement(s.start, s.data) for s in spans]],
                       [[(0, len(tokens) - 1)] * 2], horizons)
        for got, want in zip(handle.result().forecast, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert handles[2].result().forecast is None


def test_prefix_cache_is_keyed_on_series_content():
    model = lane_model("tiny")
    prompt = text(3, 1) + [placeholder(model)] + text(20, 2)
    eng = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, prefill_chunk=64,
                                              max_prefill_tokens=64, page_tokens=8, prefix_caching=True))
    hits = eng.executor.tiers.hits
    tokens, first = run(eng, prompt, [series(2, 40, 1)])
    assert sum(hits.values()) == 0
    _, again = run(eng, prompt, [series(2, 40, 1)])  # the same values: the cached prefix is used
    assert sum(hits.values()) >= 1 and again.token_ids == first.token_ids
    before = dict(hits)
    _, other = run(eng, prompt, [series(2, 40, 3)])  # same placeholder ids, other values: nothing shared
    assert hits == before
    _, spans = eng.prepare_series(prompt, [series(2, 40, 3)])
    logits = full_logits(model, tokens + other.token_ids, spans)[len(tokens) - 1:-1]
    assert other.token_ids == logits.argmax(-1).tolist()


def test_bad_series_requests_are_refused_in_one_line():
    model = lane_model("intern_s2_tiny")
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=256, page_tokens=8))
    prompt, inputs = two_series_prompt(model)
    cases = [
        (dict(series=inputs[:1]), "2 series placeholders .* but 1 series"),
        (dict(series=[series(17, 40, 1), inputs[1]]), "max_channels"),
        (dict(series=inputs, forecast=[4]), "one horizon per series"),
        (dict(series=inputs, forecast=[4, 99]), "max_horizon"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle) as err:
            engine.add_request(prompt, **kwargs)
        assert "\n" not in str(err.value)
    text_only = InferenceEngine(lane_model("intern_s2_tiny", timeseries=False),
                                EngineConfig(max_num_seqs=1, page_tokens=8))
    with pytest.raises(ValueError, match="no time-series lane"):
        text_only.add_request(prompt, series=inputs)
