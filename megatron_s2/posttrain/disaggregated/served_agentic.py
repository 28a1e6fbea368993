"""Agentic episodes through the inference servers (disaggregated RL; issue 25, seed 004).

The co-located run serves its own engine with the agent gateway in process
(:class:`~megatron_s2.posttrain.rollout.agentic_backend.AgenticBackend`); the orchestrator of a
disaggregated run serves the *same gateway* (:mod:`megatron_s2.serve.gateway`: its protocols,
sessions, TITO capture into a PrefixTree trace store) on 127.0.0.1 in its own process, over
:class:`ServedEngine` instead of an engine: each model call the gateway makes is one ``POST
/inference/v1/generate`` to an inference server — the prompt ids TITO assembled in, the sampled
ids, their log-probs, per-token policy versions and (R3) the routed experts of every fed position
out — so the trace holds exactly the servers' tokens, as co-located it holds the engine's. The
harness, its sandbox and the grader run in the orchestrator (the Prime Intellect talk: the
orchestrator runs the environments, the servers only answer); a finished episode becomes the
sample as co-located (:func:`~megatron_s2.posttrain.rollout.agentic_backend._episode_sample`: one row per
trace branch of a harness that re-renders its history, :mod:`megatron_s2.posttrain.episode_rows`).

* **Seeds**: the harnesses send none; each episode's session is seeded from its sample's seed
  (``ServerState.session_seeds``: call ``k`` samples with ``call_seed(seed, k)``), in both modes,
  so with ``max_async_level: 0`` a disaggregated run plays the co-located run's episodes.
* **Routing and failures**: every call goes to the live server with the fewest open calls and,
  when its server dies (refused, timed out, 5xx), is re-sent to another with the same seed
  (:meth:`~.served_backend.ServedRolloutBackend.generate`, counted ``rerouted``): the episode goes
  on exactly as it would have — its sandbox is not replayed — so no sample is lost or produced
  twice. (A verifiers episode is played again instead: its client talks to one server directly.)
* **Versions**: the trace store keeps no per-token version, so an episode's tokens are labelled
  with the oldest version any server had when it started — versions only grow, and a server that
  comes back is loaded with the current one before it gets calls — the conservative label of
  :mod:`.served_verifiers`: a kept sample is never older than ``max_async_level``. The behaviour
  log-probs are each token's own (the servers'), so the loss is exact.
* **Held-out evaluation**: the trainer plays the held-out instances the same way through the
  servers (:class:`~.served_eval.ServedEvaluator`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Mapping

import torch

from megatron_s2.inference.request import FinishReason, RequestOutput
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.posttrain.disaggregated.served_backend import ServerUnavailable
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.serve.errors import BadRequest, EngineUnavailable, RequestFailed
from megatron_s2.serve.token_api import decode_routed_experts

__all__ = ["ServedAgentic", "ServedEngine"]


@dataclass(frozen=True)
class _Limits:
    """The servers' limits where the gateway reads an engine's (``ServerState``)."""

    max_model_len: int
    max_waiting: int
    vocab_size: int

    @property
    def config(self) -> "_Limits":
        return self

    @property
    def model_config(self) -> "_Limits":
        return self


def wire_sampling(params: SamplingParams, record_routing: bool) -> dict:
    """A gateway call's engine parameters as ``/inference/v1/generate``'s ``sampling_params``;
    ``tool_choice`` none / required go as the token endpoint's ``banned_token_ids`` /
    ``required_token_id`` (smolagents' ToolCallingAgent always asks for ``required``)."""
    wire = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "seed": params.seed, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos, "logprobs": 1, "skip_special_tokens": False}
    if params.stop:
        wire["stop"] = list(params.stop)
    if params.banned_token_ids:
        wire["banned_token_ids"] = list(params.banned_token_ids)
    if params.required_token_id is not None:
        wire["required_token_id"] = params.required_token_id
    if record_routing:  # every fed position from 0: the capture fills the reused nodes' records too
        wire.update(return_routed_experts=True, routed_experts_prompt_start=0)
    return wire


