"""The one loop that drives an inference engine — for the server, the rollouts and ``generate``.

The engine core (:class:`~megatron_s2.inference.engine.InferenceEngine`) works on token ids and
is passive: it advances one token boundary per :meth:`~InferenceEngine.step`. Everything that
runs it goes through :class:`EngineDriver`:

* on the caller's thread — :meth:`EngineDriver.step` (one iteration; RL / OPD rollouts step
  their co-located engine between collectives, report §5.2.1) and :meth:`EngineDriver.generate`
  (run given prompts to completion: ``megatron-s2 generate``, evaluation, tests);
* on a background thread — :meth:`EngineDriver.start` (the HTTP server): the same iteration in a
  loop that sleeps while there is no work.

An iteration runs at most one queued side task (:meth:`EngineDriver.submit_task`, e.g. one
batch of a request's prompt log-probabilities) and then one engine step. Side tasks never run
while the engine is paused for a weight update (so they see one version of the weights) and run
one per iteration, so a long scoring request is interleaved with decoding instead of stalling
it. A step that raises stops the driver; :attr:`EngineDriver.error` says why and every waiter is
told (``on_failure``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from megatron_s2.inference.request import CompletedRequest, RequestOutput
from megatron_s2.inference.sampling import SamplingParams

__all__ = ["EngineDriver", "DriverStopped"]

log = logging.getLogger("megatron_s2.inference")


class DriverStopped(RuntimeError):
    """The driver's engine step failed (or the driver was stopped); the engine is unusable."""


class EngineDriver:
    def __init__(self, engine, *, idle_wait_s: float = 0.05,
                 on_failure: Callable[[str], None] | None = None):
        """``on_failure(reason)`` is called once, from the driving thread, when a step raises."""
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.on_failure = on_failure
        self.error: str | None = None
        self.steps, self.step_time_s = 0, 0.0
        self._tasks: deque = deque()
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        engine.on_new_work = self._work.set  # a request / abort / resume queued from any thread

    # ---- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration on this thread: a queued side task (unless paused), then an engine step
        when there is work. Returns the step's outputs (callbacks have run). Raises
        :class:`DriverStopped` after a failed step."""
        if self.error is not None:
            raise DriverStopped(self.error)
        engine = self.engine
        if self._tasks and not engine.paused:
            self._run_one_task()
        if not engine.has_work():
            return []
        started = time.perf_counter()
        try:
            outputs = engine.step()  # while paused a step only applies new requests and aborts
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then re-raised
            self._failed(f"{type(exc).__name__}: {exc}")
            raise
        self.steps += 1
        self.step_time_s += time.perf_counter() - started
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletedRequest]:
        """Run ``prompts`` to completion on this thread (no background loop running)."""
        if self._thread is not None:
            raise RuntimeError("generate() drives the engine itself; stop() the background loop first")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        handles = [self.engine.submit(p, sp) for p, sp in zip(prompts, plist)]
        while self.engine.has_work() or self._tasks:
            self.step()
        return [h.result(timeout=0) for h in handles]

    # ---- side tasks --------------------------------------------------------------------------------
    def submit_task(self, fn: Callable[[], object], done: Callable[[object, BaseException | None], None]) -> None:
        """Run ``fn()`` on the driving thread between two engine steps (never while paused); then
        ``done(result, error)`` there. Thread-safe."""
        with self._lock:
            if self.error is not None:
                raise DriverStopped(self.error)
            self._tasks.append((fn, done))
        self._work.set()

    def _run_one_task(self) -> None:
        with self._lock:
            fn, done = self._tasks.popleft()
        try:
            result, error = fn(), None
        except Exception as exc:  # noqa: BLE001 - delivered to whoever asked for the task
            log.exception("a task on the inference engine's model failed")
            result, error = None, exc
        done(result, error)

    # ---- background loop (a server) -------------------------------------------------------------
    def start(self) -> None:
        """Iterate on a daemon thread whenever there is work (requests or tasks)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="megatron-s2-engine-driver", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the background loop after the iteration in flight; queued side tasks are told
        (``DriverStopped``) instead of waiting for a loop that no longer runs."""
        self._stop = True
        self._work.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            tasks, self._tasks = list(self._tasks), deque()
        for _, done in tasks:
            done(None, DriverStopped("the engine driver was stopped"))

    def wake(self) -> None:
        """New work was queued (a request, an abort): iterate now instead of after the idle wait."""
        self._work.set()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._work.clear()
            idle = not engine.has_work() and (not self._tasks or engine.paused)
            if idle:
                self._work.wait(self.idle_wait_s)
                continue
            paused = engine.paused
            try:
                self.step()
            except BaseException:  # noqa: BLE001 - reported by _failed; the thread ends
                log.exception("inference engine step failed; the engine is stopped")
                return
            if paused:  # nothing advances while paused: do not spin
                self._work.wait(self.idle_wait_s)

    def _failed(self, reason: str) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = reason
            tasks, self._tasks = list(self._tasks), deque()
        for _, done in tasks:
            done(None, DriverStopped(reason))
        if first and self.on_failure is not None:
            self.on_failure(reason)
