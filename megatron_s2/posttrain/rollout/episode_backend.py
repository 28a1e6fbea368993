"""The part of the orchestrator's rollout back end that every *episode* back end shares: episodes
played by a client through our in-process server on the co-located engine (report §5.2.1), whose
finished traces become samples — verifiers environments (:mod:`.vf_backend`) and agentic harness
episodes (:mod:`.agentic_backend`).

What is common, and lives here once: the single-rank replica rule (an HTTP request reaches one
rank's engine), the queue of owned requests, the poll that launches, collects and all-gathers
finished samples across data-parallel replicas, the pause that lets every running episode *finish*
before the engine pauses (a trace keeps no per-token policy version, so none may straddle an
update), no partial samples at a snapshot (in-flight attempts restart from scratch), aborts and
the rollout statistics. A subclass says how to start its clients (:meth:`_start`), launch pending
requests (:meth:`_launch`) and turn a finished episode into a sample (:meth:`_sample`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.orchestrator import RolloutSample, SampleRequest
from megatron_s2.posttrain.rollout.engine_backend import RolloutStats
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects

__all__ = ["EpisodeBackend", "EpisodeRun", "MAX_REPLAYS", "SERVED_MODEL", "bypass_proxies_for_loopback"]

SERVED_MODEL = "policy"
"""The model id the in-process server serves and the episodes ask for."""

MAX_REPLAYS = 2
"""Times an episode that failed on a transport error (its connection to the in-process server
dropped) is played again with the same seed before its error stops the run. Only transport errors:
a rubric, harness or user-code error is the environment's, and replaying it would hide it."""


def bypass_proxies_for_loopback() -> None:
    """The episodes' HTTP hops (harness -> our server, possibly through verifiers' interception
    server) are all on 127.0.0.1, but httpx (and harness subprocesses, which inherit the
    environment) send them to ``http_proxy`` / ``ALL_PROXY`` when those are set, as on many
    clusters: every episode then fails with a connection error. Loopback is added to
    ``NO_PROXY`` / ``no_proxy`` (other entries kept)."""
    for var in ("NO_PROXY", "no_proxy"):
        hosts = [h.strip() for h in os.environ.get(var, "").split(",") if h.strip()]
        if "*" not in hosts:
            os.environ[var] = ",".join(hosts + [h for h in ("127.0.0.1", "localhost") if h not in hosts])


@dataclass
class EpisodeRun:
    request: SampleRequest
    version: int
    """Policy version of the engine when the episode started."""
    future: concurrent.futures.Future
    end_version: int = -1
    """Policy version of the engine when the episode finished (equal unless an update overlapped it)."""
    noted: threading.Event = field(default_factory=threading.Event)
    """Set by the done-callback once ``end_version`` is recorded. A concurrent future reports done()
    before its done-callbacks run (set_result sets the state, wakes the waiters, then calls them), so
    done() alone may still see end_version = -1 — on a loaded machine that read as an update that
    overlapped the episode (measured: a 256-a-step verifiers run stopped at step 25, "version 24 -> -1")."""


