"""Series data (issue 24, "Data"): local CSV / parquet / npz files, one-line errors for unusable
series, and the procedural generator with known futures and lead/lag channels."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_s2.data.errors import DataError
from megatron_s2.data.timeseries import check_series, load_series, procedural_series, split_windows


def _reference() -> np.ndarray:
    return np.arange(30, dtype=np.float32).reshape(3, 10) / 7.0


def test_csv_with_header(tmp_path):
    path = tmp_path / "s.csv"
    rows = ["a,b,c"] + [",".join(str(v) for v in step) for step in _reference().T]
    path.write_text("\n".join(rows) + "\n")
    series = load_series(path)
    np.testing.assert_allclose(series.values, _reference(), rtol=1e-6)
    assert series.sample_rate is None


def test_parquet_columns_are_channels(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({f"ch{c}": _reference()[c] for c in range(3)}), path)
    np.testing.assert_array_equal(load_series(path).values, _reference())


def test_npz_with_sample_rate(tmp_path):
    path = tmp_path / "s.npz"
    np.savez(path, values=_reference(), sample_rate=250.0)
    series = load_series(path)
    np.testing.assert_array_equal(series.values, _reference())
    assert series.sample_rate == 250.0


def test_npz_objects_are_never_unpickled(tmp_path):
    path = tmp_path / "ragged.npz"
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros(3), np.zeros(5)
    np.savez(path, values=ragged)
    with pytest.raises(DataError, match=r"ragged.npz: the array holds Python objects .* pickles are never loaded"):
        load_series(path)


@pytest.mark.parametrize("rate", [np.array([1.0, 2.0]), np.float64("nan"), -4.0, 0.0, np.inf, "fast"])
def test_npz_sample_rate_must_be_one_positive_number(tmp_path, rate):
    """A sample_rate that is an array, NaN, inf, zero, negative or text is one line naming the
    file, not a TypeError traceback or a NaN rate handed to the horizon predictor."""
    path = tmp_path / "s.npz"
    np.savez(path, values=np.ones((2, 50), np.float32), sample_rate=rate)
    with pytest.raises(DataError, match=r"s\.npz: sample_rate") as info:
        load_series(path)
    assert str(info.value).startswith(f"{path}: sample_rate") and "\n" not in str(info.value)


@pytest.mark.parametrize("writer,message", [
    (lambda p: p.write_text("a,b\n1,2\nnan,3\n"), r"s.csv: 1 of 4 values are NaN/inf \(first NaN at channel 0, step 1\); interpolate"),
    (lambda p: p.write_text("a,b\n"), r"s.csv: empty series .*remove the file or fill it"),
    (lambda p: p.write_text("1,2\n3\n"), r"s.csv: ragged CSV \(rows with \[1, 2\] columns\)"),
    (lambda p: p.write_text("a,b\n1,x\n"), r"s.csv: non-numeric cell"),
])
def test_bad_csv_is_one_line_naming_file_and_fix(tmp_path, writer, message):
    path = tmp_path / "s.csv"
    writer(path)
    with pytest.raises(DataError, match=message) as info:
        load_series(path)
    assert "\n" not in str(info.value)


def test_enormous_series_says_how_to_window(tmp_path):
    path = tmp_path / "long.npz"
    np.savez(path, values=np.zeros((1, 300_001), np.float32))
    with pytest.raises(DataError, match=r"long.npz: 300,001 steps exceeds the 300,000-step maximum; cut it into windows"):
        load_series(path)
    windows = split_windows(np.arange(300_001, dtype=np.float32)[None], 300_000)
    assert [w.shape[1] for w in windows] == [300_000, 1]
    assert all(check_series(w, "window").shape[1] <= 300_000 for w in windows)


def test_split_windows_covers_every_step():
    series = np.arange(20, dtype=np.float32).reshape(2, 10)
    assert [w[0].tolist() for w in split_windows(series, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [w[0, 0] for w in split_windows(series, 4, stride=3)] == [0, 3, 6]
    assert split_windows(series, 20)[0].shape == (2, 10)


def test_check_series_refuses_ragged_lists_and_inf():
    with pytest.raises(DataError, match="mem: ragged series"):
        check_series([[1.0, 2.0], [3.0]], "mem")
    with pytest.raises(DataError, match="first inf at channel 1, step 0"):
        check_series([[1.0, 2.0], [np.inf, 0.0]], "mem")


@pytest.mark.parametrize("values", [{"a": 1}, [[1.0, {"b": 2}]], [None, [1]], "abc"])
def test_check_series_refuses_what_is_not_numbers_in_one_line(values):
    """A request's ``series`` may be any JSON: a dict, objects inside the rows or text is one
    line naming it (``tools/forecast.py`` exits 2), never a TypeError traceback."""
    with pytest.raises(DataError, match=r"^request\.series: ") as info:
        check_series(values, "request.series")
    assert "\n" not in str(info.value)


def test_check_series_refuses_values_whose_statistics_overflow_float32():
    """review24: a request of [[1e38, 3e38, -3e38, 1]] passed and forecast NaN (printed as the
    non-JSON token NaN); values beyond MAX_ABS_VALUE are refused in one line naming the place."""
    with pytest.raises(DataError, match=r"^request\.series: a value of magnitude 3e\+38 \(channel 0, step 1\)"):
        check_series([[1e38, 3e38, -3e38, 1.0]], "request.series")
    assert check_series([[1e30, -1e30, 2.0]], "request.series").shape == (1, 3)


def test_unknown_and_missing_files(tmp_path):
    (tmp_path / "s.pkl").write_bytes(b"x")
    with pytest.raises(DataError, match="unsupported file type '.pkl'"):
        load_series(tmp_path / "s.pkl")
    with pytest.raises(DataError, match="file not found"):
        load_series(tmp_path / "nope.csv")


def test_procedural_series_is_deterministic_per_seed_and_index():
    a, b = procedural_series(7, 3), procedural_series(7, 3)
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.future, b.future)
    assert not np.array_equal(a.values, procedural_series(7, 4).values)
    assert not np.array_equal(a.values, procedural_series(8, 3).values)


def test_procedural_future_continues_the_series_and_channels_lag():
    """The future is the continuation of the same draw (a longer draw's prefix/suffix), and each
    channel's normalised signal matches the leading channel's shifted by its lag."""
    short = procedural_series(1, 0, channels=4, length=400, horizon=50, noise=0.0)
    assert short.values.shape == (4, 400) and short.future.shape == (4, 50)
    np.testing.assert_array_equal(short.future, short.future_clean)   # noise 0: future exact
    assert short.lags[0] == 0 and list(short.lags) == sorted(short.lags) and max(short.lags) > 0
    full = np.concatenate([short.values, short.future], axis=1).astype(np.float64)
    z = (full - full.mean(1, keepdims=True)) / full.std(1, keepdims=True)
    for c, lag in enumerate(short.lags):
        corr = [np.corrcoef(z[0, 64:-64], np.roll(z[c], -k)[64:-64])[0, 1] for k in range(0, short.period // 4 + 1)]
        assert int(np.argmax(corr)) == lag, (c, lag, corr)


def test_procedural_series_feeds_the_encoder():
    torch = pytest.importorskip("torch")
    from megatron_s2.models.timeseries.encoder import SeriesInput, TimeSeriesEncoder, TimeSeriesEncoderConfig
    item = procedural_series(0, 0, channels=3, length=1000)
    enc = TimeSeriesEncoder(TimeSeriesEncoderConfig(output_hidden=16, hidden=16, token_budget=32, temporal_layers=1))
    out = enc([SeriesInput(torch.from_numpy(item.values), item.sample_rate)])
    assert out.tokens.shape == (1, 32, 16)
