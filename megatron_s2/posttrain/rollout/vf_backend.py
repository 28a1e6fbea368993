"""verifiers environments as the orchestrator's rollout backend (``environment.kind: verifiers``; issue 14).

:class:`VerifiersBackend` implements :class:`~megatron_s2.posttrain.orchestrator.RolloutBackend`
so that an ``rl`` / ``opd`` phase trains on a verifiers (0.4.0, ``verifiers.v1``) environment
reached *exactly as verifiers reaches any model* (the Prime Intellect talk's architecture):

* the co-located rollout engine (report §5.2.1: same ranks, time-shared with training) is served
  by our OpenAI-compatible app (:mod:`megatron_s2.serve`, uvicorn on a background thread,
  127.0.0.1, a free port) — the serve driver thread steps the engine;
* each sample is one ``env.run_episode(task, ctx)`` on an asyncio loop thread, with
  ``vf.TrainClientConfig`` pointing at that server: harness -> verifiers' interception server ->
  ``TrainClient`` -> ``renderers`` (the run's tokenizer, its chat template) ->
  ``POST /inference/v1/generate`` (token ids, log-probs, routed experts);
* a finished trace becomes a sample with exactly those token ids, the behaviour log-probs, the
  R3 routing record, the policy version and the rubric's reward (:mod:`.vf_trace`), environment
  and tool tokens loss-masked.

**Weight updates without partial rollout.** The trace keeps no per-token policy version, so a
trace must not straddle a weight update: :meth:`pause` (the orchestrator's preemption before the
optimiser step) stops launching episodes and lets every running one *finish* before it pauses
the engine; their samples are ingested after the update, one version behind, and the recipe's
staleness rule applies as usual. Consequently :meth:`snapshot` reports no partial samples: at
a checkpoint or a restart the in-flight attempts start again from scratch (never trained twice,
never skipped). Token-level pause/resume of verifiers traces is not supported yet.

**Held-out evaluation** (``eval.interval``, ``environment.eval_taskset``): between steps, when no
training episode runs, :meth:`VerifiersBackend.play_held_out` plays held-out tasks through the same
server, training client and engine (resumed for them if paused for the update), so the evaluation
sees the policy exactly as rollouts do (:class:`~megatron_s2.posttrain.rollout.evaluation.VerifiersEvaluator`).

Rollout replicas must be single ranks (an HTTP request reaches one rank's engine; a tensor- or
expert-parallel replica would need its other ranks to step in lockstep). Several data-parallel
replicas each serve their own engine and run the samples they own; completions are all-gathered
as in :class:`~megatron_s2.posttrain.rollout.engine_backend.EngineRolloutBackend`.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from typing import Callable, Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.rollout.episode_backend import MAX_REPLAYS, SERVED_MODEL, EpisodeBackend, EpisodeRun
from megatron_s2.posttrain.rollout.vf_trace import trace_sample

__all__ = ["VerifiersBackend", "episode_loop", "only_trace", "transport_error"]

TRANSPORT_MESSAGES = ("Connection error.", "Request timed out.")
"""What verifiers records (``ProviderError``, status 503 / 504) when the OpenAI SDK's call to our
server failed below HTTP — ``APIConnectionError`` (refused, reset, closed without or in the middle
of an answer: httpx's ConnectError / ReadError / RemoteProtocolError) and ``APITimeoutError``. An
HTTP answer, even an error status, is recorded with its status and body instead."""

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_GUARD = threading.Lock()


def episode_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for verifiers episodes, on a daemon thread. One per process,
    not per backend: ``renderers.client`` binds a module-level ``asyncio.Lock`` to the first loop
    that uses it, so a second loop (a second run in the same process) would fail every call."""
    global _LOOP
    with _LOOP_GUARD:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="megatron-s2-verifiers", daemon=True).start()
        return _LOOP