class EpisodeBackend(abc.ABC):
    """:class:`~megatron_s2.posttrain.orchestrator.RolloutBackend` for client-played episodes
    (module docstring). ``WHAT`` names the episodes in errors ("verifiers environments")."""

    WHAT = "episodes"

    def __init__(self, engine, environments: Mapping[str, object], *, tokenizer, topology: ReplicaTopology,
                 layer_ids: Sequence[int], record_routing: bool, max_concurrent: int,
                 weight_loader: Callable[[int], None] | None = None, log: Callable[[str], None] = print):
        """``environments``: dataset name -> the kind's environment; ``max_concurrent``: episodes
        running at once on this replica; ``log``: one line per replayed episode."""
        if topology.count != topology.world_size:
            raise ConfigError(f"parallel: {self.WHAT} reach the rollout engine over HTTP on one rank, but this "
                              f"layout's rollout replicas span {topology.world_size // topology.count} ranks "
                              "(tp / ep / engram parallel); use tp=1, ep=1 (data parallel only) for this phase")
        self.engine, self.envs, self.tokenizer, self.topology = engine, dict(environments), tokenizer, topology
        self.layer_ids = list(layer_ids) if record_routing else None
        self.max_concurrent, self.weight_loader, self.log = max(1, max_concurrent), weight_loader, log
        self._stats_lock = threading.Lock()  # replays are counted on the episodes' loop thread
        self._pending: list[SampleRequest] = []
        self._running: dict[int, EpisodeRun] = {}
        self._done: list[RolloutSample] = []
        self._wake = threading.Event()
        self.paused = False
        self.any_busy = False
        self.stats = RolloutStats()

    # ---- what a kind provides -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def started(self) -> bool:
        """Whether :meth:`_start` has run (the server and the clients are up)."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Serve the engine in process and set up the clients; called by the first poll."""

    @abc.abstractmethod
    def _launch(self) -> None:
        """Start pending requests' episodes, up to ``max_concurrent`` running."""

    @abc.abstractmethod
    def _sample(self, run: EpisodeRun) -> RolloutSample:
        """The trainer sample of a finished episode (its future is done)."""

    def _finished(self, run: EpisodeRun) -> None:
        """Done-callback of an episode's future (a worker thread): note the engine's version, wake the poll."""
        try:
            run.end_version = self.engine.policy_version
        finally:  # a failure here (futures only log it) must not leave pause() waiting forever
            run.noted.set()
            self._wake.set()

    def _collect(self) -> int:
        """Ingest finished episodes into ``_done`` in sample order; how many finished."""
        self._wake.clear()
        finished = [sid for sid, run in self._running.items() if run.noted.is_set()]  # done and its version noted
        for sid in sorted(finished):
            run = self._running.pop(sid)
            self._done.append(self._sample(run))
        return len(finished)

    def _serve(self, **config):
        """Serve the co-located engine on 127.0.0.1 in this process (uvicorn on a background
        thread; its driver thread steps the engine): the server the episodes' clients call.
        ``config``: further :class:`~megatron_s2.serve.ServeConfig` fields."""
        from megatron_s2.serve import ServeConfig, ServerThread
        from megatron_s2.serve.backend import AsyncEngine
        from megatron_s2.serve.state import ServerState

        bypass_proxies_for_loopback()
        # logprobs_mode: the loss needs the behaviour log-prob under the distribution each token was
        # drawn from, not the server's (vLLM's) default of the raw model distribution
        settings = ServeConfig(return_routed_experts=self.layer_ids is not None, disconnect_poll_s=0.05,
                               logprobs_mode="processed_logprobs", **config)
        state = ServerState(AsyncEngine(self.engine), self.tokenizer, settings, SERVED_MODEL,
                            "the co-located rollout engine")
        state.max_token_bytes  # noqa: B018 - computed once here, not on the first request's turn
        return ServerThread(state, keep_alive_s=3600.0).start()  # see ServerThread

    # ---- protocol ---------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, requests: Sequence[SampleRequest]) -> None:
        for req in requests:
            if req.resume_from is not None and req.resume_from.num_generated:
                raise ValueError(f"sample {req.sample_id}: {self.WHAT} cannot resume from a partial sample")
            if self.topology.owns(req.sample_id):
                self._pending.append(req)  # launched by the next poll (the engine runs only while polled)

    def poll(self) -> list[RolloutSample]:
        if not self.started:
            self._start()
        if not self.paused:
            self._launch()
        if self._running and not self._collect():
            self._wake.wait(0.05)  # let the engine and the episodes run instead of spinning
            self._collect()
        done = [s.state_dict() for s in self._done]
        self._done = []
        busy = bool(self._running or self._pending)
        gathered = gather_objects({"done": done, "busy": busy}, self.topology)
        self.any_busy = any(part["busy"] for part in gathered)
        out = [RolloutSample.from_state_dict(x) for part in gathered for x in part["done"]]
        return sorted(out, key=lambda s: s.sample_id)

    def pause(self) -> None:
        """Stop launching, let every running episode finish (no trace straddles an update), then
        pause the engine."""
        self.paused = True
        for run in list(self._running.values()):
            run.noted.wait()  # the episode finished and its done-callback noted the version before any update
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()
        self.paused = False

    def update_weights(self, version: int) -> None:
        if self.weight_loader is not None:
            self.weight_loader(version)
        self.engine.set_policy_version(version)

    def snapshot(self) -> list[RolloutSample]:
        return []  # no partial traces (module docstring): in-flight attempts restart from scratch

    def abort(self, sample_ids: Sequence[int]) -> None:
        drop = set(sample_ids)
        self._pending = [r for r in self._pending if r.sample_id not in drop]
        self._done = [s for s in self._done if s.sample_id not in drop]
        for sid in drop:
            run = self._running.pop(sid, None)
            if run is not None:
                run.future.cancel()

    def note_replay(self, where: str, error: str, replay: int) -> None:
        """Count and log (one line) an episode played again after a transport error."""
        with self._stats_lock:
            self.stats.replayed += 1
        self.log(f"rollout: {where} failed on a transport error ({error}); playing it again with the same seed "
                 f"(replay {replay} of {MAX_REPLAYS})")

    def take_stats(self) -> RolloutStats:
        with self._stats_lock:
            stats, self.stats = self.stats, RolloutStats()
        return stats
