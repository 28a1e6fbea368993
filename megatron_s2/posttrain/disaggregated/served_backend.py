"""Inference servers as the orchestrator's rollout backend, over HTTP (disaggregated RL, seed 004).

:class:`ServedRolloutBackend` implements :class:`~megatron_s2.posttrain.orchestrator.RolloutBackend`
over N ``megatron-s2 serve`` processes. Each sample is an episode of its environment, played on a
worker thread: every model call is one ``POST /inference/v1/generate`` with the context's token
ids, the sample's seed and ``logprobs: 1``; the answer's token ids, log-probs and per-token
``policy_versions`` (and, for R3, ``routed_experts``) are assembled token-in/token-out into the
sample (:class:`~megatron_s2.posttrain.multiturn.SessionBuilder`), exactly as the co-located
backend assembles its engine's calls.

* **Routing and failures**: a call goes to the live server with the fewest open calls. A server
  that refuses the connection, times out or answers 5xx is marked dead and the call is re-sent to
  another, with the same seed, so the sample is the one it would have been (counted
  ``rerouted``); no sample is lost or produced twice. A dead server is probed again
  (``/health``) and, once back (restarted by its launcher), loaded with the current weights before
  it gets calls.
* **Weights**: :meth:`update_weights` asks every live server to load the published checkpoint of
  that version (``POST /update_weights``); calls in flight continue under the new weights, their
  later tokens tagged with the new version (partial rollout across the update, per-token versions).
* **Pause** is a no-op: the servers never wait for the trainer. :meth:`snapshot` has no partial
  samples (an HTTP call's tokens arrive when it ends), so a restarted orchestrator starts its
  in-flight attempts again with the same seeds.
* **Episodes played by a client** — verifiers environments (:mod:`.served_verifiers`) and agentic
  harnesses through the orchestrator's gateway (:mod:`.served_agentic`, every model call one
  :meth:`generate`) — become samples from their traces, token-in/token-out, as co-located.
* ``ordered``: completed samples are released in submission order, so the orchestrator's
  decisions do not depend on which server answered first (the synchronous mode uses it; the
  asynchronous one releases samples as they complete).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from megatron_s2.inference.sampling import call_seed
from megatron_s2.posttrain.envs.base import Environment
from megatron_s2.posttrain.multiturn import SessionBuilder
from megatron_s2.posttrain.orchestrator import RolloutSample, SampleRequest
from megatron_s2.posttrain.routing import RoutingRecord
from megatron_s2.serve.token_api import decode_routed_experts

__all__ = ["ServedRolloutBackend", "ServerUnavailable", "ServedStats"]

_RETRY_DEAD_S = 1.0
"""How long a dead server is left alone before it is probed again."""


class ServerUnavailable(RuntimeError):
    """No inference server answered for longer than the configured wait: an infrastructure
    failure stated in one line (``megatron-s2 orchestrate`` exits with code 1, no traceback)."""

    exit_code = 1


@dataclass
class ServedStats:
    """Counters since the last :meth:`ServedRolloutBackend.take_stats`."""

    generated_tokens: int = 0
    calls: int = 0
    rerouted: int = 0
    """Calls re-sent to another server after theirs failed."""
    replayed: int = 0
    """Verifiers episodes played again with the same seed after a transport error while their
    server stayed healthy (:data:`~megatron_s2.posttrain.rollout.episode_backend.MAX_REPLAYS`)."""
    engine_time_s: float = 0.0
    """Summed wall time of the calls (a measure of server occupancy, not of elapsed time)."""


@dataclass
class _Server:
    url: str
    alive: bool = True
    open_calls: int = 0
    down_since: float = 0.0
    version: int = 0
    failures: int = 0
    answered: bool = False
    """It answered at least once (a server that never did is likely not started or a wrong URL)."""


@dataclass(order=True)
class _Done:
    order: int
    sample: RolloutSample | None = field(compare=False, default=None)
    error: BaseException | None = field(compare=False, default=None)


class ServedRolloutBackend:
    def __init__(self, servers: Sequence[str], environments: Mapping[str, Environment], *, weights_path:
                 Callable[[int], str], record_routing: bool, max_model_len: int, max_concurrent: int,
                 request_timeout_s: float, server_wait_s: float, ordered: bool, version: int = 0, log=print,
                 verifiers=None, agentic=None):
        """``weights_path(version)``: the published checkpoint of a policy version; ``verifiers``:
        a :class:`~.served_verifiers.ServedVerifiers` playing the verifiers datasets' episodes;
        ``agentic``: a :class:`~.served_agentic.ServedAgentic` playing the agentic datasets' episodes
        (its gateway is served over this backend's servers)."""
        import httpx

        if not servers:
            raise ValueError("no inference servers")
        self.servers = [_Server(u.rstrip("/"), version=version) for u in servers]
        self.envs, self.weights_path = dict(environments), weights_path
        self.record_routing, self.max_model_len, self.max_concurrent = record_routing, max_model_len, max_concurrent
        self.timeout_s, self.server_wait_s, self.ordered, self.log = request_timeout_s, server_wait_s, ordered, log
        self._version = version
        self._http = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                  limits=httpx.Limits(max_connections=max_concurrent + 2 * len(servers)))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent,
                                                           thread_name_prefix="megatron-s2-rollout")
        self._lock = threading.Lock()
        self._order = 0
        self._next_release = 0
        self._done: list[_Done] = []
        self._open: dict[int, int] = {}  # sample_id -> submission order
        self._aborted: set[int] = set()
        self._closing = False
        self.stats = ServedStats()
        self.verifiers = verifiers
        self.agentic = agentic
        if agentic is not None:
            agentic.bind(self)

    # ---- protocol -----------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def any_busy(self) -> bool:
        with self._lock:
            return bool(self._open)

    def submit(self, requests: Sequence[SampleRequest]) -> None:
        for req in requests:
            if req.resume_from is not None and req.resume_from.num_generated:
                raise ValueError(f"sample {req.sample_id}: served rollouts restart in-flight samples from scratch "
                                 "(set rollout.resume_in_flight: discard)")
            with self._lock:
                order, self._order = self._order, self._order + 1
                self._open[req.sample_id] = order
            self._pool.submit(self._run_episode, req, order)

    def poll(self) -> list[RolloutSample]:
        with self._lock:
            done, keep = [], []
            for d in sorted(self._done):
                if self.ordered and d.order != self._next_release:
                    keep.append(d)
                    continue
                done.append(d)
                self._next_release = d.order + 1
            self._done = keep
        out = []
        for d in done:
            if d.error is not None:
                raise d.error
            if d.sample is not None:
                out.append(d.sample)
        if not out:
            time.sleep(0.002)  # nothing new: do not spin the orchestrator's core
        return sorted(out, key=lambda s: s.sample_id)

    def pause(self) -> None:
        """The servers never wait for the trainer (asynchronous RL)."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def update_weights(self, version: int) -> None:
        """Every live server loads the published weights of ``version`` (in parallel)."""
        if version == self._version:
            return
        path = self.weights_path(version)
        errors: list[str] = []
        self._each(lambda s: self._load(s, path, version, errors), [s for s in self.servers if s.alive])
        if errors:
            raise RuntimeError(errors[0])
        self._version = version

    def set_version(self, version: int) -> None:
        """The servers serve ``version`` (loaded by another client of them: the trainer's first
        rank before an evaluation); a server that comes back is loaded with it."""
        self._version = version

    def generate(self, prompt: list[int], params: dict) -> dict:
        """One ``/inference/v1/generate`` call's first choice, routed and re-routed as an
        episode's calls are (held-out evaluation, :mod:`.served_eval`)."""
        return self._generate(prompt, params)

    def snapshot(self) -> list[RolloutSample]:
        return []  # see the module docstring

    def abort(self, sample_ids: Sequence[int]) -> None:
        with self._lock:
            self._aborted.update(sample_ids)

    def take_stats(self) -> ServedStats:
        with self._lock:
            stats, self.stats = self.stats, ServedStats()
        return stats

    def close(self) -> None:
        """Stop: calls still in flight are abandoned (their samples were never going to be trained)."""
        self._closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.agentic is not None:  # its episodes' calls in flight end with ServerUnavailable ("closing")
            self.agentic.close()
        self._http.close()
        if self.verifiers is not None:
            self.verifiers.close()

    # ---- servers ------------------------------------------------------------------------------------
    @staticmethod
    def _each(fn, items) -> None:
        """``fn(item)`` for every item at once (one thread each), returning when all are done."""
        threads = [threading.Thread(target=fn, args=(x,)) for x in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _load(self, server: _Server, path: str, version: int, errors: list[str]) -> None:
        try:
            r = self._http.post(f"{server.url}/update_weights", json={"path": path, "version": version})
        except Exception as exc:  # noqa: BLE001 - a dead server is re-loaded when it comes back
            self._mark_dead(server, f"update_weights failed ({type(exc).__name__})")
            return
        server.answered = True
        if r.status_code >= 500:
            self._mark_dead(server, f"update_weights answered {r.status_code}")
        elif r.status_code == 409:  # it serves a newer version already (another orchestrator's update)
            self.log(f"orchestrator: inference server {server.url} already serves a newer version than {version}")
        elif r.status_code != 200:
            errors.append(f"inference server {server.url}: /update_weights {path} -> {r.status_code} {r.text[:300]}")
        else:
            server.version = version

    def _mark_dead(self, server: _Server, why: str) -> None:
        if self._closing:
            return
        with self._lock:
            if server.alive:
                self.log(f"orchestrator: inference server {server.url} is down ({why}); its requests go to the others")
            server.alive, server.down_since = False, time.monotonic()
            server.failures += 1

    def _revive(self, server: _Server) -> None:
        """Probe a dead server; once it answers, give it the current weights and calls again."""
        server.down_since = time.monotonic()
        try:
            health = self._http.get(f"{server.url}/health", timeout=1.0)
            server.answered = True
            if health.status_code != 200:
                return
            version = self._version
            if version != server.version or server.failures:
                r = self._http.post(f"{server.url}/update_weights",
                                    json={"path": self.weights_path(version), "version": version}) if version else None
                if r is not None and r.status_code != 200:
                    return
            server.version, server.alive = version, True
            self.log(f"orchestrator: inference server {server.url} is back (policy version {version})")
        except Exception:  # noqa: BLE001 - still down
            return

    def _pick(self) -> _Server:
        deadline = time.monotonic() + self.server_wait_s
        while True:
            with self._lock:
                now = time.monotonic()
                dead = [s for s in self.servers if not s.alive and now - s.down_since > _RETRY_DEAD_S]
            for s in dead:
                self._revive(s)
            with self._lock:
                live = [s for s in self.servers if s.alive]
                if live:
                    server = min(live, key=lambda s: s.open_calls)
                    server.open_calls += 1
                    return server
            if time.monotonic() > deadline:
                raise ServerUnavailable(self._unavailable())
            time.sleep(0.2)

    def _unavailable(self) -> str:
        never = [s.url for s in self.servers if not s.answered]
        gone = [s.url for s in self.servers if s.answered]
        which = "; ".join([*([f"{', '.join(never)} never answered"] if never else []),
                           *([f"{', '.join(gone)} stopped answering (see their logs)"] if gone else [])])
        return (f"no inference server answered for {self.server_wait_s:g} s: {which}; start the servers "
                "(megatron-s2 serve), check --servers, or raise rl.disaggregated.server_wait_s")

    def _generate(self, prompt: list[int], params: dict) -> dict:
        """One model call, re-routed until a server answers it."""
        import httpx

        server, retried = None, False
        while True:
            server = server or self._pick()
            t0 = time.perf_counter()
            try:
                r = self._http.post(f"{server.url}/inference/v1/generate",
                                    json={"token_ids": prompt, "sampling_params": params})
            except Exception as exc:  # noqa: BLE001 - connection refused / reset, timeout
                error, r = type(exc).__name__, None
                # A pooled connection the server closed as idle fails once on reuse (ReadError,
                # RemoteProtocolError): the same server is tried again on a new connection before
                # it is presumed dead. A refused connection or a timeout means it is gone.
                transient = not isinstance(exc, (httpx.ConnectError, httpx.TimeoutException))
            finally:
                with self._lock:
                    server.open_calls -= 1
            if r is not None:
                server.answered = True
            if r is not None and r.status_code == 200:
                with self._lock:
                    self.stats.calls += 1
                    self.stats.engine_time_s += time.perf_counter() - t0
                return r.json()["choices"][0]
            if r is not None and r.status_code < 500 and r.status_code != 429:
                raise RuntimeError(f"inference server {server.url}: /inference/v1/generate -> {r.status_code} "
                                   f"{r.text[:300]}")
            if self._closing:
                raise ServerUnavailable("the orchestrator is closing")
            if r is None and transient and not retried:
                retried = True
                with self._lock:
                    server.open_calls += 1
                continue
            if r is not None and r.status_code == 429:  # queue full: wait, then any server
                time.sleep(0.05)
            else:
                self._mark_dead(server, error if r is None else f"HTTP {r.status_code}")
                with self._lock:
                    self.stats.rerouted += 1
            server, retried = None, False

    # ---- one episode (worker thread) ----------------------------------------------------------------
    def _run_episode(self, req: SampleRequest, order: int) -> None:
        try:
            sample = self._episode(req)
            item = _Done(order, sample)
        except BaseException as exc:  # noqa: BLE001 - delivered to the orchestrator's thread by poll()
            item = _Done(order, None, exc)
        with self._lock:
            self._open.pop(req.sample_id, None)
            if req.sample_id in self._aborted:
                self._aborted.discard(req.sample_id)
                item.sample = None
            self._done.append(item)

    def _episode(self, req: SampleRequest) -> RolloutSample:
        if self.verifiers is not None and req.dataset in self.verifiers.envs:
            return self._verifiers_episode(req)
        if self.agentic is not None and req.dataset in self.agentic.envs:
            return self._agentic_episode(req)
        episode = self.envs[req.dataset].episode(req.index, "train", req.effort)
        builder = SessionBuilder(req.sample_id)
        context, calls = episode.prompt_tokens(), 0
        while True:
            room = self.max_model_len - len(context)
            if room < 1:
                raise ValueError(f"sample {req.sample_id}: no room to generate ({len(context)} context tokens, "
                                 f"max_model_len {self.max_model_len}); raise training.seq_length")
            # the co-located backend's seeds: one stream per model call of the episode
            params = {"max_tokens": min(req.max_new_tokens, room), "temperature": req.temperature,
                      "top_p": req.top_p, "seed": call_seed(req.seed, calls), "logprobs": 1,
                      "skip_special_tokens": False}
            start = builder.routed_end if self.record_routing and calls else 0
            if self.record_routing:
                params.update(return_routed_experts=True, routed_experts_prompt_start=start)
            choice = self._generate(context, params)
            ids = list(choice["token_ids"])
            logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
            versions = list(choice["policy_versions"])
            routing = self._routing(choice, context, ids, versions, start) if self.record_routing else None
            builder.add_model_call(context, ids, logprobs, versions, routing)
            with self._lock:
                self.stats.generated_tokens += len(ids)
            calls += 1
            reason = choice["finish_reason"] or "abort"
            step = episode.step(ids, reason)
            if not step.done and len(builder.tokens) + len(step.delta) + 1 >= self.max_model_len:
                step.done, step.reward, step.correct = True, 0.0, False  # no room for another turn
            if step.done:
                break
            context = builder.tokens + step.delta
        (sample,) = builder.build(reward=step.reward, finish_reason=reason)
        sample.prompt_length = len(episode.prompt_tokens())
        sample.dataset, sample.group_id, sample.prompt_uid = req.dataset, req.group_id, req.prompt_uid
        sample.effort, sample.correct = req.effort, step.correct
        return sample

    def _verifiers_episode(self, req: SampleRequest) -> RolloutSample:
        sample = self.play_verifiers(req.dataset, req.index, "train", sample_id=req.sample_id,
                                     temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_new_tokens,
                                     seed=req.seed, where=f"rollout: verifiers episode of sample {req.sample_id} "
                                                          f"(prompt {req.prompt_uid})")
        sample.dataset, sample.group_id, sample.prompt_uid, sample.effort = (req.dataset, req.group_id,
                                                                             req.prompt_uid, req.effort)
        return sample

    def _agentic_episode(self, req: SampleRequest) -> RolloutSample:
        sample = self.play_agentic(req.dataset, req.index, "train", sample_id=req.sample_id,
                                   temperature=req.temperature, max_tokens=req.max_new_tokens, seed=req.seed,
                                   where=f"rollout: agentic episode of sample {req.sample_id} (prompt {req.prompt_uid})")
        for row in sample.rows:  # the sample and the further branches of its episode (episode_rows)
            row.dataset, row.group_id, row.prompt_uid, row.effort = req.dataset, req.group_id, req.prompt_uid, req.effort
        return sample

    def play_agentic(self, dataset: str, index: int, split: str, *, sample_id: int, temperature: float,
                     max_tokens: int, seed: int, where: str) -> RolloutSample:
        """A harness episode (instance ``index`` of ``dataset``'s ``split``) through the orchestrator's
        gateway, each of its model calls routed and re-routed as :meth:`generate` (:mod:`.served_agentic`);
        also the held-out episodes of :mod:`.served_eval`."""
        sample = self.agentic.play(dataset, index, split, sample_id=sample_id, temperature=temperature,
                                   max_tokens=max_tokens, seed=seed, where=where)
        with self._lock:
            self.stats.generated_tokens += sample.num_generated
        return sample

    def play_verifiers(self, dataset: str, index: int, split: str, *, sample_id: int, temperature: float,
                       top_p: float, max_tokens: int, seed: int, where: str) -> RolloutSample:
        """A verifiers episode (task ``index`` of ``dataset``'s ``split``) on one server, played again
        elsewhere with the same seed when that server died under it (:mod:`.served_verifiers`);
        also the held-out episodes of :mod:`.served_eval`."""
        from megatron_s2.posttrain.rollout.episode_backend import MAX_REPLAYS
        from megatron_s2.posttrain.rollout.vf_backend import only_trace, transport_error
        from megatron_s2.posttrain.rollout.vf_trace import trace_sample

        replays = 0
        while True:
            server = self._pick()
            version = server.version  # the oldest any of its tokens can be (module docstring of served_verifiers)
            try:
                episode = self.verifiers.play(dataset, index, server.url, split=split, temperature=temperature,
                                              top_p=top_p, max_tokens=max_tokens, seed=seed, timeout_s=self.timeout_s)
            except TimeoutError as exc:  # EpisodeTimeout: cancelled; presumed dead as a generation call that long
                episode, hung = None, str(exc)
            finally:
                with self._lock:
                    server.open_calls -= 1
            if episode is None:
                if self._closing:
                    raise ServerUnavailable("the orchestrator is closing")
                self._mark_dead(server, hung)
                with self._lock:
                    self.stats.rerouted += 1
                continue
            if not episode.ok and not self._closing and not self._healthy(server):
                self._mark_dead(server, "it failed during a verifiers episode")
                with self._lock:
                    self.stats.rerouted += 1
                continue
            error = transport_error(episode)
            if error is not None and replays < MAX_REPLAYS and not self._closing:  # a dropped connection, as co-located
                replays += 1
                with self._lock:
                    self.stats.replayed += 1
                self.log(f"orchestrator: {where} failed on a transport error ({error}) while {server.url} stayed "
                         f"healthy; playing it again with the same seed (replay {replays} of {MAX_REPLAYS})")
                continue
            trace = only_trace(episode, where)
            sample = trace_sample(trace, sample_id, version=version, layer_ids=self._trace_layers(trace))
            break
        server.answered = True
        with self._lock:
            self.stats.generated_tokens += sample.num_generated
            self.stats.calls += 1
        return sample

    def _trace_layers(self, trace) -> list[int] | None:
        """R3: the layer ids of the routed experts the servers returned into a verifiers trace (as
        :meth:`_routing` numbers them); [] when they returned none (the trace is then refused by name)."""
        if not self.record_routing:
            return None
        routed = next((b.routed_experts for b in reversed(trace.branches) if b.trainable), None)
        return [] if routed is None else list(range(np.asarray(routed).shape[1]))

    def _healthy(self, server: _Server) -> bool:
        try:
            return self._http.get(f"{server.url}/health", timeout=2.0).status_code == 200
        except Exception:  # noqa: BLE001 - down
            return False

    @staticmethod
    def _routing(choice: dict, context: list[int], ids: list[int], versions: list[int], start: int) -> RoutingRecord:
        """The call's R3 record of the positions it fed from ``start`` (context + ids[:-1]); a fed
        position's version is that of the token its forward produced (the prefill: the first)."""
        routed = choice["routed_experts"]
        rows = decode_routed_experts(routed)
        rows = np.where(rows < 0, np.arange(rows.shape[-1], dtype=np.int32), rows)  # positions never routed
        end = len(context) + len(ids) - 1
        if rows.shape[0] != end - start:
            raise ValueError(f"routing: the server returned {rows.shape[0]} rows for positions {start}..{end}")
        fed = [versions[0]] * len(context) + versions[1:]
        rec = RoutingRecord.from_array(rows, list(range(rows.shape[1])), start=start)
        rec.versions = torch.tensor(fed[start:end], dtype=torch.int32)
        return rec