class VerifiersBackend(EpisodeBackend):
    WHAT = "verifiers environments"

    def __init__(self, *args, **kwargs):
        """As :class:`~.episode_backend.EpisodeBackend`; ``environments``: dataset name ->
        :class:`~megatron_s2.posttrain.envs.vf_env.VerifiersEnvironment`."""
        super().__init__(*args, **kwargs)
        self.server = self._loop = None
        self._tokenizer_dir: str | None = None
        self._serving: list = []

    @property
    def started(self) -> bool:
        return self._loop is not None

    # ---- set-up / tear-down ---------------------------------------------------------------------
    def _start(self) -> None:
        import verifiers.v1 as vf
        from renderers import CustomRendererConfig, DefaultRendererConfig

        from megatron_s2.posttrain.envs.vf_renderer import IMPORT_PATH as BRIDGE_RENDERER

        self._tokenizer_dir = tempfile.mkdtemp(prefix="megatron-s2-vf-tokenizer-")
        self.tokenizer.save(self._tokenizer_dir)  # renderers loads the run's tokenizer (its chat template)
        self.server = self._serve()
        bridge = all(e.config.renderer == "bridge" for e in self.envs.values())  # one renderer (RolloutConfig)
        renderer = CustomRendererConfig(import_path=BRIDGE_RENDERER) if bridge else DefaultRendererConfig()
        self.client = vf.TrainClientConfig(base_url=f"{self.server.url}/v1", api_key_var="MEGATRON_S2_UNUSED_KEY",
                                           renderer=renderer, renderer_model_name=self._tokenizer_dir)
        self._loop = episode_loop()

        async def enter():
            self._gate = asyncio.Semaphore(self.max_concurrent)
            for env in self.envs.values():
                for served in (env.env, env.eval_env):  # the held-out tasks' env, when declared
                    if served is None:
                        continue
                    cm = served.serving()
                    await cm.__aenter__()
                    self._serving.append(cm)

        asyncio.run_coroutine_threadsafe(enter(), self._loop).result()

    def close(self) -> None:
        """Stop the episodes, verifiers' serving resources and the HTTP server."""
        if self._loop is not None:
            for run in self._running.values():
                run.future.cancel()

            async def leave():
                for cm in reversed(self._serving):
                    await cm.__aexit__(None, None, None)
                # verifiers' runtimes tear down on background tasks: let them finish (else they are
                # destroyed pending at exit, with warnings)
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if rest:
                    await asyncio.wait(rest, timeout=10)

            try:
                asyncio.run_coroutine_threadsafe(leave(), self._loop).result(timeout=30)
            finally:
                self._loop, self._serving = None, []
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._tokenizer_dir is not None:
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)
            self._tokenizer_dir = None

    # ---- held-out evaluation ------------------------------------------------------------------------------
    def play_held_out(self, items: Sequence[tuple[str, int]], *, temperature: float, max_tokens: int,
                      seed: Callable[[int], int]) -> list[RolloutSample]:
        """Episodes of held-out tasks — ``(dataset, index)`` into each environment's ``eval_tasks`` —
        through the same server, client and engine as the training episodes, at ``temperature``
        (0 = greedy), episode ``k`` seeded ``seed(k)``; their samples in order (``correct`` from the
        rubric's ``correct`` reward, when it has one). Called between steps, when no training
        episode runs: the engine (paused for the update, or not yet started) serves only these."""
        import verifiers.v1 as vf

        if self._loop is None:
            self._start()
        if any(not run.future.done() for run in self._running.values()):
            raise RuntimeError("held-out episodes requested while training episodes run; evaluate between steps")
        paused = self.engine.paused
        if paused:
            self.engine.resume()
        try:
            futures = []
            for key, (name, index) in enumerate(items):
                env, tasks = self.envs[name].env_of("eval")
                sampling = vf.SamplingConfig(temperature=temperature, max_tokens=max_tokens, seed=seed(key) % (2 ** 63))
                ctx = vf.ModelContext(model=SERVED_MODEL, client=self.client, sampling=sampling)
                where = f"eval: verifiers episode of held-out task {index} of {name}"
                futures.append(asyncio.run_coroutine_threadsafe(self._episode(env, tasks[index], ctx, where),
                                                                self._loop))
            episodes = [f.result() for f in futures]
        finally:
            if paused:
                self.engine.pause()
        version = self.engine.policy_version
        return [trace_sample(only_trace(episode, f"eval: verifiers episode of held-out task {index} of {name}"), key,
                             version=version, layer_ids=None)
                for key, ((name, index), episode) in enumerate(zip(items, episodes))]

    # ---- episodes ---------------------------------------------------------------------------------------
    def _launch(self) -> None:
        import verifiers.v1 as vf

        pending, self._pending = self._pending, []
        version = self.engine.policy_version
        for req in pending:
            env = self.envs[req.dataset]
            sampling = vf.SamplingConfig(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_new_tokens,
                                         seed=req.seed % (2 ** 63))
            ctx = vf.ModelContext(model=SERVED_MODEL, client=self.client, sampling=sampling)
            where = f"rollout: verifiers episode of sample {req.sample_id} (prompt {req.prompt_uid})"
            future = asyncio.run_coroutine_threadsafe(self._episode(env.env, env.tasks[req.index], ctx, where),
                                                      self._loop)
            run = self._running[req.sample_id] = EpisodeRun(req, version, future)
            future.add_done_callback(lambda _, run=run: self._finished(run))

    async def _episode(self, vf_env, task, ctx, where: str):
        """One episode; played again with the same seed (``ctx``) when it failed on a transport
        error, up to :data:`~.episode_backend.MAX_REPLAYS` times (then its error stops the run as
        any failed episode's). The replay runs inside the same future, so pause() still waits for
        it: no trace straddles a weight update."""
        async with self._gate:
            for replay in range(1, MAX_REPLAYS + 2):
                episode = await vf_env.run_episode(task, ctx)
                error = transport_error(episode)
                if error is None or replay > MAX_REPLAYS:
                    return episode
                self.note_replay(where, error, replay)

    def _sample(self, run: EpisodeRun) -> RolloutSample:
        req = run.request
        where = f"rollout: verifiers episode of sample {req.sample_id} (prompt {req.prompt_uid})"
        trace = only_trace(run.future.result(), where)
        if run.end_version != run.version:
            raise RuntimeError(f"{where} ran across a weight update (version {run.version} -> {run.end_version}); "
                               "the backend must drain before an update")
        sample = trace_sample(trace, req.sample_id, version=run.version, layer_ids=self.layer_ids)
        sample.group_id, sample.prompt_uid, sample.dataset, sample.effort = (req.group_id, req.prompt_uid,
                                                                             req.dataset, req.effort)
        self.stats.generated_tokens += sample.num_generated
        return sample


