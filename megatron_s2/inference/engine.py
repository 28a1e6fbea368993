"""The inference engine: continuous batching over the KV-cached training model (report §3.2, §5.2.3).

Every :meth:`InferenceEngine.step` is one token boundary. It admits queued requests (up to
``max_num_seqs``), schedules one token for every decoding request and prompt chunks for the
prefilling ones (``prefill_chunk`` per request, ``max_prefill_tokens`` per step), runs the
decodes and the chunks as two forwards of the same model, samples one token for every request
whose known tokens are all processed, and finishes requests that hit a stop condition —
freeing their cache state at once (§5.2.3 "sample-grained garbage collection"). Requests join
and leave between any two steps.

**Token-level interruption** (§5.2.3): :meth:`pause` returns once the step in flight (if any)
has finished; no step runs until :meth:`resume`. In between, :meth:`update_weights` replaces
the weights in place (from a model in this process, e.g. the trainer's, a state dict, or a
checkpoint directory) and increments the policy version; every request keeps its cache and
continues at resume without re-prefill. Each generated token carries the version of the
weights that produced it.

**Threads.** ``add_request`` / ``submit`` / ``abort`` may be called from any thread: they
enqueue commands that the next step applies. ``step`` runs on one thread at a time; what runs
it is the one driver, :class:`~megatron_s2.inference.driver.EngineDriver` — on the caller's
thread (rollouts, ``generate``) or on its background thread (the server).

API (all thread-safe)::

    engine = InferenceEngine(model, EngineConfig(...), eos_token_ids=[eos], detokenize=tok.decode)
    driver = EngineDriver(engine); driver.start()    # background loop (a server)
    handle = engine.submit(token_ids, SamplingParams(max_tokens=..., temperature=..., top_p=...,
                           top_k=..., seed=..., stop=(...), stop_token_ids=(...), logprobs=N,
                           record_routing=True), request_id="cmpl-1")
        # raises QueueFull (-> 429/503), PromptTooLong / ValueError / ConfigError (-> 400)
    for out in handle: ...                           # RequestOutput deltas: token_ids, logprobs,
                                                     # top_logprobs, versions, routed_experts,
                                                     # finished, finish_reason, stop_reason
    handle.result()                                  # CompletedRequest (everything, accumulated)
    engine.add_request(ids, params, on_output=cb)    # or a callback, called on the driving thread
    engine.abort(request_id)                         # client gone: state freed at the next step
    engine.pause(); engine.update_weights(src); engine.resume()   # policy_version += 1
    engine.config.max_model_len, engine.policy_version, engine.stats(); driver.stop()
    engine.generate(prompts, params)                 # = EngineDriver(engine).generate: to completion

**Images.** ``add_request(ids, params, images=[...])`` takes decoded Pillow images (one per image
placeholder of ``ids``, each expanded to its image's span by the family's processor) or the
spans :meth:`InferenceEngine.prepare_images` returned for ``ids`` (a server expands first to
count the prompt's tokens). The executor embeds each image once; cached prefixes are keyed on
the images' content, never on their placeholder ids (:mod:`megatron_s2.models.family.engine`).

**Series** (Intern-S2 §2.2.1-§2.2.2; walkthrough §2.2.2 "through the engine and serve"):
``add_request(ids, params, series=[SeriesInput, ...])`` expands each series placeholder of ``ids``
(``model.timeseries.placeholder_id``) into its series' span and the executor inserts the
encoder's tokens there during (chunked) prefill; cached prefixes are keyed on the series' content
(:mod:`megatron_s2.models.timeseries.serving`). ``forecast=[horizon, ...]`` (one per series; None:
the checkpoint's learned horizon predictor decides) also asks for the numbers: the forecasting
branch reads the prompt's final hidden states as the engine
computed them and the output that ends the prompt carries ``forecast`` (per series, [channels,
horizon] real values on the series' own scale) — equal to ``predict.forecast`` out of the engine.

**Memory Decoder** (Intern-S2 walkthrough Ch. 2, Eq. 3): ``InferenceEngine(model, ...,
memory_decoder=MemoryDecoder)`` (:mod:`~megatron_s2.inference.memory_decoder`, the router run's
plug-in) runs the memory model's own family executor over the very chunks of every backbone
forward — its own cache state per request, admitted, preempted and released with the backbone's —
and every sampled distribution is the router's per-token mix of the two (log space). Reported
log-probs are the fused ones (a ``*_logits`` mode reports the fused log-probabilities: there are no
fused logits). Refused with a plug-in, one ConfigError / ValueError each: speculative decoding (the
drafter proposes for the backbone alone), prefix caching (the backbone would resume from a cached
prefix the memory has not computed), images, series and restored cache states.

Stop strings are found by one incremental detokenizer per request
(:mod:`~megatron_s2.inference.detokenizer`): linear in the output, not quadratic.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.engine import EngineConfig
from megatron_s2.models.family import family_of
from megatron_s2.models.family.engine import Chunk, ImageSpan, OutOfPages, ResumableState, SpeculativeExecutor
from megatron_s2.inference.detokenizer import IncrementalDetokenizer, StopStrings
from megatron_s2.inference.memory_decoder import MemorySlot
from megatron_s2.inference.request import (
    CompletedRequest,
    FinishReason,
    PromptTooLong,
    QueueFull,
    Request,
    RequestHandle,
    RequestOutput,
)
from megatron_s2.inference.sampling import SamplingParams, constrain_logits, position_seed, sample_next, sampled_token

__all__ = ["InferenceEngine"]


class InferenceEngine:
    def __init__(self, model, config: EngineConfig | None = None, *, eos_token_ids: Iterable[int] = (),
                 detokenize: Callable[[list[int]], str] | None = None, policy_version: int = 0,
                 memory_decoder=None):
        """``model``: a :class:`V41Model` holding every layer (no pipeline stages), in eval mode;
        its parallel groups (tp / ep) are the training ones. ``eos_token_ids`` end generation
        unless ``ignore_eos``; ``detokenize`` is needed for stop strings. ``memory_decoder``: a
        :class:`~megatron_s2.inference.memory_decoder.MemoryDecoder` whose mix every token is
        sampled from (module docstring)."""
        self.config = config = config or EngineConfig()
        cfg = model.config
        family = family_of(cfg)
        if set(model.layer_ids) != set(range(cfg.num_layers)):  # a pipeline stage holds a subset
            raise ConfigError("inference needs every layer on each rank: use a layout with pp: 1")
        if model.groups.sequence.sp or model.groups.cp.active:
            raise ConfigError("inference runs without sequence or context parallelism: set sequence_parallel: false, cp: 1")
        self.model = model.eval()
        self.model_config = cfg
        self.device = next(model.parameters()).device
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize
        self.policy_version = policy_version
        needed = family.engine_cache_bytes(cfg, config)
        self.memory_decoder, self.memory_executor = memory_decoder, None
        if memory_decoder is not None:
            mem_family = _check_memory_decoder(memory_decoder, cfg, config)
            needed += mem_family.engine_cache_bytes(memory_decoder.memory.config, config)
        _check_state_fits(needed, config, self.device)
        # the family's per-request state (caches, tiers) and its one forward over a batch of chunks
        self.executor = family.executor(model, config, self.device)
        if memory_decoder is not None:  # the memory's own state per request, stepped in lock-step
            self.memory_executor = mem_family.executor(memory_decoder.memory, config, self.device)
        self.speculator = None
        if config.speculative:
            if not isinstance(self.executor, SpeculativeExecutor) or self.executor.drafter is None:
                raise ConfigError(f"speculative: the {cfg.family} model family has no speculative drafter here; "
                                  "drop --speculative (rollout.engine.speculative)")
            from megatron_s2.inference.speculation import SpeculativeDecoder

            self.speculator = SpeculativeDecoder(self.executor, config, self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._accepted = 0                      # queued (inbox + waiting), bounded by max_waiting
        self._count_lock = threading.Lock()
        self._lock = threading.RLock()          # held for a whole step, a weight update, a pause
        self._paused = False
        self.on_new_work: Callable[[], None] | None = None
        """Called (from any thread) when a request, an abort or a resume was queued: the driver's wake-up."""

    # ---- requests (any thread) -------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None,
                    cache_state: dict[str, torch.Tensor] | None = None, images: list | None = None,
                    series: list | None = None, forecast: list[int] | None = None) -> str:
        """Queue a request; returns its id. Raises :class:`PromptTooLong`, :class:`QueueFull`,
        ``ValueError`` for token ids outside the vocabulary or images the model cannot take
        (``images``: module docstring). ``cache_state`` (from
        :meth:`export_cache_state` of an engine of the same configuration, over these prompt
        tokens) is what the request resumes from at admission instead of a prefill; ``ValueError``
        when it does not fit. ``series`` / ``forecast``: module docstring."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if self.memory_decoder is not None and (images or series or forecast is not None or cache_state is not None):
            what = "images" if images else "series" if series or forecast is not None else "cache_state"
            raise ValueError(f"{what}: this engine serves a memory decoder, which reads text only (and keeps no "
                             "exportable cache); send a text prompt")
        spans: list[ImageSpan] = []
        if images:
            if all(isinstance(image, ImageSpan) for image in images):
                spans = list(images)
                if any(span.start < 0 or span.end > len(prompt) for span in spans):
                    raise ValueError(f"images: a span runs outside the prompt's {len(prompt)} tokens; pass the ids "
                                     "prepare_images returned with its spans")
            else:
                prompt, spans = self.prepare_images(prompt, images)
        series_spans: list = []
        if series:
            prompt, series_spans = self.prepare_series(prompt, series)
        if forecast is not None:
            self._check_forecast(series_spans, forecast, cache_state)
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_token_ids: ids must lie in 0..{vocab - 1}")
        if len(prompt) >= self.config.max_model_len:
            raise PromptTooLong(f"prompt_token_ids: {len(prompt)} tokens leave no room to generate within "
                                f"max_model_len={self.config.max_model_len}")
        if cache_state is not None:
            self.check_cache_state(cache_state, len(prompt))
        with self._count_lock:
            if self._accepted >= self.config.max_waiting:
                raise QueueFull(f"the request queue is full ({self.config.max_waiting} waiting); retry later")
            self._accepted += 1
        arrival = next(self._ids)
        rid = request_id or f"req-{arrival}"
        seed = params.seed if params.seed is not None else hash((self.config.seed, arrival)) & ((1 << 63) - 1)
        gen = torch.Generator(device=self.device)  # reseeded per token (_advance)
        self._inbox.put(("add", Request(rid, prompt, params, gen, arrival, on_output, seed=seed,
                                        cache_state=cache_state, images=spans, series=series_spans,
                                        forecast=None if forecast is None else
                                        [None if h is None else int(h) for h in forecast])))
        self._notify()
        return rid

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, images: list | None = None, series: list | None = None,
               forecast: list[int] | None = None) -> RequestHandle:
        """``add_request`` with a thread-safe handle streaming the outputs."""
        if images and not all(isinstance(image, ImageSpan) for image in images):
            prompt_token_ids, images = self.prepare_images(prompt_token_ids, images)
        if series:
            prompt_token_ids, series = self.prepare_series(prompt_token_ids, series)
        handle = RequestHandle("", prompt_token_ids)
        handle.request_id = self.add_request(prompt_token_ids, params, request_id=request_id, on_output=handle.put,
                                             images=images, series=series, forecast=forecast)
        return handle

    @property
    def image_token_id(self) -> int | None:
        """The image placeholder id of prompts; None when the model takes no images."""
        return self.executor.image_token_id

    def prepare_images(self, prompt_token_ids: list[int], images: list) -> tuple[list[int], list[ImageSpan]]:
        """The prompt with each image placeholder expanded to its image's span, and the spans
        (``images``: decoded Pillow images, or the family's prepared inputs). ValueError when
        the model has no vision tower or the placeholders and images do not match; thread-safe
        (it only reads the configuration)."""
        return self.executor.prepare_images([int(t) for t in prompt_token_ids], list(images))

    @property
    def series_token_id(self) -> int | None:
        """The series placeholder id of prompts; None when the model has no time-series lane."""
        ts = getattr(self.model_config, "timeseries", None)
        return None if ts is None else ts.placeholder_id(self.model_config.vocab_size)

    def prepare_series(self, prompt_token_ids: list[int], series: list) -> tuple[list[int], list]:
        """The prompt with each series placeholder expanded to its series' span, and the spans
        (``series``: :class:`~megatron_s2.models.timeseries.encoder.SeriesInput` per placeholder, or
        the spans this returned). ValueError when the model has no time-series lane or they do
        not match; thread-safe."""
        from megatron_s2.models.timeseries.serving import prepare_series

        return prepare_series(self.model_config, [int(t) for t in prompt_token_ids], list(series))

    def _check_forecast(self, spans: list, horizons: list[int], cache_state) -> None:
        """ValueError (one line) for a forecast this engine cannot compute."""
        if getattr(self.model, "forecaster", None) is None:
            raise ValueError("forecast: this model has no forecasting branch (train it with phase.kind: "
                             "timeseries_forecast)")
        if len(horizons) != len(spans):
            raise ValueError(f"forecast: give one horizon per series ({len(spans)} series, {len(horizons)} horizons)")
        limit = self.model.forecaster.max_horizon
        if None in horizons and self.model.forecaster.horizon is None:   # None: the learned predictor's
            raise ValueError("forecast: a horizon of None asks the learned horizon predictor, which this checkpoint "
                             "lacks (model.timeseries.horizon_predictor); give the horizon")
        if any(h is not None and not 1 <= int(h) <= limit for h in horizons):
            raise ValueError(f"forecast: horizons must lie in 1..{limit} (model.timeseries.max_horizon), got {horizons}")
        if self.config.decoder_bounded_replay or cache_state is not None:
            raise ValueError("forecast: the forecaster reads every prompt position's hidden state; drop "
                             "decoder_bounded_replay / cache_state for this request")

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client disconnected); its state is freed at the next step and
        it gets a final output with finish reason "abort"."""
        self._inbox.put(("abort", request_id))
        self._notify()

    def export_cache_state(self, request_id: str) -> dict[str, torch.Tensor] | None:
        """The cache state of an admitted request as host tensors (call while paused or between
        steps); None when it holds none yet (waiting) or the model family cannot export it."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.kv is None or self.memory_executor is not None:
                return None  # a memory decoder's second state is not exported: the request re-prefills
            if not isinstance(self.executor, ResumableState):
                return None  # this model family cannot hand its cache state over
            return self.executor.export_state(req)

    def check_cache_state(self, cache_state: dict[str, torch.Tensor], prompt_length: int) -> None:
        """ValueError unless a request of ``prompt_length`` tokens can resume from ``cache_state``."""
        if not isinstance(self.executor, ResumableState):
            raise ValueError(f"cache_state: {type(self.executor).__name__} cannot restore a request's cache state")
        covered = self.executor.check_state(cache_state)
        if not 0 < covered <= prompt_length:
            raise ValueError(f"cache_state: it covers {covered} tokens, the prompt has {prompt_length}")

    def _notify(self) -> None:
        if self.on_new_work is not None:
            self.on_new_work()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self._inbox.empty())

    # ---- interruption and weights ----------------------------------------------------------------
    def pause(self) -> None:
        """Halt every in-flight request at a token boundary (returns when the running step is done)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Continue every request from its cached state (no re-prefill)."""
        with self._lock:
            self._paused = False
        self._notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def update_weights(self, source: nn.Module | Mapping[str, torch.Tensor] | str | Path,
                       version: int | None = None) -> int:
        """Replace the weights in place and bump the policy version (or set it to ``version``).
        ``source``: a model with the same layout (the trainer's), its ``state_dict``, or a
        checkpoint (run / checkpoints / step directory, or a Hugging Face export). Runs at a
        token boundary; usually between ``pause()`` and ``resume()``. Returns the new version."""
        from megatron_s2.inference.weights import load_weights_into

        with self._lock:
            load_weights_into(self.model, source)
            self.policy_version = self.policy_version + 1 if version is None else int(version)
            return self.policy_version

    def set_policy_version(self, version: int) -> int:
        """Set the policy version without loading weights: the engine runs a model whose weights
        its owner already changed in place (co-located RL sharing the training model's
        parameters, report §5.2.1). Same token-boundary rule as :meth:`update_weights`."""
        with self._lock:
            self.policy_version = int(version)
            return self.policy_version

    # ---- blocking convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletedRequest]:
        """Run ``prompts`` to completion on this thread (:meth:`EngineDriver.generate`)."""
        from megatron_s2.inference.driver import EngineDriver

        return EngineDriver(self).generate(prompts, params)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One token boundary: apply queued commands, admit, forward, sample, finish."""
        with self._lock:
            outputs: list[RequestOutput] = []
            self._apply_commands(outputs)
            if self._paused:
                return self._deliver(outputs)
            self._admit()
            plan = self._schedule()
            version = self.policy_version
            for chunks, reqs in self._forwards(plan):
                decoding = self.speculator is not None and chunks[0].length == 1
                if decoding:
                    # decoding, not a 1-token chunk; nor a forecast's last prompt token (its hidden state is read)
                    spec = [r for r in reqs if r.num_computed + 1 == len(r.tokens) and not r.params.constrained
                            and not (r.forecast is not None and r.num_computed < len(r.prompt))]
                    # the gate decides before drafting whether drafting pays at this batch size
                    if spec and self.speculator.should_draft(len(spec)):
                        self._speculate(spec, version, outputs, plan)
                        chunks = [c for c in chunks if c.request not in spec]
                        reqs = [c.request for c in chunks]
                        if not chunks:
                            continue
                record_routing = any(r.params.record_routing for r in reqs)
                record_topk = any(r.params.record_indexer_topk for r in reqs)
                # a forward that raises is the engine's failure (the device, the batch): it propagates
                t0 = time.perf_counter()
                if self.memory_executor is not None:
                    for chunk in chunks:  # the router reads both models' hidden states
                        chunk.hidden = chunk.logits != "none"
                results = self.executor.forward(chunks, record_routing=record_routing, record_topk=record_topk)
                forward_s = time.perf_counter() - t0
                if self.memory_executor is not None:
                    self._fuse(chunks, results)
                for req, chunk, res in zip(reqs, chunks, results):
                    try:
                        self._advance(req, chunk, res, version)
                    except Exception as exc:  # noqa: BLE001 - this request's sampling / stop check
                        self._fail(req, exc, outputs)
                if decoding:  # plain decode: the baseline the gate compares speculation with
                    self.speculator.observe_plain(len(chunks), forward_s, time.perf_counter() - t0)
            for req in list(self.running):
                if req.pending is not None:
                    if req.pending.finished:
                        self._finish(req)
                    outputs.append(req.pending)
                    req.pending = None
            return self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            req = self.requests.get(out.request_id)
            callback = req.on_output if req is not None else None
            if out.finished:
                self.requests.pop(out.request_id, None)
            if callback is not None:
                callback(out)
        return outputs

    def _apply_commands(self, outputs: list[RequestOutput]) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if payload.request_id in self.requests:
                    self._uncount()
                    out = RequestOutput(payload.request_id, finished=True, finish_reason=FinishReason.ABORT)
                    if payload.on_output is not None:
                        payload.on_output(out)  # duplicate id: refused
                    continue
                self.requests[payload.request_id] = payload
                self.waiting.append(payload)
            elif kind == "abort":
                req = self.requests.get(payload)
                if req is None:
                    continue
                if req in self.waiting:
                    self.waiting.remove(req)
                    self._uncount()
                else:
                    self._release(req, snapshot=False)
                    self.running.remove(req)
                outputs.append(RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ABORT))

    def _uncount(self) -> None:
        with self._count_lock:
            self._accepted -= 1

    # ---- admission and scheduling -----------------------------------------------------------------
    def _admit(self) -> None:
        mem = self.memory_executor
        while self.waiting and len(self.running) < self.config.max_num_seqs and self.executor.can_admit() \
                and (mem is None or mem.can_admit()):
            req = self.waiting.popleft()
            self._uncount()
            if req.cache_state is not None:  # resumed after a restart exactly where it stopped
                self.executor.import_state(req, req.cache_state)
                req.cache_state = None
            else:
                self.executor.admit(req)  # its cache state (and any cached prefix it resumes from)
            if mem is not None:
                req.memory = MemorySlot(req)
                mem.admit(req.memory)
                # lock-step: both models start at the same position (no cached prefix: refused at init)
                assert req.num_computed == req.memory.num_computed == 0
            self.running.append(req)

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to process) for this step; preempts the newest requests when the
        page pool cannot hold this step's tokens."""
        mem = self.memory_executor
        while True:
            plan, budget = [], self.config.max_prefill_tokens
            for req in self.running:
                todo = len(req.tokens) - req.num_computed
                if todo == 1:
                    plan.append((req, 1))
                elif budget > 0:
                    n = min(todo, self.config.prefill_chunk, budget)
                    n = self.executor.limit_chunk(req, n)
                    if mem is not None:
                        n = mem.limit_chunk(req.memory, n)
                    plan.append((req, n))
                    budget -= n
            need = sum(self.executor.pages_needed(req, n) for req, n in plan)
            fits = need <= self.executor.free_pages()
            if mem is not None:  # the memory's own page pool must hold the same chunks
                fits = fits and sum(mem.pages_needed(req.memory, n) for req, n in plan) <= mem.free_pages()
            if fits or len(self.running) <= 1:
                return plan
            if not self.executor.reclaim():  # drop cached snapshots before preempting requests
                self._preempt(self.running[-1])

    def _preempt(self, req: Request) -> None:
        """Out of pages: drop the newest request's cache; it re-runs its tokens when readmitted."""
        self._release(req, snapshot=False)
        self.running.remove(req)
        req.num_computed, req.kv, req.forecast_hidden = 0, None, {}
        self.waiting.appendleft(req)
        with self._count_lock:
            self._accepted += 1

    def _forwards(self, plan: list[tuple[Request, int]]):
        """Decodes (one token) and prompt chunks as two forwards."""
        for group in ([p for p in plan if p[1] == 1], [p for p in plan if p[1] > 1]):
            if not group:
                continue
            chunks = [self._chunk(req, n) for req, n in group]
            yield chunks, [req for req, _ in group]

    def _fuse(self, chunks: list[Chunk], results: list) -> None:
        """The memory's forward over the same chunks (its own states); each row's logits become
        the fused log-probabilities of Eq. (3), which sampling reads as logits (module docstring)."""
        mirrored = [Chunk(c.request.memory, c.start, c.length, c.logits, hidden=c.hidden) for c in chunks]
        for chunk, base, mem in zip(mirrored, results, self.memory_executor.forward(mirrored)):
            chunk.request.num_computed = chunk.start + chunk.length
            self.memory_executor.after_forward(chunk.request)
            if base.logits is not None:
                base.logits = self.memory_decoder.mix(base.hidden, base.logits, mem.hidden, mem.logits).fused

    @staticmethod
    def _chunk(req: Request, n: int) -> Chunk:
        last = req.num_computed + n == len(req.tokens)
        if req.forecast is not None and req.num_computed < len(req.prompt):
            # the forecaster reads the final hidden state of every prompt position (§2.2.2)
            return Chunk(req, req.num_computed, n, "all", hidden=True)
        return Chunk(req, req.num_computed, n, "last" if last else "none")

    def _forecast(self, req: Request, chunk: Chunk, res, out: RequestOutput) -> object:
        """Keep a forecast request's prompt hidden states; once the prompt is done, run the
        branch and put the numbers on ``out``. Returns the logits to sample from (or None)."""
        from megatron_s2.models.timeseries.serving import forecast_from_hidden

        req.forecast_hidden[chunk.start] = res.hidden
        if chunk.start + chunk.length < len(req.tokens):
            return None
        prompt, dtype = len(req.prompt), getattr(torch, self.model_config.compute_dtype)
        hidden = torch.cat([req.forecast_hidden[s] for s in sorted(req.forecast_hidden)])[:prompt]
        values = forecast_from_hidden(self.model.forecaster, hidden.to(self.device, dtype), req.series, self.model.timeseries,
                                      req.forecast, (0, prompt - 1))
        out.forecast = [v.float().cpu() for v in values]
        req.forecast_hidden = {}
        return res.logits[-1]

    # ---- after the forward ---------------------------------------------------------------------
    def _advance(self, req: Request, chunk: Chunk, res, version: int) -> None:
        start, n = chunk.start, chunk.length
        req.num_computed = start + n
        out = req.output()
        if res.routing is not None and req.params.record_routing:
            out.routed_experts = res.routing
            out.fed_positions = range(start, start + n)
        if res.topk and req.params.record_indexer_topk:
            out.indexer_topk = res.topk
            out.fed_positions = range(start, start + n)
        self.executor.after_forward(req)
        logits = res.logits
        if chunk.hidden and req.forecast is not None:
            logits = self._forecast(req, chunk, res, out)
        if logits is None:
            return
        if req.params.constrained:  # masked tokens (the gateway's tool_choice); never speculated
            logits = constrain_logits(logits, req.params, req.tokens[len(req.prompt):], self.eos_token_ids)
        if not req.params.greedy:  # the draw is a function of (seed, position) alone: module docstring
            req.generator.manual_seed(position_seed(req.seed, len(req.tokens)))
        self._append(req, out, sample_next(logits, req.params, req.generator), version)

    def _append(self, req: Request, out: RequestOutput, tok, version: int) -> bool:
        """Append one generated token (a :class:`SampledToken`) to the request and this step's
        output; True when it ends the request (its finish reason is set on ``out``)."""
        req.tokens.append(tok.token_id)
        req.num_generated += 1
        out.token_ids.append(tok.token_id)
        out.logprobs.append(tok.logprob)
        out.top_logprobs.append(tok.top_logprobs)
        out.versions.append(version)
        reason, why = self._stop_reason(req, tok.token_id)
        if reason is not None:
            out.finished, out.finish_reason, out.stop_reason = True, reason, why
        return reason is not None

    # ---- speculative decoding (DSpark, report §2.4.3; inference/speculation.py) --------------------
    def _speculate(self, reqs: list[Request], version: int, outputs: list[RequestOutput],
                   plan: list[tuple[Request, int]]) -> None:
        """Draft, verify in one forward, keep the accepted prefix and one more token per request."""
        spec, ex = self.speculator, self.executor
        step_start = time.perf_counter()
        # drafts take only pages the step's plan (its decodes and prompt chunks) leaves free:
        # _schedule made that plan fit the pool, by preemption if needed
        spare, limits = ex.free_pages() - sum(ex.pages_needed(req, n) for req, n in plan), []
        for req in reqs:  # room for drafts: max_tokens, max_model_len and the page pool
            room = min(spec.max_drafts, req.params.max_tokens - req.num_generated - 1,
                       self.config.max_model_len - len(req.tokens) - 1)
            room, planned = max(room, 0), ex.pages_needed(req, 1)
            while room and ex.pages_needed(req, 1 + room) - planned > spare:
                room -= 1
            spare -= ex.pages_needed(req, 1 + room) - planned
            limits.append(room)
        drafts, dists, confidence = spec.draft(reqs)
        confidence = confidence.float().cpu()   # one device-to-host copy: the schedule and the estimate read it
        lengths = spec.lengths(reqs, confidence, limits)
        chunks = []
        for req, d, k in zip(reqs, drafts, lengths):
            self.executor.begin_speculation(req, 1 + k)
            chunks.append(Chunk(req, req.num_computed, 1 + k, "all"))
            req.tokens.extend(d[:k])
        t0 = time.perf_counter()
        results = self.executor.forward(chunks, record_routing=any(r.params.record_routing for r in reqs),
                                        record_topk=any(r.params.record_indexer_topk for r in reqs))
        forward_s = time.perf_counter() - t0
        heads = confidence.tolist()
        for req, chunk, res, d, q, k, head in zip(reqs, chunks, results, drafts, dists, lengths, heads):
            try:
                del req.tokens[chunk.start + 1:]
                accepted, token = spec.accept(req, res.logits, d[:k], q)
                spec.record(k, accepted, head)
                self._emit(req, chunk.start, res, d[:accepted] + [token], version)
            except Exception as exc:  # noqa: BLE001 - this request's verification / stop check
                self._fail(req, exc, outputs)
        spec.observe_speculative(len(reqs), sum(c.length for c in chunks), forward_s, time.perf_counter() - step_start)

    def _emit(self, req: Request, start: int, res, tokens: list[int], version: int) -> None:
        """Append the verified ``tokens`` (the kept drafts and the token after them), each reported
        from the policy's logits at its position, up to the first stop condition; then keep the
        cache of exactly the positions fed before the last appended token."""
        out = req.output()
        keep = 0  # positions fed whose next token was emitted: the seed and the kept drafts
        for j, token in enumerate(tokens):
            keep += 1
            if self._append(req, out, sampled_token(res.logits[j], req.params, token), version):
                break
        # rejected drafts, and accepted ones after a stop, leave no KV, routing rows or SWA-pool
        # snapshot behind (a next turn resumes from that snapshot)
        self.executor.rollback(req, keep)
        req.num_computed = start + keep
        if res.routing is not None and req.params.record_routing:  # kept rows only
            out.routed_experts, out.fed_positions = res.routing[:keep], range(start, start + keep)
        if res.topk and req.params.record_indexer_topk:
            out.indexer_topk = {layer: t[:keep] for layer, t in res.topk.items()}
            out.fed_positions = range(start, start + keep)
        self.executor.after_forward(req)

    def _stop_reason(self, req: Request, token: int) -> tuple[FinishReason | None, str | int | None]:
        p = req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return FinishReason.STOP, token
        if p.stop and self.detokenize is not None:
            if req.stop_text is None:  # incremental: each token's check decodes a few tokens, not the output
                req.stop_text = (IncrementalDetokenizer(self.detokenize), StopStrings(p.stop))
            detokenizer, stops = req.stop_text
            if detokenizer.push([token]):
                found = stops.find(detokenizer.text)
                if found is not None:
                    return FinishReason.STOP, found[0]
        if req.num_generated >= p.max_tokens or len(req.tokens) >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _fail(self, req: Request, exc: Exception, outputs: list[RequestOutput]) -> None:
        """End one request with the error its own sampling or stop check raised (its state is
        dropped, not cached); the other requests of the step continue."""
        out = req.output()
        out.token_ids, out.logprobs, out.top_logprobs, out.versions = [], [], [], []
        out.finished, out.finish_reason, out.error = True, FinishReason.ERROR, f"{type(exc).__name__}: {exc}"
        self._release(req, snapshot=False)
        self.running.remove(req)
        req.pending = None
        outputs.append(out)

    def _finish(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)

    def _release(self, req: Request, snapshot: bool = True) -> None:
        """Free the request's cache state now (after offering it to the cache tiers)."""
        self.executor.release(req, snapshot=snapshot)
        if self.memory_executor is not None and req.memory is not None:
            self.memory_executor.release(req.memory, snapshot=False)
            req.memory = None

    # ---- observability ----------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"running": len(self.running), "waiting": len(self.waiting), "policy_version": self.policy_version,
               **self.executor.stats()}
        if self.speculator is not None:
            out["speculative"] = self.speculator.report()
        if self.memory_executor is not None:
            out["memory_decoder"] = self.memory_executor.stats()
        return out


