"""Series through ``serve`` (Intern-S2 report §2.2.2; walkthrough §2.2.2: "a request with a
series returns numbers, not text"; :mod:`megatron_s2.serve.series`), with the real ``openai``
client against a live server on a ``timeseries_forecast`` checkpoint trained a few steps here.

* ``POST /v1/forecast`` answers ``tools/forecast.py``'s request with ``tools/forecast.py``'s numbers.
* A chat ``time_series`` part with ``extra_body={"forecast": true}``: the horizon is read from the
  user's text, the top-level ``forecast`` equals ``predict.forecast`` on the prompt the server ran.
* A local file path is read only under ``--allowed-local-media-path``.
* Bad series (NaN, ragged, too long, too many channels, a horizon past the branch, a model without
  the lane) are one-line 400s, and the server answers good requests meanwhile.
* The Hugging Face template path (text rendered, then tokenised) and the lane-less refusal run on
  untrained tiny models with the shipped BPE tokenizer (fast); the rest is ``slow`` (its module
  fixture trains the forecasting recipe 3 steps).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from megatron_s2.serve import ServeConfig
from tests.serve.conftest import start_server
from tests.tiny_runs import trained_forecaster

STEPS = torch.arange(60.0)
SERIES = [(100 + 5 * torch.sin(STEPS / 4)).tolist(), (-3 + torch.cos(STEPS / 4)).tolist()]
ASK = {"instruction": "forecast the next two seconds", "sample_rate": 4, "series": SERIES}

SLOW = pytest.mark.slow  # the tests on the trained checkpoint: its module fixture trains ~12 s


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_forecaster(tmp_path_factory.mktemp("ts-serve") / "run")


@pytest.fixture(scope="module")
def loaded(run_dir):
    from megatron_s2.inference.weights import load_model

    return load_model(str(run_dir), "cpu")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    directory = tmp_path_factory.mktemp("series-media")
    np.savez(directory / "two.npz", values=np.asarray(SERIES, dtype=np.float32), sample_rate=4.0)
    return directory


@pytest.fixture(scope="module")
def server(loaded, media):
    srv = start_server(loaded, name="ts", serve=ServeConfig(disconnect_poll_s=0.05,
                                                              allowed_local_media_path=str(media)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def forecast_post(client, body) -> dict:
    return client.post("/forecast", body=body, cast_to=httpx.Response).json()


def message_of(error: openai.APIStatusError) -> str:
    return error.response.json()["error"]["message"]


def series_chat(client, spec, text="forecast the next two seconds", model="ts", **extra):
    messages = [{"role": "user", "content": [{"type": "time_series", "time_series": spec},
                                             {"type": "text", "text": text}]}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


@SLOW
def test_forecast_route_answers_like_tools_forecast(client, run_dir):
    from megatron_s2.training.forecast_trainer import load_trained_forecaster
    from tools.forecast import answer

    got = forecast_post(client, ASK)
    want = answer(load_trained_forecaster(run_dir), ASK)
    assert got["object"] == "forecast" and got["horizon"] == want["horizon"] == 8
    np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)
    assert [len(c) for c in got["forecast"]] == [8, 8] and all(80 < v < 120 for v in got["forecast"][0])
    # an explicit horizon overrides the parser, as in tools/forecast.py, even where it cannot read the ask
    ask = {**ASK, "instruction": "what comes next?", "horizon": 5}
    got, want = forecast_post(client, ask), answer(load_trained_forecaster(run_dir), ask)
    assert got["horizon"] == want["horizon"] == 5 and got["horizon_parsed"] is want["horizon_parsed"] is None
    np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)


@SLOW
def test_chat_series_part_returns_the_forecast_of_the_prompt_it_ran(client, loaded):
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.insertion import SeriesPlacement
    from megatron_s2.models.timeseries.predict import forecast

    reply = series_chat(client, {"values": SERIES, "sample_rate": 4}, forecast=True)
    [entry] = reply.model_extra["forecast"]
    assert entry["horizon"] == 8 and np.asarray(entry["values"]).shape == (2, 8)
    model = loaded[0]
    prompt = reply.model_extra["prompt_token_ids"]
    start = prompt.index(model.config.timeseries.placeholder_id(model.config.vocab_size))
    placement = SeriesPlacement(start, SeriesInput(torch.tensor(SERIES), 4.0))
    [want] = forecast(model, torch.tensor([prompt]), [[placement]], [[(0, len(prompt) - 1)]], [8])
    np.testing.assert_allclose(entry["values"], want.numpy(), rtol=1e-4, atol=1e-4)
    # without the extension: text only, and an explicit horizon is honoured
    assert "forecast" not in (series_chat(client, {"values": SERIES, "sample_rate": 4}).model_extra or {})
    explicit = series_chat(client, {"values": SERIES}, text="what next?", forecast={"horizon": 3})
    assert np.asarray(explicit.model_extra["forecast"][0]["values"]).shape == (2, 3)


@SLOW
def test_a_local_file_is_read_only_under_the_allowed_directory(client, media, tmp_path):
    inline = forecast_post(client, ASK)
    from_file = forecast_post(client, {"instruction": ASK["instruction"], "path": str(media / "two.npz")})
    np.testing.assert_allclose(from_file["forecast"], inline["forecast"], rtol=1e-5, atol=1e-5)
    np.savez(tmp_path / "outside.npz", values=np.ones((2, 60), dtype=np.float32))
    with pytest.raises(openai.BadRequestError) as err:
        series_chat(client, {"path": str(tmp_path / "outside.npz")}, forecast=True)
    assert "outside --allowed-local-media-path" in message_of(err.value)


@SLOW
def test_nan_values_are_a_one_line_400(client, server):
    """The openai client refuses to send NaN (not JSON); a raw body with the ``NaN`` literal is."""
    import json

    body = {"model": "ts", "max_tokens": 1, "forecast": True, "messages": [{"role": "user", "content": [
        {"type": "time_series", "time_series": {"values": [[1.0, float("nan"), 2.0] * 10]}},
        {"type": "text", "text": "predict 4 steps ahead"}]}]}
    for path, payload in (("/v1/chat/completions", body), ("/v1/forecast", {**ASK, "series": [[float("nan")] * 30]})):
        reply = httpx.post(server.url + path, content=json.dumps(payload), timeout=60,
                           headers={"content-type": "application/json"})
        message = reply.json()["error"]["message"]
        assert reply.status_code == 400 and "NaN" in message and "\n" not in message, message


@SLOW
@pytest.mark.parametrize("spec, words", [    ({"values": [[1.0] * 30, [1.0] * 29]}, "ragged"),
    ({"values": [[0.5] * 20] * 17}, "max_channels"),
    ({"values": [0.5] * 300_001}, "300,000-step maximum"),
    ({"values": "1,2,3"}, "JSON array"),
    ({"values": SERIES, "sample_rate": -4}, "sample_rate"),
    ({"values": SERIES, "sample_rate": 1e-310}, "sample_rate 1e-310 Hz is below"),   # review24: was a 500
    ({"values": [[1e38, 3e38, -3e38, 1.0]]}, "rescale the series"),                  # review24: was NaN values
], ids=["ragged", "channels", "too-long", "not-an-array", "bad-rate", "subnormal-rate", "overflowing-values"])
def test_bad_series_are_one_line_400s_while_others_are_served(client, spec, words):
    with pytest.raises(openai.BadRequestError) as err:
        series_chat(client, spec, forecast=True)
    message = message_of(err.value)
    assert words in message and "\n" not in message
    assert forecast_post(client, ASK)["horizon"] == 8  # the server keeps answering


@SLOW
def test_a_bad_series_is_refused_while_a_long_request_is_in_flight(client):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(series_chat, client, {"values": SERIES, "sample_rate": 4}, forecast=True)
        with pytest.raises(openai.BadRequestError):
            series_chat(client, {"values": [[1.0] * 30, [1.0] * 29]}, forecast=True)
        assert long.result(timeout=120).model_extra["forecast"][0]["horizon"] == 8


@SLOW
def test_bad_forecast_asks_are_refused(client):
    for extra, words in [({"forecast": {"horizon": 99}}, "max_horizon"), ({"forecast": "yes"}, "must be true"),
                         ({"forecast": True, "stream": True}, "streaming")]:
        with pytest.raises(openai.BadRequestError) as err:
            series_chat(client, {"values": SERIES, "sample_rate": 4}, **extra)
        assert words in message_of(err.value)
    for body, words in [({**ASK, "instruction": "predict 500 steps ahead"}, "max_horizon"),
                        ({**ASK, "horizon": 99}, "horizon: one horizon per series, each in 1..32"),
                        ({**ASK, "horizon": True}, "horizon: one horizon per series"),
                        ({**ASK, "instruction": "what next?"}, "or give \"horizon\": N")]:
        with pytest.raises(openai.BadRequestError) as err:
            forecast_post(client, body)
        assert words in message_of(err.value), message_of(err.value)
    # the request's own field names, not the chat part's series.values / series.sample_rate (review57)
    for body, field in [({**ASK, "sample_rate": 0}, "sample_rate"), ({**ASK, "sample_rate": 1e-310}, "sample_rate"),
                        ({**ASK, "series": [[1.0] * 30, [1.0] * 29]}, "series")]:
        with pytest.raises(openai.BadRequestError) as err:
            forecast_post(client, body)
        assert message_of(err.value).startswith(f"{field}: "), message_of(err.value)


def bpe():
    from megatron_s2.data.tokenizer import load_tokenizer

    return load_tokenizer(Path(__file__).resolve().parents[2] / "recipes" / "tokenizers" / "tiny-bpe")


def test_a_model_without_the_lane_refuses_series():
    from tests.inference.test_series import lane_model

    text_only = (lane_model("intern_s2_tiny", timeseries=False, vocab_size=520), bpe(), "text-only")
    srv = start_server(text_only, name="plain")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for call in (lambda: series_chat(client, {"values": SERIES}, model="plain"), lambda: forecast_post(client, ASK)):
            with pytest.raises(openai.BadRequestError) as err:
                call()
            assert "no time-series lane" in message_of(err.value)
    finally:
        srv.stop()


def test_a_tokenizer_that_renders_text_places_the_series_where_the_part_stands():
    """The Hugging Face template path (rendered text, then ids): the ``<series>`` marker becomes
    the placeholder between the text parts, and the forecast is ``predict.forecast``'s."""
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.insertion import SeriesPlacement
    from megatron_s2.models.timeseries.predict import forecast
    from tests.inference.test_series import lane_model

    tokenizer = bpe()
    model = lane_model("intern_s2_tiny", vocab_size=520)  # placeholder 519: beyond the tokenizer's 512 ids
    srv = start_server((model, tokenizer, "bpe"), name="bpe")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": [{"type": "text", "text": "Here:"},
                                                 {"type": "time_series", "time_series": {"values": SERIES}},
                                                 {"type": "text", "text": "predict 5 steps ahead"}]}]
        reply = client.chat.completions.create(model="bpe", messages=messages, max_tokens=1, temperature=0,
                                               extra_body={"return_token_ids": True, "forecast": True})
    finally:
        srv.stop()
    prompt = reply.model_extra["prompt_token_ids"]
    start = prompt.index(519)
    assert prompt.count(519) == 16 and prompt[start - 1] != 519
    assert "Here:" in tokenizer.decode(prompt[:start]) and "predict 5" in tokenizer.decode(prompt[start + 16:])
    [want] = forecast(model, torch.tensor([prompt]), [[SeriesPlacement(start, SeriesInput(torch.tensor(SERIES)))]],
                      [[(0, len(prompt) - 1)]], [5])
    [entry] = reply.model_extra["forecast"]
    assert entry["horizon"] == 5
    np.testing.assert_allclose(entry["values"], want.numpy(), rtol=1e-4, atol=1e-4)


