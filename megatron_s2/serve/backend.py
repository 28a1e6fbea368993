"""The engine behind the HTTP server: the inference driver's background loop, outputs delivered
to asyncio.

:class:`AsyncEngine` runs the engine with the one driver of ``inference/``
(:class:`~megatron_s2.inference.driver.EngineDriver`, on its daemon thread). Each HTTP request
is a :class:`Generation`: the engine requests of its choices (``n`` per prompt, several prompts)
deliver their :class:`RequestOutput` deltas from the driver thread into one ``asyncio.Queue`` of
the request's event loop, tagged with the choice index.

Failure behaviour — a server never hangs a client:

* queue full (``EngineConfig.max_waiting``) → :class:`Overloaded` (HTTP 429) at submission;
* one request fails inside the engine (its sampling or stop check raised) → that HTTP
  request gets :class:`RequestFailed` (HTTP 500, or an error event mid-stream); the engine
  and every other request go on;
* a step raises (the driver stops) → every open generation gets :class:`EngineUnavailable`
  (HTTP 503, or an error event mid-stream), later submissions are refused with the same error,
  ``/health`` answers 503;
* the client disconnects (streaming or not) → :meth:`Generation.events` notices within
  ``disconnect_poll_s`` and aborts every engine request of the generation, which frees their
  KV state at the next step.

:meth:`AsyncEngine.run` runs other work on the model (one batch of prompt log-probabilities) as
a driver side task: between two engine steps, one task per iteration (so decoding goes on
between the batches of a long scoring request), never while the engine is paused for a weight
update (it always sees one version of the weights).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.driver import DriverStopped, EngineDriver
from megatron_s2.inference.engine import InferenceEngine
from megatron_s2.inference.request import FinishReason, PromptTooLong, QueueFull, RequestOutput
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.errors import BadRequest, EngineUnavailable, HTTPError, Overloaded, RequestFailed

__all__ = ["AsyncEngine", "Generation", "ClientDisconnected"]

log = logging.getLogger("megatron_s2.serve")


class ClientDisconnected(Exception):
    """The HTTP client went away; the generation's engine requests were aborted."""