__all__ += ["OutOfPages"]


def _free_bytes(device: torch.device) -> tuple[int, str] | None:
    """Memory a new allocation on ``device`` can take, and where that figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"is free on {device}"
    if device.type == "cpu":
        from megatron_s2.runtime.host_memory import HostMemory

        host = HostMemory.detect(1, gpus=False)
        return (int(host.bytes_per_rank), "of host memory is available") if host else None
    return None


def _check_memory_decoder(plugin, cfg, config: EngineConfig):
    """The memory model's family, once every engine setting it cannot honour is refused (one line each)."""
    if config.speculative:
        raise ConfigError("speculative: the drafter proposes for the backbone alone, not the memory decoder's mix; "
                          "drop --speculative (or --memory-decoder)")
    if config.prefix_caching:
        raise ConfigError("prefix_caching: the backbone would resume from a cached prefix the memory decoder has not "
                          "computed; drop --prefix-caching (or --memory-decoder)")
    mem = plugin.memory
    if set(mem.layer_ids) != set(range(mem.config.num_layers)):
        raise ConfigError("memory decoder: inference needs every layer of the memory on each rank (pp: 1)")
    plugin.check_backbone(cfg)
    family = family_of(mem.config)
    family.check_engine(mem.config, config)
    return family


def _check_state_fits(needed: int, config: EngineConfig, device: torch.device) -> None:
    """A cache larger than the device's free memory is a ConfigError naming the options, not a
    zeroing of pages that ends in the OOM killer (exit 137, no message)."""
    free = _free_bytes(device)
    if free is None or needed <= free[0]:
        return
    gib = 1024 ** 3
    raise ConfigError(f"max_model_len / max_num_seqs: the KV cache for {config.max_num_seqs} requests of "
                      f"{config.max_model_len} tokens needs {needed / gib:.1f} GiB but only {free[0] / gib:.1f} GiB "
                      f"{free[1]}; lower max_model_len (--max-model-len)"
                      + (" or max_num_seqs (serve --max-num-seqs)" if config.max_num_seqs > 1 else ""))