# ---- the learned horizon predictor (a checkpoint that has one) --------------------------------------
@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    from megatron_s2.inference.weights import load_model

    run = trained_forecaster(tmp_path_factory.mktemp("ts-serve-learned") / "run", learned_horizon=True)
    return run, load_model(str(run), "cpu")


@SLOW
def test_a_checkpoint_with_the_learned_predictor_answers_with_its_horizon(learned):
    """The learned predictor decides the horizon in /v1/forecast and chat (3 training steps: whatever
    it reads, the answer is its horizon, with the parser's 8 beside it), the same as tools/forecast.py
    and predict.forecast with no horizon given; an explicit horizon still overrides it."""
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.insertion import SeriesPlacement
    from megatron_s2.models.timeseries.predict import forecast
    from megatron_s2.training.forecast_trainer import load_trained_forecaster
    from tools.forecast import answer

    run, loaded_learned = learned
    assert loaded_learned[0].forecaster.horizon is not None
    srv = start_server(loaded_learned, name="ts", serve=ServeConfig(disconnect_poll_s=0.05))
    try:
        own = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = forecast_post(own, ASK)
        trained = load_trained_forecaster(run)
        want = answer(trained, ASK)
        assert got["horizon"] == want["horizon"] and got["horizon_parsed"] == want["horizon_parsed"] == 8
        assert np.asarray(got["forecast"]).shape == (2, got["horizon"])
        np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)
        reply = series_chat(own, {"values": SERIES, "sample_rate": 4}, forecast=True)
        [entry] = reply.model_extra["forecast"]
        model = loaded_learned[0]
        prompt = reply.model_extra["prompt_token_ids"]
        start = prompt.index(model.config.timeseries.placeholder_id(model.config.vocab_size))
        placement = SeriesPlacement(start, SeriesInput(torch.tensor(SERIES), 4.0))
        [mine] = forecast(model, torch.tensor([prompt]), [[placement]], [[(0, len(prompt) - 1)]], [None])
        assert entry["horizon"] == mine.shape[-1] and np.asarray(entry["values"]).shape == (2, mine.shape[-1])
        np.testing.assert_allclose(entry["values"], mine.numpy(), rtol=1e-4, atol=1e-4)
        override = answer(trained, {**ASK, "horizon": 5})
        assert override["horizon"] == 5 and [len(c) for c in override["forecast"]] == [5, 5]
        explicit = series_chat(own, {"values": SERIES}, text="what next?", forecast={"horizon": 3})
        assert np.asarray(explicit.model_extra["forecast"][0]["values"]).shape == (2, 3)
        # an instruction the parser cannot read: the learned predictor still answers, the cross-check is null
        unread = forecast_post(own, {**ASK, "instruction": "what comes next?"})
        assert unread["horizon_parsed"] is None and 1 <= unread["horizon"] <= 32
        # what the parser reads and no predictor may answer is a 400 (never silently replaced)
        for ask, needle in (({**ASK, "instruction": "predict 1000 steps ahead"}, "above this model's"),
                            ({"instruction": ASK["instruction"], "series": SERIES}, "needs the series' sampling rate")):
            with pytest.raises(openai.BadRequestError) as err:
                own.post("/forecast", body=ask, cast_to=httpx.Response)
            assert needle in message_of(err.value), message_of(err.value)
            assert "\"forecast\"" not in message_of(err.value)   # /v1/forecast's hint is "horizon": N (review57)
        with pytest.raises(openai.BadRequestError) as err:
            series_chat(own, {"values": SERIES, "sample_rate": 4}, text="predict 1000 steps ahead", forecast=True)
        assert "above this model's" in message_of(err.value)
    finally:
        srv.stop()
