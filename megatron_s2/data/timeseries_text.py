"""Series + text documents for the time-series lane (``data.kind: timeseries``; Intern-S2 report
§2.2.1-2.2.2, walkthrough Ch. 1 "Walking one real prompt through all four lanes").

Every document is one turn: an instruction that names a horizon ("forecast the next two
seconds", "predict 96 steps ahead": :func:`~megatron_s2.models.timeseries.horizon.render_instruction`),
the series itself as a span of series tokens right after ``bos``, and a short verifiable text
answer; the series' known future is the forecasting target::

    bos [series span] instruction sep answer eos        (SFT targets: answer eos)

The span holds ``model.timeseries`` placeholder ids, ``plan_patching(T, ...).num_tokens`` of
them (the same plan the encoder makes, so the encoder's tokens fill it exactly); span positions
are never targets. A span must fit whole in the first ``seq_length`` positions, so packing never
splits it.

Sources: the embedded generator (no ``paths``; :func:`~megatron_s2.data.timeseries.procedural_series`:
seasonal + trend + noise, lead/lag channels, length, horizon and sampling rate drawn per item;
answer "period P steps, rising|falling") or local .csv / .parquet / .npz files (``paths``; read and
refused in one line by :func:`~megatron_s2.data.timeseries.load_series`), cut into windows of
``series_length + series_horizon`` steps whose last ``series_horizon`` are the future (answer
"rising|falling": the future's mean against the last ``horizon`` steps seen, channel 0).
``split: heldout`` draws procedural items from a seed no training item uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_s2.config.data import DataConfig
from megatron_s2.data.documents import InMemoryDocuments, render_prompt_answer
from megatron_s2.data.errors import DataError
from megatron_s2.data.timeseries import load_series, procedural_series, split_windows
from megatron_s2.data.tokenizer import Tokenizer
from megatron_s2.models.timeseries.horizon import render_instruction
from megatron_s2.models.timeseries.patching import plan_patching

__all__ = ["SeriesItem", "SeriesSpan", "SeriesPlanner", "SeriesTextDocuments", "procedural_items", "file_items",
           "build_series_documents", "series_inputs_of_row", "series_prompt", "HELDOUT_SEED_OFFSET"]

HELDOUT_SEED_OFFSET = 2_000_003
"""``split: heldout`` draws procedural items from seed ``dataset seed + HELDOUT_SEED_OFFSET``."""


@dataclass(frozen=True)
class SeriesItem:
    """One series with its instruction, answer and known future."""

    values: np.ndarray
    """float32 [C, T]: the history the model sees."""
    future: np.ndarray
    """float32 [C, H]: the next H values (the forecasting target)."""
    sample_rate: Optional[float]
    instruction: str
    answer: str
    source: str
    """Names the series in errors ("procedural seed 0 item 3", "a.csv window 2")."""
    period: Optional[int] = None
    """Seasonal period in steps when known (procedural), for the seasonal-naive baseline."""

    @property
    def horizon(self) -> int:
        return int(self.future.shape[1])


@dataclass(frozen=True)
class SeriesSpan:
    """Where a series sits in its document: token offset, span length, the item, and the
    document position of the last prompt token (the hidden state the forecast is asked from)."""

    offset: int
    length: int
    item: int
    prompt_end: int


@dataclass(frozen=True)
class SeriesPlanner:
    """The model side's sizing of a series span (torch-free): placeholder id and the patch plan."""

    token_id: int
    token_budget: int
    queries_per_patch: int
    min_patch_length: int
    max_channels: int
    max_horizon: int

    @classmethod
    def from_model(cls, model_cfg) -> "SeriesPlanner":
        ts = model_cfg.timeseries
        if ts is None:
            raise DataError("data.kind 'timeseries' needs a model with a time-series encoder; set model.timeseries")
        return cls(ts.placeholder_id(model_cfg.vocab_size), ts.token_budget, ts.queries_per_patch,
                   ts.min_patch_length, ts.max_channels, ts.max_horizon)

    def span_length(self, steps: int) -> int:
        return plan_patching(steps, self.token_budget, self.queries_per_patch,
                             min_patch_length=self.min_patch_length).num_tokens


