"""verifiers episodes through the inference servers (disaggregated RL; issue 25, seed 004).

The co-located run plays a verifiers environment against its own in-process server
(:mod:`megatron_s2.posttrain.rollout.vf_backend`); the orchestrator of a disaggregated run plays
it against the inference servers instead — *exactly as verifiers reaches any model* (the Prime
Intellect talk: the orchestrator runs the environments, the servers only answer): each episode
is ``env.run_episode(task, ctx)`` on the process's verifiers event loop with
``vf.TrainClientConfig`` pointing at one server's ``/v1`` (harness -> verifiers' interception
server -> ``TrainClient`` -> ``renderers`` with the run's tokenizer -> ``POST
/inference/v1/generate``), and its trace becomes the sample token-in/token-out
(:func:`~megatron_s2.posttrain.rollout.vf_trace.trace_sample`), as co-located.

* **Routing**: an episode is played on one server, the live one with the fewest open calls; an
  episode that fails while its server is down, or outlives ``request_timeout_s`` (cancelled,
  :class:`EpisodeTimeout`; the server is presumed dead, as for a generation call), is played again
  on another with the same seed (counted ``rerouted``), so no sample is lost or produced twice; one
  that failed on a transport error (a dropped connection) while its server stayed healthy is
  played again with the same seed up to twice, as co-located (counted ``replayed``).
* **Versions**: a verifiers trace keeps no per-token version and the servers take new weights
  whenever the orchestrator has them, so an episode may straddle an update. Its tokens are
  labelled with the version its server had when the episode started — the oldest they can be
  (versions only grow) — so the staleness rule (``max_async_level``) is applied conservatively:
  a kept sample is never older than the bound; one may be dropped that was just within it.
  The behaviour log-probs are each token's own (the server's), so the loss is exact.
* **R3 routing** (``rollout.engine.routing_replay``): the servers run with
  ``--enable-return-routed-experts`` (:func:`megatron_s2.launcher.disaggregated.server_command`),
  so every ``/inference/v1/generate`` answer carries the routed experts of the positions it fed;
  verifiers' ``TrainClient`` puts them into the trace, which becomes the sample's routing record
  as co-located (:func:`~megatron_s2.posttrain.rollout.vf_trace.trace_sample`).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Mapping

__all__ = ["EpisodeTimeout", "ServedVerifiers"]


class EpisodeTimeout(TimeoutError):
    """An episode outlived ``request_timeout_s`` (cancelled): its server is presumed dead."""


class ServedVerifiers:
    """The verifiers side of :class:`~.served_backend.ServedRolloutBackend` (module docstring)."""

    def __init__(self, environments: Mapping[str, object], tokenizer):
        """``environments``: dataset name -> :class:`~megatron_s2.posttrain.envs.vf_env.VerifiersEnvironment`."""
        from renderers import CustomRendererConfig, DefaultRendererConfig

        from megatron_s2.posttrain.envs.vf_renderer import IMPORT_PATH as BRIDGE_RENDERER
        from megatron_s2.posttrain.rollout.episode_backend import bypass_proxies_for_loopback
        from megatron_s2.posttrain.rollout.vf_backend import episode_loop

        bypass_proxies_for_loopback()
        self.envs = dict(environments)
        self._tokenizer_dir = tempfile.mkdtemp(prefix="megatron-s2-vf-tokenizer-")
        tokenizer.save(self._tokenizer_dir)  # renderers loads the run's tokenizer (its chat template)
        bridge = all(e.config.renderer == "bridge" for e in self.envs.values())  # one renderer (RolloutConfig)
        self._renderer = CustomRendererConfig(import_path=BRIDGE_RENDERER) if bridge else DefaultRendererConfig()
        self._clients: dict[str, object] = {}
        self._loop = episode_loop()
        self._serving: list = []

        async def enter():
            for env in self.envs.values():
                for served in (env.env, env.eval_env):
                    if served is not None:
                        cm = served.serving()
                        await cm.__aenter__()
                        self._serving.append(cm)

        asyncio.run_coroutine_threadsafe(enter(), self._loop).result()

    def _client(self, url: str):
        import verifiers.v1 as vf

        if url not in self._clients:
            self._clients[url] = vf.TrainClientConfig(base_url=f"{url}/v1", api_key_var="MEGATRON_S2_UNUSED_KEY",
                                                      renderer=self._renderer,
                                                      renderer_model_name=self._tokenizer_dir)
        return self._clients[url]

    def play(self, dataset: str, index: int, url: str, *, split: str, temperature: float, top_p: float,
             max_tokens: int, seed: int, timeout_s: float):
        """One episode of task ``index`` of ``dataset`` (``split`` 'train' or 'eval') against the
        server at ``url``; blocks this (worker) thread; returns verifiers' episode result."""
        import verifiers.v1 as vf

        from megatron_s2.posttrain.rollout.episode_backend import SERVED_MODEL

        env, tasks = self.envs[dataset].env_of(split)
        sampling = vf.SamplingConfig(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed % (2 ** 63))
        ctx = vf.ModelContext(model=SERVED_MODEL, client=self._client(url), sampling=sampling)
        future = asyncio.run_coroutine_threadsafe(env.run_episode(tasks[index], ctx), self._loop)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:  # concurrent.futures' own since 3.11
            future.cancel()  # the episode's coroutine stops on the loop: its server is presumed dead
            raise EpisodeTimeout(f"the verifiers episode on {url} took longer than {timeout_s:g} s") from None

    def close(self) -> None:
        async def leave():
            for cm in reversed(self._serving):
                await cm.__aexit__(None, None, None)

        try:
            asyncio.run_coroutine_threadsafe(leave(), self._loop).result(timeout=30)
        finally:
            self._serving = []
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)
