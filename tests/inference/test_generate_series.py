"""``megatron-s2 generate RUN --series ... --prompt INSTRUCTION`` (Intern-S2 §2.2.2): numbers out,
the same as ``tools/forecast.py`` / ``POST /v1/forecast``; bad series are one line, exit 2, before
the model loads (the fast tests). The slow ones train the forecasting recipe 3 steps (~15 s)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.cli import main
from megatron_s2.cli.generate_series import read_series_flag
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.timeseries import MAX_STEPS
from tests.tiny_runs import trained_forecaster

STEPS = np.arange(60.0)
SERIES = [(100 + 5 * np.sin(STEPS / 4)).tolist(), (-3 + np.cos(STEPS / 4)).tolist()]


@pytest.mark.parametrize("spec, words", [
    ("[1, NaN, 2]", "NaN/inf"),
    ("[1, Infinity]", "NaN/inf"),
    ("[]", "empty series"),
    ("[[1, 2, 3], [4]]", "ragged"),
    ("[1, 2", "not a JSON array"),
    ("[[\"a\", 1]]", "not numbers"),
    ("missing.csv", "file not found"),
    ("series.txt", "file not found"),
])
def test_bad_series_are_one_line_naming_the_flag(spec, words):
    with pytest.raises(ConfigError) as exc:
        read_series_flag(spec, None)
    message = str(exc.value)
    assert message.startswith("--series") and words in message and "\n" not in message


def test_enormous_and_nan_files_are_refused(tmp_path):
    big = tmp_path / "big.npz"
    np.savez(big, values=np.zeros((1, MAX_STEPS + 1), np.float32))
    with pytest.raises(ConfigError, match=r"^--series: .*big.npz: 300,001 steps exceeds"):
        read_series_flag(str(big), None)
    csv = tmp_path / "gap.csv"
    csv.write_text("a,b\n1,2\n,3\n")
    with pytest.raises(ConfigError, match=r"^--series: .*gap.csv: 1 of 4 values are NaN/inf"):
        read_series_flag(str(csv), None)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("1,2\n3\n")
    with pytest.raises(ConfigError, match="ragged CSV"):
        read_series_flag(str(ragged), None)


def test_values_rate_and_file_rate():
    values, rate = read_series_flag(json.dumps(SERIES), 4.0)
    assert values.shape == (2, 60) and values.dtype == np.float32 and rate == 4.0
    with pytest.raises(ConfigError, match="^--sample-rate"):
        read_series_flag("[1, 2]", -1.0)


def test_bad_series_exits_2_before_the_model_loads(capsys, tmp_path):
    # the checkpoint does not exist: the series is refused first, so the message names --series
    assert main(["generate", str(tmp_path / "nothing"), "--series", "[1, NaN]", "--prompt", "predict 4 steps ahead"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--series" in err[0] and "NaN" in err[0]
    # a prompt the parser cannot read waits for the checkpoint (a learned horizon predictor may read it)
    assert main(["generate", str(tmp_path / "nothing"), "--series", "[1, 2, 3]", "--prompt", "hello"]) == 2
    assert "nothing does not exist" in capsys.readouterr().err
    # no instruction at all, or an empty one, is the flag's one line; --horizon alone needs none
    for flags in ([], ["--prompt", "  "]):
        assert main(["generate", str(tmp_path / "nothing"), "--series", "[1, 2, 3]", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "configuration error: --prompt:" in err[0], err
    assert main(["generate", str(tmp_path / "nothing"), "--series", "[1, 2, 3]", "--horizon", "4"]) == 2
    assert "nothing does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--horizon", "4"], ["--sample-rate", "4"]])
def test_forecast_flags_without_a_series_are_refused_not_ignored(tmp_path, capsys, flag):
    """``--horizon`` / ``--sample-rate`` mean something only for a forecast: without ``--series``
    they were dropped without a word and text was generated (review57)."""
    code = main(["generate", str(tmp_path / "no_run"), "--prompt", "hello", *flag])
    err = capsys.readouterr().err.strip()
    assert code == 2 and flag[0] in err and "--series" in err and "\n" not in err, err


def test_a_horizon_past_the_data_phrasing_is_one_line(tmp_path, capsys):
    """``--horizon 10000`` with no ``--prompt`` rendered the data's phrasing before any limit was
    checked: a ValueError traceback from number_words (review57)."""
    code = main(["generate", str(tmp_path / "no_run"), "--series", "[1, 2, 3]", "--horizon", str(10 ** 30)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_forecaster(tmp_path_factory.mktemp("ts-generate") / "run")


@pytest.mark.slow
def test_generate_series_prints_the_numbers_tools_forecast_gives(run_dir, capsys, tmp_path):
    from megatron_s2.training.forecast_trainer import load_trained_forecaster
    from tools.forecast import answer

    ask = {"instruction": "forecast the next two seconds", "sample_rate": 4, "series": SERIES}
    want = answer(load_trained_forecaster(run_dir), ask)
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--series", json.dumps(SERIES), "--sample-rate", "4",
                 "--prompt", ask["instruction"], "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["horizon"] == want["horizon"] == 8 and [len(c) for c in got["forecast"]] == [8, 8]
    np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)
    # the same series from a file (its sample rate read from the npz)
    path = tmp_path / "two.npz"
    np.savez(path, values=np.asarray(SERIES, np.float32), sample_rate=4.0)
    assert main(["generate", str(run_dir), "--series", str(path), "--prompt", ask["instruction"],
                 "--device", "cpu"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    np.testing.assert_allclose(again["forecast"], got["forecast"], rtol=1e-4, atol=1e-4)
    # --horizon with no --prompt: the data's own phrasing, the numbers tools/forecast.py gives for it
    want = answer(load_trained_forecaster(run_dir), {"instruction": "predict 5 steps ahead", "series": SERIES})
    assert main(["generate", str(run_dir), "--series", json.dumps(SERIES), "--horizon", "5", "--device", "cpu"]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert alone["horizon"] == want["horizon"] == 5
    np.testing.assert_allclose(alone["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)
    # --horizon beside a prompt the parser reads: the parser's reading rides along, as in tools/forecast.py
    # and /v1/forecast (review57: it was null whenever --horizon was given)
    both = {**ask, "horizon": 5}
    want = answer(load_trained_forecaster(run_dir), both)
    assert main(["generate", str(run_dir), "--series", json.dumps(SERIES), "--sample-rate", "4", "--prompt",
                 ask["instruction"], "--horizon", "5", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["horizon"] == want["horizon"] == 5 and got["horizon_parsed"] == want["horizon_parsed"] == 8
    np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_generate_series_answers_with_the_learned_predictor(tmp_path_factory, capsys):
    """A checkpoint with the learned horizon predictor: it decides (as tools/forecast.py), the parser's
    reading rides along, ``--horizon`` overrides it."""
    from megatron_s2.training.forecast_trainer import load_trained_forecaster
    from tools.forecast import answer

    run = trained_forecaster(tmp_path_factory.mktemp("ts-generate-learned") / "run", learned_horizon=True)
    ask = {"instruction": "forecast the next two seconds", "sample_rate": 4, "series": SERIES}
    want = answer(load_trained_forecaster(run), ask)
    base = ["generate", str(run), "--series", json.dumps(SERIES), "--sample-rate", "4", "--device", "cpu"]
    capsys.readouterr()
    assert main([*base, "--prompt", ask["instruction"]]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["horizon"] == want["horizon"] and got["horizon_parsed"] == want["horizon_parsed"] == 8
    np.testing.assert_allclose(got["forecast"], want["forecast"], rtol=1e-4, atol=1e-4)
    assert main([*base, "--prompt", ask["instruction"], "--horizon", "5"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["horizon"] == 5
    # what the parser reads and no predictor may answer exits 2 (never silently replaced)
    assert main([*base, "--prompt", "predict 1000 steps ahead"]) == 2
    assert "--prompt: asks for 1000 steps, above" in capsys.readouterr().err
    no_rate = ["generate", str(run), "--series", json.dumps(SERIES), "--device", "cpu"]
    assert main([*no_rate, "--prompt", ask["instruction"]]) == 2
    assert "needs the series' sampling rate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="above this model's"):
        answer(load_trained_forecaster(run), {**ask, "instruction": "predict 1000 steps ahead"})
    with pytest.raises(ValueError, match="^request.instruction: .*sampling rate"):   # the field named (review57)
        answer(load_trained_forecaster(run), {"instruction": ask["instruction"], "series": SERIES})


@pytest.mark.slow
def test_model_limits_are_one_line(run_dir, capsys):
    assert main(["generate", str(run_dir), "--series", "[1, 2, 3, 4, 5, 6, 7, 8]", "--horizon", "999",
                 "--prompt", "x", "--device", "cpu"]) == 2
    assert "max_horizon (32)" in capsys.readouterr().err
    for horizon in ("10000", str(10 ** 30)):   # with no --prompt: refused before the data's phrasing is rendered
        assert main(["generate", str(run_dir), "--series", "[1, 2, 3, 4, 5, 6, 7, 8]", "--horizon", horizon,
                     "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("megatron-s2 generate: configuration error: --horizon:") and "max_horizon (32)" in err[-1]
    many = json.dumps([[float(i)] * 8 for i in range(65)])
    assert main(["generate", str(run_dir), "--series", many, "--prompt", "predict 4 steps ahead", "--device", "cpu"]) == 2
    assert "max_channels" in capsys.readouterr().err
    # a checkpoint without the learned horizon predictor has only the parser: an unreadable prompt is refused
    assert main(["generate", str(run_dir), "--series", "[1, 2, 3, 4, 5, 6, 7, 8]", "--prompt", "hello",
                 "--device", "cpu"]) == 2
    assert "--horizon N" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--temperature", "0"], ["--max-tokens", "5"], ["--top-k", "3"], ["--seed", "1"],
                                  ["--stop", "x"], ["--no-bos"], ["--top-p", "0.5"]])
def test_sampling_flags_with_a_series_are_refused_not_ignored(tmp_path, capsys, flag):
    """A forecast is one prompt forward: a sampling / text flag set with --series is a mistake the
    user should hear about (exit 2, one line naming it), before anything is loaded."""
    code = main(["generate", str(tmp_path / "no_run"), "--series", "[1, 2, 3]", "--prompt", "forecast the next 4 steps",
                 *flag])
    err = capsys.readouterr().err.strip()
    assert code == 2 and flag[0] in err and "--series" in err and "\n" not in err