def choice_output(request_id: str, choice: dict) -> RequestOutput:
    """One ``/inference/v1/generate`` choice as the engine's single, finished output."""
    ids = [int(t) for t in choice["token_ids"]]
    routed, fed = choice.get("routed_experts"), range(0)
    rows = None
    if routed is not None:
        rows = torch.from_numpy(decode_routed_experts(routed))
        fed = range(int(routed["start"]), int(routed["start"]) + rows.shape[0])
    return RequestOutput(request_id, token_ids=ids, logprobs=[e["logprob"] for e in choice["logprobs"]["content"]],
                         top_logprobs=[[] for _ in ids], versions=[int(v) for v in choice["policy_versions"]],
                         routed_experts=rows, fed_positions=fed, finished=True,
                         finish_reason=FinishReason(choice["finish_reason"] or "abort"))


class ServedEngine:
    """The inference servers behind the part of :class:`~megatron_s2.serve.backend.AsyncEngine`
    the gateway uses: :meth:`submit` sends the call on a worker thread (routed and re-routed by
    the backend) and delivers its one finished output to the caller's event loop."""

    def __init__(self, backend, *, max_model_len: int, vocab_size: int, max_concurrent: int):
        """``backend``: a :class:`~.served_backend.ServedRolloutBackend` (its routing, its servers)."""
        self.backend = backend
        self.engine = _Limits(max_model_len, max_concurrent, vocab_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent,
                                                           thread_name_prefix="megatron-s2-gateway-call")
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._closed: str | None = None
        self.counters = {"submitted": 0, "finished": 0, "aborted": 0, "failed": 0}

    def start(self) -> None:
        """Nothing to start: the servers run on their own."""

    def stop(self) -> None:
        self._closed = "the orchestrator is closing"
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._closed is None

    @property
    def error(self) -> str | None:
        return self._closed

    def stats(self) -> dict:
        return {**self.counters, "alive": self.alive, "error": self.error}

    def submit(self, engine_id: str, prompt: list[int], params: SamplingParams, sink: asyncio.Queue, tag: int,
               images: list | None = None, *, series: list | None = None, forecast: list[int] | None = None) -> None:
        if images or series or forecast:
            raise BadRequest("multimodal inputs are not served through the inference servers")
        if not self.alive:
            raise EngineUnavailable(f"the inference servers are not reachable ({self._closed})")
        wire = wire_sampling(params, self.backend.record_routing)
        loop = asyncio.get_running_loop()
        with self._lock:
            self.counters["submitted"] += 1
        self._pool.submit(self._call, engine_id, list(prompt), wire, loop, sink, tag)

    def abort(self, engine_id: str) -> None:
        """The call still runs on its server; its output is dropped."""
        with self._lock:
            self._aborted.add(engine_id)
            self.counters["aborted"] += 1

    def _call(self, engine_id: str, prompt: list[int], wire: dict, loop, sink, tag: int) -> None:
        try:
            item, outcome = choice_output(engine_id, self.backend.generate(prompt, wire)), "finished"
        except ServerUnavailable as exc:  # none answered for server_wait_s, or the orchestrator closes
            item, outcome = EngineUnavailable(f"the inference servers: {exc}"), "failed"
        except Exception as exc:  # noqa: BLE001 - delivered to the gateway's request as its HTTP error
            item, outcome = RequestFailed(f"the inference servers: {exc}"), "failed"
        with self._lock:
            self.counters[outcome] += 1
            if engine_id in self._aborted:
                self._aborted.discard(engine_id)
                return
        try:
            loop.call_soon_threadsafe(sink.put_nowait, (tag, item))
        except RuntimeError:  # the request's event loop is closed: nobody is listening
            pass