def episode_error(episode):
    """The recorded error of a failed episode (verifiers' ``Error``: type, message, status), or None."""
    return episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)


def transport_error(episode) -> str | None:
    """``"ProviderError: Connection error."`` when ``episode`` failed because a call to the model
    server failed below HTTP (:data:`TRANSPORT_MESSAGES`): worth playing again; None otherwise (it
    succeeded, or failed on the rubric, the harness, the task's code or an HTTP error answer)."""
    if episode.ok:
        return None
    err = episode_error(episode)
    if err is None or err.type != "ProviderError" or (err.message or "").strip() not in TRANSPORT_MESSAGES:
        return None
    return f"{err.type}: {err.message.strip()}"


def only_trace(episode, where: str):
    """The one trace of a finished episode; a failed episode is an error (the run's context length:
    a ConfigError naming training.seq_length)."""
    if not episode.ok:
        err = episode_error(episode)
        if err and "context length" in (err.message or ""):  # the run's settings, not the environment
            raise ConfigError(f"training.seq_length: {where}: {str(err.message).strip().splitlines()[0].rstrip('.')}; "
                              "raise training.seq_length (the engine holds seq_length + 1 tokens) or shorten the "
                              "taskset's prompts")
        raise RuntimeError(f"{where} failed: {err.type}: {err.message}" if err else f"{where} failed")
    if len(episode.traces) != 1:
        raise RuntimeError(f"{where} has {len(episode.traces)} traces; one agent per episode is trained so far")
    return episode.traces[0]
