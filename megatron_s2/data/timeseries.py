"""Time series for the Intern-S2 series lane (issue 24, "Data"): local files and a generator.

* :func:`load_series` reads one local file into a float32 array ``[channels, steps]``:

  - ``.csv``: one row per time step, one column per channel; a non-numeric first row is a header;
  - ``.parquet`` (needs ``pyarrow``): every column a channel, rows are time steps;
  - ``.npz``: the array ``values`` (or the file's only array), ``[channels, steps]`` or ``[steps]``,
    and an optional scalar ``sample_rate``. Read with ``allow_pickle=False``: a file holding
    Python objects is refused, never unpickled.

  :func:`check_series` then refuses, in one line naming the file and the fix, a series that is
  empty, ragged (rows/channels of different lengths), holds NaN or inf, or is enormous (more
  steps than ``max_steps``, the report's 300,000 by default, or more channels than
  ``max_channels``).

* :func:`procedural_series` is the embedded source every phase can run on without a download:
  seasonal + trend + noise with the **future values known** (the generator draws ``length +
  horizon`` steps and splits them), several channels with **lead/lag** structure (channel ``c``
  is the common driver shifted by ``lags[c]`` steps, scaled and offset). Item ``index`` of seed
  ``seed`` depends on ``(seed, index)`` only.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_s2.data.errors import DataError

__all__ = ["MAX_STEPS", "SUPPORTED_SUFFIXES", "LoadedSeries", "GeneratedSeries", "load_series", "check_series",
           "split_windows", "procedural_series"]

MAX_STEPS = 300_000
"""The report's longest series (§2.2.1); longer ones must be windowed before training."""
MAX_CHANNELS = 1024
MAX_ABS_VALUE = 1e30
"""Beyond it the encoder's float32 mean / spread overflow over a long series (3e38 is float32's
largest): the forecast would be NaN; such a series is refused and asked to be rescaled."""
SUPPORTED_SUFFIXES = (".csv", ".parquet", ".npz")


@dataclass(frozen=True)
class LoadedSeries:
    """One series read from a file."""

    values: np.ndarray
    """float32 [channels, steps]."""
    sample_rate: Optional[float]
    """Hz when the file says (npz ``sample_rate``), else None."""
    source: str
    """The file it came from (for messages)."""


def check_series(values, source: str, *, max_steps: int = MAX_STEPS, max_channels: int = MAX_CHANNELS) -> np.ndarray:
    """``values`` as float32 [channels, steps], or a one-line :class:`DataError` naming ``source``."""
    try:
        array = np.asarray(values, dtype=np.float32)
    except (ValueError, TypeError) as exc:  # a request's series may be any JSON: text, objects, nulls
        if "sequence" in str(exc):
            raise DataError(f"{source}: ragged series (channels or rows of different lengths); pad or trim every "
                            f"channel to the same number of steps") from None
        raise DataError(f"{source}: holds values that are not numbers ({exc}); give [steps] or [channels][steps] "
                        f"of numbers") from None
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise DataError(f"{source}: a series is [channels, steps], got shape {array.shape}; reshape it")
    channels, steps = array.shape
    if array.size == 0:
        raise DataError(f"{source}: empty series ({channels} channels x {steps} steps); remove the file or fill it")
    if steps > max_steps:
        raise DataError(f"{source}: {steps:,} steps exceeds the {max_steps:,}-step maximum; cut it into windows "
                        f"of at most {max_steps:,} steps (data.timeseries.split_windows) or downsample")
    if channels > max_channels:
        raise DataError(f"{source}: {channels:,} channels exceeds {max_channels:,}; was the file transposed? "
                        f"Rows are time steps and columns channels")
    bad = ~np.isfinite(array)
    if bad.any():
        channel, step = map(int, np.argwhere(bad)[0])
        what = "NaN" if np.isnan(array[channel, step]) else "inf"
        raise DataError(f"{source}: {int(bad.sum()):,} of {array.size:,} values are NaN/inf (first {what} at "
                        f"channel {channel}, step {step}); interpolate or drop them before training")
    peak = float(np.abs(array).max())
    if peak > float(np.float32(MAX_ABS_VALUE)):   # compared as stored: float32(1e30) is a hair above 1e30
        channel, step = map(int, np.argwhere(np.abs(array) == peak)[0])
        raise DataError(f"{source}: a value of magnitude {peak:.3g} (channel {channel}, step {step}) is beyond "
                        f"{MAX_ABS_VALUE:g}, where the encoder's float32 statistics overflow; rescale the series "
                        f"(e.g. to other units)")
    return array


def split_windows(values: np.ndarray, window: int, stride: Optional[int] = None) -> list[np.ndarray]:
    """[C, T] -> consecutive [C, <= window] views every ``stride`` steps (default: no overlap).

    The fix for an enormous series: each window fits ``max_steps``; the last may be shorter."""
    stride = window if stride is None else stride
    if window < 1 or stride < 1:
        raise DataError(f"split_windows needs window >= 1 and stride >= 1, got {window} and {stride}")
    steps = values.shape[-1]
    return [values[..., start:start + window] for start in range(0, max(steps - window, 0) + stride, stride)
            if start < steps]