class ServedAgentic:
    """The agentic side of :class:`~.served_backend.ServedRolloutBackend` (module docstring)."""

    def __init__(self, environments: Mapping[str, object], tokenizer, *, vocab_size: int):
        """``environments``: dataset name -> :class:`~megatron_s2.posttrain.envs.agentic_env.AgenticEnvironment`."""
        self.envs, self.tokenizer, self.vocab_size = dict(environments), tokenizer, vocab_size
        self.server = self.trace_dir = self.backend = None
        self._sessions = itertools.count()
        # the environment's max_concurrent episodes (sandboxes) at once; 0 = as many as the backend runs
        self._slots = {name: threading.BoundedSemaphore(e.config.max_concurrent) for name, e in self.envs.items()
                       if e.config.max_concurrent}

    def bind(self, backend) -> None:
        """Serve the gateway over ``backend``'s servers (called by the backend it belongs to)."""
        from megatron_s2.posttrain.rollout.episode_backend import SERVED_MODEL, bypass_proxies_for_loopback
        from megatron_s2.serve import ServeConfig, ServerThread
        from megatron_s2.serve.state import ServerState

        bypass_proxies_for_loopback()
        self.backend = backend
        self.trace_dir = tempfile.mkdtemp(prefix="megatron-s2-agentic-traces-")
        concurrent = max([e.config.max_concurrent for e in self.envs.values()] + [backend.max_concurrent])
        engine = ServedEngine(backend, max_model_len=backend.max_model_len, vocab_size=self.vocab_size,
                              max_concurrent=concurrent)
        settings = ServeConfig(gateway_traces=self.trace_dir, disconnect_poll_s=0.05)
        state = ServerState(engine, self.tokenizer, settings, SERVED_MODEL, "the inference servers")
        state.max_token_bytes  # noqa: B018 - computed once here, not on the first call's turn
        # request_timeout_s per call, re-routed: a harness call may wait several of them
        self.server = ServerThread(state, keep_alive_s=3600.0).start()

    def play(self, dataset: str, index: int, split: str, *, sample_id: int, temperature: float, max_tokens: int,
             seed: int, where: str) -> RolloutSample:
        """One episode of instance ``index`` of ``dataset``'s ``split`` through the gateway and the
        servers; its sample, every token labelled with the oldest version a server had at its start."""
        with self._slots.get(dataset) or contextlib.nullcontext():
            return self._play(dataset, index, split, sample_id=sample_id, temperature=temperature,
                              max_tokens=max_tokens, seed=seed, where=where)

    def _play(self, dataset: str, index: int, split: str, *, sample_id: int, temperature: float, max_tokens: int,
              seed: int, where: str) -> RolloutSample:
        from megatron_s2.posttrain.agentic.gateway_episode import run_harness_episode
        from megatron_s2.posttrain.rollout.agentic_backend import _ContextLimited, _episode_sample
        from megatron_s2.serve.gateway.traces import group_of

        env = self.envs[dataset]
        # module docstring: the conservative label (a server that comes back gets the backend's version)
        version = min([s.version for s in self.backend.servers if s.alive] + [self.backend.policy_version])
        session = f"ep{sample_id}" if split == "train" else f"eval{next(self._sessions)}"
        seeds = self.server.state.session_seeds
        seeds[session] = seed
        try:
            episode = run_harness_episode(env.task(index, split), _ContextLimited(env.harness()), env.runtime,
                                          server_url=self.server.url, session=session, trace_dir=self.trace_dir,
                                          settings=env.settings(temperature=temperature, max_tokens=max_tokens),
                                          annotator=env.config.process_annotator)
        finally:  # the episode holds its trace's samples: the gateway's store need not keep the tree
            seeds.pop(session, None)
            self.server.state.capture.store.forget(group_of(session))
        layer_ids = None
        if self.backend.record_routing:  # R3: layers numbered as served_backend's records; none returned: refused
            routed = next((b.experts for b in episode.samples if b.experts is not None), None)
            layer_ids = [] if routed is None else list(range(routed.shape[1]))
        return _episode_sample(episode, sample_id, version, layer_ids, where)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.trace_dir is not None:
            shutil.rmtree(self.trace_dir, ignore_errors=True)
            self.trace_dir = None
