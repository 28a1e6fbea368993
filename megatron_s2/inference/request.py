"""Requests as the engine tracks them, and what it reports back.

Every step produces, for each request that advanced, a :class:`RequestOutput` with the tokens
generated in that step (usually one) and per token: its log-prob under the sampling
distribution, optional top-N log-probs, the **policy version** of the weights that produced it
(§5.2.3: versions change exactly where the weights were swapped), and — when asked — the
routed experts and indexer top-k of every token fed to the model in that step. The last output
of a request has ``finished`` set and a ``finish_reason``: "stop" (end-of-sequence, a stop token
or a stop string), "length" (max_tokens or the model length) or "abort".

A :class:`RequestHandle` is a thread-safe stream of one request's outputs for callers on other
threads (an HTTP server): iterate it, or call :meth:`RequestHandle.result` for everything.
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass, field

import torch

from megatron_s2.inference.sampling import SamplingParams

__all__ = ["FinishReason", "QueueFull", "PromptTooLong", "RequestOutput", "CompletedRequest", "RequestHandle",
           "Request"]


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    """The request failed inside the engine (``error`` says why); the others went on."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is at ``max_waiting``: retry later (HTTP 429/503)."""


class PromptTooLong(ValueError):
    """The prompt does not fit ``max_model_len`` (with at least one generated token)."""


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    """Tokens generated in this step."""
    logprobs: list[float] = field(default_factory=list)
    """Log-prob of each of them under its sampling distribution."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Top-N (token, log-prob) of each generated position (empty lists unless requested)."""
    versions: list[int] = field(default_factory=list)
    """Policy version of the weights that produced each of them."""
    routed_experts: torch.Tensor | None = None
    """[tokens fed this step, MoE layers, moe_topk] int32 (record_routing), -1 where a layer
    did not run (decoder bounded replay). Positions ``fed_positions``."""
    indexer_topk: dict[int, torch.Tensor] | None = None
    """Indexing layer -> [tokens fed this step, index_topk] entry ids (record_indexer_topk)."""
    fed_positions: range = range(0)
    """Positions of the tokens the model processed in this step (whose records are above)."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token that ended the request, if any."""
    error: str | None = None
    """Why the request failed (``finish_reason`` ERROR)."""
    forecast: list[torch.Tensor] | None = None
    """Per series of the prompt, its real-valued forecast [channels, horizon] (float32, host): set
    once, on the output of the step that finished the prompt, when the request asked for one
    (``add_request(..., forecast=)``, Intern-S2 §2.2.2)."""


@dataclass
class CompletedRequest:
    """Everything about a request, accumulated (``RequestHandle.result``, ``generate``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    """[prompt + generated - 1, MoE layers, moe_topk]: every fed token, in position order."""
    indexer_topk: dict[int, torch.Tensor] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    forecast: list[torch.Tensor] | None = None
    """:attr:`RequestOutput.forecast`, when asked for."""

    def add(self, out: RequestOutput) -> None:
        if out.forecast is not None:
            self.forecast = out.forecast
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs
        self.versions += out.versions
        if out.routed_experts is not None:
            self.routed_experts = _put_rows(self.routed_experts, out.routed_experts, out.fed_positions)
        if out.indexer_topk is not None:
            self.indexer_topk = self.indexer_topk or {}
            for layer, t in out.indexer_topk.items():
                self.indexer_topk[layer] = _put_rows(self.indexer_topk.get(layer), t, out.fed_positions)
        if out.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error

    def routing_replay(self, layer_ids: list[int]):
        """The recorded routing as a training-side :class:`RoutingReplay` (REPLAY mode) for a
        forward over the fed tokens (prompt + generated - 1, batch of one); ``layer_ids``: the
        model's layers in the order of the record (``model.layer_ids``)."""
        from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

        if self.routed_experts is None:
            raise ValueError("routing_replay: the request was not run with record_routing=True")
        return RoutingReplay(RoutingMode.REPLAY, {layer: [self.routed_experts[:, i].unsqueeze(0)]
                                                  for i, layer in enumerate(layer_ids)})


def _put_rows(table: torch.Tensor | None, rows: torch.Tensor, positions: range) -> torch.Tensor:
    """Write ``rows`` at ``positions`` of ``table`` (grown as needed; re-fed positions overwrite)."""
    end = positions.stop
    if table is None or table.size(0) < end:
        grown = torch.full((end, *rows.shape[1:]), -1, dtype=rows.dtype, device=rows.device)
        if table is not None:
            grown[:table.size(0)] = table
        table = grown
    table[positions.start:end] = rows
    return table


class RequestHandle:
    """Thread-safe stream of one request's outputs."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, out: RequestOutput) -> None:
        self._queue.put(out)

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output (blocks; ``queue.Empty`` after ``timeout`` seconds)."""
        return self._queue.get(timeout=timeout)

    def __iter__(self):
        while True:
            out = self._queue.get()
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> CompletedRequest:
        done = CompletedRequest(self.request_id, self.prompt_token_ids)
        while True:
            out = self.get(timeout)
            done.add(out)
            if out.finished:
                return done


@dataclass
class Request:
    """Engine-internal state of one request."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int
    on_output: object = None
    tokens: list[int] = field(default_factory=list)
    """Prompt + generated tokens."""
    num_generated: int = 0
    num_computed: int = 0
    """Tokens whose state is in the cache (the next chunk starts here)."""
    kv: object | None = None
    """The model executor's per-request state (caches), while admitted."""
    pending: RequestOutput | None = None
    stop_text: object | None = None
    """The output's text and the stop strings found in it (engine-side, only with ``params.stop``):
    ``(IncrementalDetokenizer, StopStrings)``."""
    seed: int = 0
    """Seed of the request's random stream: the token at position i is drawn with ``generator``
    reseeded from (seed, i) (:func:`~megatron_s2.inference.sampling.position_seed`)."""
    cache_state: dict | None = None
    """A saved cache state to admit the request with (``InferenceEngine.add_request``)."""
    images: list = field(default_factory=list)
    """The prompt's images (:class:`~megatron_s2.models.family.engine.ImageSpan`), by position."""
    series: list = field(default_factory=list)
    """The prompt's series (:class:`~megatron_s2.models.timeseries.serving.SeriesSpan`), by position."""
    forecast: list[int] | None = None
    """Horizons (one per series) of the numerical forecast asked for; None: text only."""
    forecast_hidden: dict = field(default_factory=dict)
    """Chunk start -> final hidden states [n, d] of the prompt positions it computed (a forecast request)."""
    memory: object | None = None
    """The memory decoder's view of this request (:class:`~megatron_s2.inference.memory_decoder.MemorySlot`:
    its own cache state), while admitted to an engine that serves one."""

    @property
    def content_spans(self) -> list:
        """The images and series: spans whose placeholder ids say nothing of their content, so
        every cache key over their positions covers their content keys."""
        return [*self.images, *self.series]

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    def output(self) -> RequestOutput:
        """This step's output under construction."""
        if self.pending is None:
            self.pending = RequestOutput(self.request_id)
        return self.pending
