"""Harness episodes on the agentic tasks as the orchestrator's rollout back end
(``environment.kind: agentic``; issue 25, walkthrough Ch. 6-7).

:class:`AgenticBackend` implements :class:`~megatron_s2.posttrain.orchestrator.RolloutBackend` the
way :class:`~megatron_s2.posttrain.rollout.vf_backend.VerifiersBackend` does for verifiers, with a
real third-party harness instead of verifiers' agent:

* the co-located rollout engine (report §5.2.1: same ranks, time-shared with training) is served
  by our app with the **agent gateway** capturing into a PrefixTree trace store (a temporary
  folder), uvicorn on a background thread on 127.0.0.1 — its driver thread steps the engine;
* each sample is one :func:`~megatron_s2.posttrain.agentic.gateway_episode.run_harness_episode` on
  a worker thread: a fresh sandbox with the task instance's workspace, the harness
  (``agent.harness``) against the session URL ``/sessions/ep<sample id>/v1`` for up to
  ``max_turns`` model calls of ``rollout.max_new_tokens`` tokens, grading after the agent stopped,
  the process annotator's weight per policy segment;
* the finished episode becomes a sample with exactly the engine's token ids, log-probs and routed
  experts (R3) from the trace (:func:`~megatron_s2.posttrain.rollout.agentic_trace.episode_samples`),
  context and tool observations loss-masked, its policy spans carrying the process weights — one
  row per trace branch that ends in policy tokens: the first is the sample, the others its
  ``branches`` (:func:`_episode_sample`).

**Credit.** A sample is an episode, so a prompt group is ``group_size`` episodes of one task
instance and the recipe's advantage (``leave_one_out``: worked example 22) is the per-episode
session advantage; the batch assembly spreads it over the episode's policy spans through
Eq. 30 (``w * A`` when A > 0, ``A`` otherwise) — what
:func:`~megatron_s2.posttrain.agentic.gateway_episode.group_token_advantages` computes.
A harness that re-renders its history (smolagents) leaves one branch per model call: the episode
stays one sample of its group (one reward, one advantage), its further branches are trained as
rows of their own, each policy segment in exactly one of them, with the episode's advantage and
their own process weights (:mod:`~megatron_s2.posttrain.episode_rows`).

**Weight updates.** As for verifiers: the trace keeps no per-token version, so :meth:`pause` lets
every running episode finish before the engine pauses; no partial episodes are checkpointed
(in-flight attempts restart from scratch after a restart). An episode that runs out of context
(the gateway's 400 "maximum context length") ends with stop reason ``context_limit`` — graded,
trained, its last segment weighted as a limit stop — rather than failing the step.

**Seeds.** The harnesses send none: each episode's gateway session is seeded from its sample's
seed (``ServerState.session_seeds``; call ``k`` samples with ``call_seed(seed, k)``), so an episode
is reproducible — and a disaggregated run (:mod:`megatron_s2.posttrain.disaggregated.served_agentic`)
plays the same episodes through the inference servers.

**Held-out evaluation** (:meth:`play_held_out`): the environment's held-out instances played
through the same gateway, harness and engine between steps, by the
:class:`~megatron_s2.posttrain.rollout.evaluation.VerifiersEvaluator` (it only needs
``play_held_out``).

Rollout replicas must be single ranks (an HTTP request reaches one rank's engine).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import shutil
import tempfile
from typing import Callable, Sequence

from megatron_s2.posttrain.agentic.gateway_episode import HarnessEpisode, run_harness_episode
from megatron_s2.posttrain.agentic.harnesses import ran_out_of_context
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.rollout.agentic_trace import episode_sample
from megatron_s2.posttrain.rollout.episode_backend import EpisodeBackend, EpisodeRun
from megatron_s2.serve.gateway.traces import group_of

__all__ = ["AgenticBackend"]


class _ContextLimited:
    """A harness whose episode ends with ``context_limit`` when the gateway refuses a call for the
    context length (the session outgrew the engine's ``max_model_len``): graded and trained like a
    turn-limit stop, instead of an exception that would fail the step."""

    def __init__(self, harness):
        self.harness, self.name = harness, harness.name

    def run(self, objective, tools, server_url, session, settings):
        try:
            return self.harness.run(objective, tools, server_url, session, settings)
        except Exception as exc:  # noqa: BLE001 - each client library has its own error class
            if ran_out_of_context(exc):  # the client's error, or a library's own error wrapping it
                return "context_limit"
            raise


class AgenticBackend(EpisodeBackend):
    WHAT = "agentic episodes"

    def __init__(self, *args, **kwargs):
        """As :class:`~.episode_backend.EpisodeBackend`; ``environments``: dataset name ->
        :class:`~megatron_s2.posttrain.envs.agentic_env.AgenticEnvironment`."""
        super().__init__(*args, **kwargs)
        self._eval_keys = itertools.count()
        self.server = self.pool = None
        self.trace_dir: str | None = None
        self.episodes: list[HarnessEpisode] = []
        """The training episodes finished since the last :meth:`take_episodes` (tests, logging)."""

    @property
    def started(self) -> bool:
        return self.server is not None

    # ---- set-up / tear-down ---------------------------------------------------------------------
    def _start(self) -> None:
        self.trace_dir = tempfile.mkdtemp(prefix="megatron-s2-agentic-traces-")
        self.server = self._serve(gateway_traces=self.trace_dir)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="megatron-s2-agentic")

    def close(self) -> None:
        """Stop the episodes (each closes its sandbox), the HTTP server; remove the traces."""
        if self.pool is not None:
            for run in self._running.values():
                run.future.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.trace_dir is not None:
            shutil.rmtree(self.trace_dir, ignore_errors=True)
            self.trace_dir = None

    def take_episodes(self) -> list[HarnessEpisode]:
        episodes, self.episodes = self.episodes, []
        return episodes

    # ---- episodes ---------------------------------------------------------------------------------------
    def _play(self, env, task, session: str, *, temperature: float, max_tokens: int, seed: int) -> HarnessEpisode:
        seeds = self.server.state.session_seeds  # the session's calls are seeded from the sample's seed
        seeds[session] = seed
        try:
            return run_harness_episode(task, _ContextLimited(env.harness()), env.runtime, server_url=self.server.url,
                                       session=session, trace_dir=self.trace_dir,
                                       settings=env.settings(temperature=temperature, max_tokens=max_tokens),
                                       annotator=env.config.process_annotator)
        finally:  # the episode holds its trace's samples: the gateway's store need not keep the tree
            seeds.pop(session, None)
            self.server.state.capture.store.forget(group_of(session))

    def _launch(self) -> None:
        pending, self._pending = self._pending, []
        version = self.engine.policy_version
        for req in pending:
            env = self.envs[req.dataset]
            future = self.pool.submit(self._play, env, env.task(req.index), f"ep{req.sample_id}",
                                      temperature=req.temperature, max_tokens=req.max_new_tokens, seed=req.seed)
            run = self._running[req.sample_id] = EpisodeRun(req, version, future)
            future.add_done_callback(lambda _, run=run: self._finished(run))

    def _sample(self, run: EpisodeRun) -> RolloutSample:
        req = run.request
        where = f"rollout: agentic episode of sample {req.sample_id} (prompt {req.prompt_uid})"
        episode = run.future.result()
        if run.end_version != run.version:
            raise RuntimeError(f"{where} ran across a weight update (version {run.version} -> {run.end_version}); "
                               "the backend must drain before an update")
        sample = _episode_sample(episode, req.sample_id, run.version, self.layer_ids, where)
        for row in sample.rows:
            row.group_id, row.prompt_uid, row.dataset, row.effort = req.group_id, req.prompt_uid, req.dataset, req.effort
        self.stats.generated_tokens += sample.num_generated
        self.episodes.append(episode)
        return sample

    # ---- held-out evaluation ------------------------------------------------------------------------------
    def play_held_out(self, items: Sequence[tuple[str, int]], *, temperature: float, max_tokens: int,
                      seed: Callable[[int], int]) -> list[RolloutSample]:
        """Episodes of held-out instances — ``(dataset, index)`` into each environment's ``eval``
        split — through the same gateway, harness and engine as training, at ``temperature``
        (0 = greedy); their samples in order, ``correct`` = graded 1. Called between steps, when no
        training episode runs; episode ``k``'s calls are seeded from ``seed(k)`` (the harnesses send
        no seed: the gateway's ``session_seeds``)."""
        if self.server is None:
            self._start()
        if any(not run.future.done() for run in self._running.values()):
            raise RuntimeError("held-out episodes requested while training episodes run; evaluate between steps")
        paused = self.engine.paused
        if paused:
            self.engine.resume()
        try:
            futures = [self.pool.submit(self._play, self.envs[name], self.envs[name].task(index, "eval"),
                                        f"eval{next(self._eval_keys)}", temperature=temperature, max_tokens=max_tokens,
                                        seed=seed(key))
                       for key, (name, index) in enumerate(items)]
            episodes = [f.result() for f in futures]
        finally:
            if paused:
                self.engine.pause()
        version = self.engine.policy_version
        return [_episode_sample(episode, key, version, None, f"eval: agentic episode of held-out instance {index} of {name}")
                for key, ((name, index), episode) in enumerate(zip(items, episodes))]


def _episode_sample(episode: HarnessEpisode, sample_id: int, version: int, layer_ids, where: str) -> RolloutSample:
    """The episode's sample (:func:`~megatron_s2.posttrain.rollout.agentic_trace.episode_sample`), or
    the reason it has none."""
    sample = episode_sample(episode, sample_id, version=version, layer_ids=layer_ids)
    if sample is None:
        detail = f": {episode.error}" if episode.error else ""
        raise RuntimeError(f"{where} made no trainable model call (stop reason {episode.stop_reason}{detail})")
    return sample