class SeriesTextDocuments(InMemoryDocuments):
    """Token documents (series spans included) plus, per document, the series they hold."""

    def __init__(self, documents: InMemoryDocuments, spans: list[list[SeriesSpan]], items: list[SeriesItem]):
        super().__init__(documents._flat, documents.sizes, documents.prompt_lengths, documents._targets)
        self.spans, self.items = spans, items

    def series_of(self, index: int) -> list[SeriesSpan]:
        return self.spans[index]


def _trend_word(history: np.ndarray, future: np.ndarray) -> str:
    recent = history[0, -future.shape[1]:]
    return "rising" if float(future[0].mean()) > float(recent.mean()) else "falling"


def procedural_items(cfg: DataConfig, seed: int) -> list[SeriesItem]:
    """``cfg.num_documents`` generated items (module docstring); item ``i`` depends on (seed, i)."""
    seed = seed if cfg.split == "train" else (seed + HELDOUT_SEED_OFFSET) % 2 ** 63
    items = []
    for index in range(cfg.num_documents):
        rng = np.random.default_rng([seed, index, 7])
        length = int(rng.integers(max(2, cfg.series_length // 2), cfg.series_length + 1))
        horizon = int(rng.integers(max(1, cfg.series_horizon // 4), cfg.series_horizon + 1))
        rate = float(cfg.series_sample_rates[int(rng.integers(len(cfg.series_sample_rates)))])
        whole = int(rate)
        if rate == whole and cfg.series_horizon >= whole and rng.random() < 0.5:
            horizon = max(whole, horizon // whole * whole)  # whole seconds: the instruction may ask in time
        g = procedural_series(seed, index, channels=cfg.series_channels, length=length, horizon=horizon,
                              sample_rate=rate, noise=cfg.series_noise)
        instruction = render_instruction(horizon, rate, int(rng.integers(1 << 16)))
        answer = f"period {g.period} steps, {_trend_word(g.values, g.future)}"
        items.append(SeriesItem(g.values, g.future, rate, instruction, answer, f"procedural seed {seed} item {index}",
                                g.period))
    return items


def file_items(cfg: DataConfig) -> list[SeriesItem]:
    """Windows of ``series_length + series_horizon`` steps of every file in ``cfg.paths``."""
    items = []
    window = cfg.series_length + cfg.series_horizon
    for path in cfg.paths:
        loaded = load_series(path)
        steps = loaded.values.shape[1]
        if steps < cfg.series_horizon + 2:
            raise DataError(f"{path}: {steps} steps cannot hold a history and the {cfg.series_horizon}-step horizon "
                            f"(data.series_horizon); lower it or give a longer series")
        for k, part in enumerate(split_windows(loaded.values, window)):
            if part.shape[1] < cfg.series_horizon + 2:
                continue  # a short tail window: too little history
            history, future = part[:, :-cfg.series_horizon], part[:, -cfg.series_horizon:]
            instruction = render_instruction(cfg.series_horizon, loaded.sample_rate, k)
            items.append(SeriesItem(np.ascontiguousarray(history), np.ascontiguousarray(future), loaded.sample_rate,
                                    instruction, _trend_word(history, future), f"{path} window {k}"))
    return items


def build_series_documents(cfg: DataConfig, *, seed: int, tokenizer: Tokenizer, planner: SeriesPlanner,
                           seq_length: int) -> SeriesTextDocuments:
    """Token documents of every item (module docstring), sized by ``planner``."""
    items = file_items(cfg) if cfg.paths else procedural_items(cfg, cfg.generation_seed(seed))
    if not items:
        raise DataError("timeseries: the source holds no series; raise data.num_documents or add files")
    documents, spans = [], []
    for index, item in enumerate(items):
        channels = item.values.shape[0]
        if channels > planner.max_channels:
            raise DataError(f"{item.source}: {channels} channels, above model.timeseries.max_channels "
                            f"({planner.max_channels}); raise it or drop channels")
        if item.horizon > planner.max_horizon:
            raise DataError(f"{item.source}: horizon {item.horizon} exceeds model.timeseries.max_horizon "
                            f"({planner.max_horizon}); raise it or lower data.series_horizon")
        ids, prompt_length = render_prompt_answer(tokenizer, item.instruction, item.answer)
        if (ids == planner.token_id).any():
            raise DataError(f"{item.source}: its text tokenizes to token {planner.token_id}, the series placeholder; "
                            "set model.timeseries.token_id to an id the tokenizer never produces")
        at = 1 if len(ids) and ids[0] == tokenizer.bos_id else 0  # the series follows bos
        length = planner.span_length(item.values.shape[1])
        if prompt_length + length > seq_length:  # the span and the whole prompt in the first chunk
            raise DataError(f"{item.source}: its {item.values.shape[1]}-step series takes {length} series tokens; with "
                            f"the instruction that is more than the {seq_length}-token sequence; raise "
                            f"training.seq_length to at least {length + prompt_length + 1} or lower "
                            "model.timeseries.token_budget")
        span = np.full(length, planner.token_id, dtype=np.int64)
        documents.append((np.concatenate([ids[:at], span, ids[at:]]), prompt_length + length))
        spans.append([SeriesSpan(at, length, index, prompt_end=prompt_length + length - 1)])
    return SeriesTextDocuments(InMemoryDocuments.from_documents(documents), spans, items)


def series_prompt(tokenizer: Tokenizer, planner: SeriesPlanner, instruction: str, steps: int
                  ) -> tuple[np.ndarray, int]:
    """The prompt of a forecasting request as the data renders it (``bos [series span]
    instruction sep``, no answer) and the span's first position."""
    ids, prompt_length = render_prompt_answer(tokenizer, instruction, "")
    ids = ids[:prompt_length]
    at = 1 if len(ids) and ids[0] == tokenizer.bos_id else 0
    span = np.full(planner.span_length(steps), planner.token_id, dtype=np.int64)
    return np.concatenate([ids[:at], span, ids[at:]]), at


@dataclass
class SeriesTarget:
    """What the forecasting objective needs of one placed series (row coordinates)."""

    future: np.ndarray
    """float32 [C, H] true next values."""
    instruction: str
    sample_rate: Optional[float]
    context_start: int
    """Row position of the document's first token (the LLM context starts here)."""
    prompt_end: int
    """Row position of the last prompt token (the LLM context ends here; the answer follows)."""
    period: Optional[int] = None


def series_inputs_of_row(store: SeriesTextDocuments, segments: Sequence[tuple[int, int, int, int]],
                         seq_length: int) -> tuple[list, list, np.ndarray]:
    """(placements, forecasting targets, series mask over the row's ``seq_length + 1`` slots) of
    one packed row. ``segments``: (document, start inside it, length, row position) of each segment;
    a span lies whole in the first chunk of its document (:func:`build_series_documents` checks it)."""
    import torch

    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.insertion import SeriesPlacement

    placements, targets, mask = [], [], np.zeros(seq_length + 1, dtype=bool)
    for document, start, length, cursor in segments:
        for span in store.series_of(document):
            if not (start <= span.offset and span.offset + span.length <= start + length):
                continue  # another chunk of this document (text only) is in this row
            at = cursor + span.offset - start
            mask[at:at + span.length] = True
            item = store.items[span.item]
            placements.append(SeriesPlacement(at, SeriesInput(torch.from_numpy(item.values), item.sample_rate)))
            end = min(cursor + span.prompt_end - start, seq_length - 1)
            targets.append(SeriesTarget(item.future, item.instruction, item.sample_rate, cursor - start, end,
                                        item.period))
    return placements, targets, mask