class AsyncEngine:
    """An :class:`InferenceEngine` driven on the driver's background thread, for an asyncio server.

    ``engine.pause()`` / ``update_weights`` / ``resume()`` may be called from any thread (a
    trainer in the same process): while paused the driver still applies new requests and
    aborts (a paused step does nothing else), so a client that leaves frees its request even
    then.
    """

    def __init__(self, engine: InferenceEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self.driver = EngineDriver(engine, idle_wait_s=idle_wait_s, on_failure=self._fail_all)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._lock = threading.Lock()
        self._closed: str | None = None
        self.counters = {"submitted": 0, "finished": 0, "aborted": 0, "refused_queue_full": 0, "failed": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.driver.start()

    def stop(self) -> None:
        """Stop the driver (after the iteration in flight); open generations get a 503 error."""
        self.driver.stop()
        self._closed = "the server is shutting down"
        self._fail_all(self._closed)

    @property
    def alive(self) -> bool:
        return self._closed is None and self.driver.alive

    @property
    def error(self) -> str | None:
        """Why the driver stopped, if it did."""
        if self.driver.error is not None:
            return self.driver.error
        if self._closed is not None:
            return self._closed
        return None if self.driver.alive else "the engine driver is not running"

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters, "open_requests": len(self._sinks), "alive": self.alive,
                "error": self.error}

    # ---- requests (event-loop thread) --------------------------------------------------------
    def submit(self, engine_id: str, prompt: list[int], params: SamplingParams, sink: asyncio.Queue, tag: int,
               images: list | None = None, *, series: list | None = None, forecast: list[int] | None = None) -> None:
        """Queue one engine request whose outputs go to ``sink`` as ``(tag, RequestOutput)``
        (or ``(tag, HTTPError)`` if the engine stops). Raises the HTTP error of a refusal.
        ``images``: the prompt's image spans (``engine.prepare_images``); ``series`` / ``forecast``: its
        series spans (``engine.prepare_series``) and the horizons asked for (:mod:`.series`)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.alive:
                raise self._unavailable()
            self._sinks[engine_id] = (loop, sink, tag)
        try:
            self.engine.add_request(prompt, params, request_id=engine_id, on_output=self._deliver, images=images,
                                    series=series, forecast=forecast)
        except QueueFull as exc:
            self._sinks.pop(engine_id, None)
            self.counters["refused_queue_full"] += 1
            raise Overloaded(str(exc)) from None
        except PromptTooLong as exc:
            self._sinks.pop(engine_id, None)
            raise BadRequest(str(exc), param="prompt") from None
        except (ConfigError, ValueError) as exc:
            self._sinks.pop(engine_id, None)
            raise BadRequest(str(exc)) from None
        self.counters["submitted"] += 1

    async def run(self, fn, *args):
        """``fn(*args)`` as a driver side task (module docstring); its result, or its exception,
        is delivered to the caller's event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.alive:
            raise self._unavailable()
        def done(result, error):
            if isinstance(error, DriverStopped):
                error = EngineUnavailable(f"the inference engine stopped: {error}; restart the server")
            _resolve(loop, future, result, error)

        try:
            self.driver.submit_task(lambda: fn(*args), done)
        except DriverStopped:
            raise self._unavailable() from None
        return await future

    def abort(self, engine_id: str) -> None:
        if engine_id in self._sinks:
            self.counters["aborted"] += 1
            self.engine.abort(engine_id)

    def _unavailable(self) -> EngineUnavailable:
        return EngineUnavailable(f"the inference engine is not running ({self.error}); restart the server")

    # ---- driver thread -----------------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            entry = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if out.finished:
            self.counters["finished"] += 1
        if entry is not None:
            if out.finish_reason is FinishReason.ERROR:
                self.counters["failed"] += 1
                _put(entry, RequestFailed(f"the request failed in the inference engine ({out.error}); "
                                          "other requests are unaffected"))
            else:
                _put(entry, out)

    def _fail_all(self, reason: str) -> None:
        """Every open generation gets a 503 (the driver's step failed, or the server stops)."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for entry in sinks.values():
            _put(entry, EngineUnavailable(f"the inference engine stopped: {reason}; restart the server"))


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
    def settle():
        if future.done():  # the request was cancelled (its client left)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the request's event loop is closed: nobody is listening
        pass


def _put(entry: tuple[asyncio.AbstractEventLoop, asyncio.Queue, int], item) -> None:
    loop, sink, tag = entry
    try:
        loop.call_soon_threadsafe(sink.put_nowait, (tag, item))
    except RuntimeError:  # the request's event loop is closed: nobody is listening
        pass


class Generation:
    """The engine requests of one HTTP request, read as one stream of tagged outputs."""

    def __init__(self, backend: AsyncEngine, request_id: str, request=None, poll_s: float = 0.25):
        self.backend = backend
        self.request_id = request_id
        self.request = request
        self.poll_s = poll_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open: dict[int, str] = {}
        self._count = 0

    def add(self, tag: int, prompt: list[int], params: SamplingParams, images: list | None = None, *,
            series: list | None = None, forecast: list[int] | None = None) -> None:
        """Submit choice ``tag``; on refusal the already submitted choices are aborted."""
        engine_id = f"{self.request_id}-{tag}"
        try:
            self.backend.submit(engine_id, prompt, params, self._queue, tag, images, series=series, forecast=forecast)
        except HTTPError:
            self.abort()
            raise
        self._open[tag] = engine_id

    def abort(self) -> None:
        for engine_id in self._open.values():
            self.backend.abort(engine_id)
        self._open.clear()

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(tag, output)`` until every choice finished. Raises :class:`ClientDisconnected`
        or the engine's :class:`EngineUnavailable`; leaving early aborts the open choices."""
        loop = asyncio.get_running_loop()
        check_at = loop.time() + self.poll_s
        try:
            while self._open:
                item = None
                try:
                    tag, item = await asyncio.wait_for(self._queue.get(), max(0.0, check_at - loop.time()))
                except asyncio.TimeoutError:
                    pass
                if loop.time() >= check_at:  # checked on a clock, also while tokens flow
                    check_at = loop.time() + self.poll_s
                    if self.request is not None and await self.request.is_disconnected():
                        raise ClientDisconnected()
                if item is None:
                    continue
                if isinstance(item, HTTPError):
                    if isinstance(item, EngineUnavailable):
                        self._open.clear()  # the engine is gone: nothing left to abort
                    else:
                        self._open.pop(tag, None)  # this choice failed; the others are aborted
                    raise item
                if item.finished:
                    self._open.pop(tag, None)
                yield tag, item
        finally:
            self.abort()
