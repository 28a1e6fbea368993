"""The engine behind the HTTP server: one driver thread, outputs delivered to asyncio.

:class:`EngineBackend` runs :meth:`InferenceEngine.step` on its own daemon thread whenever the
engine has work (the engine's requests API is thread-safe, a step runs on this thread only).
Each HTTP request is a :class:`Generation`: the engine requests of its choices (``n`` per
prompt, several prompts) deliver their :class:`RequestOutput` deltas from the driver thread
into one ``asyncio.Queue`` of the request's event loop, tagged with the choice index.

Failure behaviour — a server never hangs a client:

* queue full (``EngineConfig.max_waiting``) → :class:`Overloaded` (HTTP 429) at submission;
* one request fails inside the engine (its sampling or stop check raised) → that HTTP
  request gets :class:`RequestFailed` (HTTP 500, or an error event mid-stream); the engine
  and every other request go on;
* a step raises (the driver thread dies) → every open generation gets
  :class:`EngineUnavailable` (HTTP 503, or an error event mid-stream), later submissions are
  refused with the same error, ``/health`` answers 503;
* the client disconnects (streaming or not) → :meth:`Generation.events` notices within
  ``disconnect_poll_s`` and aborts every engine request of the generation, which frees their
  KV state at the next step.

:meth:`EngineBackend.run` runs other work on the model (the full forward of prompt
log-probabilities) on the same driver thread, between two engine steps and never while the
engine is paused for a weight update, so it always sees one version of the weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.engine import InferenceEngine
from megatron_s2.inference.request import FinishReason, PromptTooLong, QueueFull, RequestOutput
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.errors import BadRequest, EngineUnavailable, HTTPError, Overloaded, RequestFailed

__all__ = ["EngineBackend", "Generation", "ClientDisconnected"]

log = logging.getLogger("megatron_s2.serve")


class ClientDisconnected(Exception):
    """The HTTP client went away; the generation's engine requests were aborted."""


class EngineBackend:
    """Drives an :class:`InferenceEngine` on a background thread for an asyncio server.

    ``engine.pause()`` / ``update_weights`` / ``resume()`` may be called from any thread (a
    trainer in the same process): while paused the driver still applies new requests and
    aborts (a paused step does nothing else), so a client that leaves frees its request even
    then.
    """

    def __init__(self, engine: InferenceEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = False
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[tuple] = []
        self.counters = {"submitted": 0, "finished": 0, "aborted": 0, "refused_queue_full": 0, "failed": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._drive, name="megatron-s2-serve-driver", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the driver (after the step in flight); open generations get a 503 error."""
        self._stop = True
        self._work.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> str | None:
        """Why the driver stopped, if it did."""
        if self._error is None and (self._thread is None or not self._thread.is_alive()):
            return "the engine driver is not running"
        return self._error

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters, "open_requests": len(self._sinks), "alive": self.alive,
                "error": self.error}

    # ---- requests (event-loop thread) --------------------------------------------------------
    def submit(self, engine_id: str, prompt: list[int], params: SamplingParams, sink: asyncio.Queue, tag: int) -> None:
        """Queue one engine request whose outputs go to ``sink`` as ``(tag, RequestOutput)``
        (or ``(tag, HTTPError)`` if the engine stops). Raises the HTTP error of a refusal."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.alive:
                raise EngineUnavailable(f"the inference engine is not running ({self.error}); restart the server")
            self._sinks[engine_id] = (loop, sink, tag)
        try:
            self.engine.add_request(prompt, params, request_id=engine_id, on_output=self._deliver)
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
        self._work.set()

    async def run(self, fn, *args):
        """``fn(*args)`` on the driver thread between engine steps (not while paused); its
        result, or its exception, is delivered to the caller's event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self.alive:
                raise EngineUnavailable(f"the inference engine is not running ({self.error}); restart the server")
            self._tasks.append((fn, args, loop, future))
        self._work.set()
        return await future

    def abort(self, engine_id: str) -> None:
        if engine_id in self._sinks:
            self.counters["aborted"] += 1
            self.engine.abort(engine_id)
            self._work.set()

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

    def _drive(self) -> None:
        engine = self.engine
        while not self._stop:
            self._work.clear()
            if self._tasks and not engine.paused:
                self._run_tasks()
            if not engine.has_work():
                self._work.wait(self.idle_wait_s)
                continue
            paused = engine.paused
            try:
                engine.step()  # while paused (a weight update) a step only applies new requests and aborts
            except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
                log.exception("inference engine step failed; the server answers 503 from now on")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                return
            if paused:
                self._work.wait(self.idle_wait_s)

    def _run_tasks(self) -> None:
        with self._lock:
            tasks, self._tasks = self._tasks, []
        for fn, args, loop, future in tasks:
            try:
                result, error = fn(*args), None
            except Exception as exc:  # noqa: BLE001 - delivered to the request that asked
                log.exception("a task on the inference engine's model failed")
                result, error = None, exc
            _resolve(loop, future, result, error)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._error is None:
                self._error = reason
            sinks, self._sinks = self._sinks, {}
            tasks, self._tasks = self._tasks, []
        for entry in sinks.values():
            _put(entry, EngineUnavailable(f"the inference engine stopped: {reason}; restart the server"))
        for _, _, loop, future in tasks:
            _resolve(loop, future, None,
                     EngineUnavailable(f"the inference engine stopped: {reason}; restart the server"))


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

    def __init__(self, backend: EngineBackend, request_id: str, request=None, poll_s: float = 0.25):
        self.backend = backend
        self.request_id = request_id
        self.request = request
        self.poll_s = poll_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open: dict[int, str] = {}
        self._count = 0

    def add(self, tag: int, prompt: list[int], params: SamplingParams) -> None:
        """Submit choice ``tag``; on refusal the already submitted choices are aborted."""
        engine_id = f"{self.request_id}-{tag}"
        try:
            self.backend.submit(engine_id, prompt, params, self._queue, tag)
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