def _read_csv(path: Path) -> np.ndarray:
    with path.open(newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    if rows:
        try:
            [float(cell) for cell in rows[0]]
        except ValueError:
            rows = rows[1:]                                  # a header row
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        raise DataError(f"{path}: ragged CSV (rows with {sorted(widths)} columns); give every time step a value "
                        f"in every channel column")
    try:
        table = [[float(cell) if cell.strip() else float("nan") for cell in row] for row in rows]
    except ValueError as exc:
        raise DataError(f"{path}: non-numeric cell ({exc}); every column after the header must be a number") from None
    return np.asarray(table, dtype=np.float32).T if table else np.zeros((0, 0), np.float32)


def _read_parquet(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow; pip install pyarrow, or save as .csv/.npz") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as parquet ({type(exc).__name__}: {exc})") from None
    columns = []
    for name in table.column_names:
        column = table.column(name)
        try:
            columns.append(column.to_numpy(zero_copy_only=False).astype(np.float32))
        except (ValueError, TypeError):
            raise DataError(f"{path}: column '{name}' is not numeric ({column.type}); drop it or convert it") from None
    return columns


def _read_npz(path: Path) -> tuple[np.ndarray, Optional[float]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            key = "values" if "values" in names else (names[0] if len(names) == 1 else None)
            if key is None:
                raise DataError(f"{path}: holds arrays {names} but none named 'values'; name the series 'values'")
            values = archive[key]
            rate = _sample_rate(path, archive["sample_rate"]) if "sample_rate" in names else None
    except DataError:  # already one line naming the file (a DataError is a ValueError)
        raise
    except ValueError as exc:
        if "pickle" in str(exc):
            raise DataError(f"{path}: the array holds Python objects (ragged?) and pickles are never loaded; "
                            f"save a numeric [channels, steps] array") from None
        raise DataError(f"{path}: cannot read as .npz ({exc})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read as .npz ({type(exc).__name__}: {exc})") from None
    return values, rate


def _sample_rate(path: Path, stored: np.ndarray) -> float:
    """The npz's ``sample_rate``: one finite number > 0 (Hz), or a one-line error naming the file."""
    try:
        rate = float(stored) if stored.size == 1 and stored.dtype.kind in "biuf" else None
    except (TypeError, ValueError):
        rate = None
    if rate is None or not np.isfinite(rate) or rate <= 0:
        raise DataError(f"{path}: sample_rate must be one finite number of Hz > 0, got {stored.dtype} of shape "
                        f"{stored.shape} ({np.array2string(stored.ravel()[:3])}); save it as a scalar, or drop it")
    return rate


def load_series(path, *, max_steps: int = MAX_STEPS, max_channels: int = MAX_CHANNELS) -> LoadedSeries:
    """Read and check one local series file (see the module docstring for the layouts)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; name an existing local {'/'.join(SUPPORTED_SUFFIXES)} file")
    suffix = path.suffix.lower()
    rate = None
    if suffix == ".csv":
        values = _read_csv(path)
    elif suffix == ".parquet":
        values = _read_parquet(path)
    elif suffix == ".npz":
        values, rate = _read_npz(path)
    else:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use {', '.join(SUPPORTED_SUFFIXES)}")
    array = check_series(values, str(path), max_steps=max_steps, max_channels=max_channels)
    return LoadedSeries(values=array, sample_rate=rate, source=str(path))


@dataclass(frozen=True)
class GeneratedSeries:
    """One procedural series with its known future."""

    values: np.ndarray
    """float32 [channels, length]: what the model sees."""
    future: np.ndarray
    """float32 [channels, horizon]: the true next values (same noise process)."""
    future_clean: np.ndarray
    """float32 [channels, horizon]: the noiseless expectation of ``future``."""
    lags: tuple[int, ...]
    """Steps channel ``c`` lags the common driver (0 leads; larger lags more)."""
    period: int
    """Steps per seasonal cycle (seasonal-naive baselines use it)."""
    sample_rate: float


def procedural_series(seed: int, index: int = 0, *, channels: int = 3, length: int = 512, horizon: int = 96,
                      sample_rate: float = 1.0, noise: float = 0.1) -> GeneratedSeries:
    """Seasonal + trend + noise, ``channels`` lead/lag copies of one driver, future known."""
    if channels < 1 or length < 1 or horizon < 0:
        raise DataError(f"procedural series needs channels >= 1, length >= 1, horizon >= 0; "
                        f"got {channels}, {length}, {horizon}")
    rng = np.random.default_rng([seed, index])
    period = int(rng.integers(12, 64))
    max_lag = max(1, period // 4)
    lags = (0,) + tuple(sorted(int(v) for v in rng.integers(1, max_lag + 1, size=channels - 1)))
    total = length + horizon
    t = np.arange(-max_lag, total, dtype=np.float64)             # room to shift by any lag
    phase = rng.uniform(0, 2 * np.pi)
    driver = (np.sin(2 * np.pi * t / period + phase) + 0.5 * np.sin(4 * np.pi * t / period + 2 * phase)
              + rng.uniform(-2, 2) * t / total)                     # seasonal + second harmonic + trend
    clean = np.empty((channels, total))
    for c, lag in enumerate(lags):
        shifted = driver[max_lag - lag:max_lag - lag + total]        # channel c(t) = driver(t - lag)
        clean[c] = rng.uniform(0.5, 2.0) * shifted + rng.uniform(-5, 5)
    noisy = clean + noise * rng.standard_normal(clean.shape)
    return GeneratedSeries(values=_f32(noisy[:, :length]), future=_f32(noisy[:, length:]),
                           future_clean=_f32(clean[:, length:]), lags=lags, period=period, sample_rate=sample_rate)


def _f32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)
