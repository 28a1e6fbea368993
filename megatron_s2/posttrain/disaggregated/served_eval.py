"""Held-out evaluation of disaggregated RL through the inference servers (issue 25, seed 004).

The co-located run evaluates on a second engine over the training ranks' weights
(:class:`~megatron_s2.posttrain.rollout.evaluation.Evaluator`); a disaggregated trainer has no
engine, so its held-out episodes are played by the inference servers — the same
:meth:`Evaluator.play` episode loop (multi-turn included, the same per-episode seeds
:func:`~megatron_s2.posttrain.rollout.evaluation.episode_seed`, greedy unless
``eval.temperature`` > 0) over :class:`ServedEvalEngine`, whose requests are
``POST /inference/v1/generate`` calls routed and re-routed like the orchestrator's
(:class:`~.served_backend.ServedRolloutBackend`). Hence the same ``eval_*`` metrics in
``eval.jsonl`` and ``metrics.jsonl`` as a co-located run, and on the same weights the same values
(greedy decoding, or a seeded sampler: each call's seed travels with it, whichever server answers).

Which weights: the evaluation at step ``s`` runs in the trainer right after it has published
policy version ``s`` (:mod:`.trainer`); its first rank asks every server to load version ``s``
(``POST /update_weights``, a no-op where the orchestrator already did). No newer version can
exist until the trainer goes on, so no server moves past ``s`` during the evaluation; every
generated token carries the version that produced it, and a token of another version is an error
(``eval_policy_version`` records the one measured). The orchestrator's rollouts share the servers
meanwhile (seed 004: the servers only consume requests; who asks does not matter to them).

Where the servers are: the orchestrator writes their URLs to ``<run>/disaggregated/servers.json``
at start-up (:func:`~.exchange.write_servers`); the trainer reads them when it first evaluates.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Mapping, NamedTuple

from megatron_s2.inference import FinishReason, RequestOutput, SamplingParams
from megatron_s2.posttrain.envs.base import Environment
from megatron_s2.posttrain.rollout.evaluation import Evaluator
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects

__all__ = ["ServedEvalEngine", "ServedEvaluator"]


class _Queued(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    request_id: str
    on_output: Callable[[RequestOutput], None]


class ServedEvalEngine:
    """The inference servers behind the part of the
    :class:`~megatron_s2.inference.InferenceEngine` interface that :meth:`Evaluator.play` uses:
    ``add_request`` queues; ``step`` sends every queued request at once (the servers batch them;
    each call goes to the live server with the fewest open calls and is re-sent elsewhere when
    its server dies) and reports each as one finished output, in the order added, with the
    per-token policy versions the server returned."""

    def __init__(self, backend, max_concurrent: int):
        """``backend``: a :class:`~.served_backend.ServedRolloutBackend` (its routing and its
        weight loading; no environments needed)."""
        self.backend = backend
        self._queued: list[_Queued] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent,
                                                           thread_name_prefix="megatron-s2-eval")
        self.versions: set[int] = set()
        """Policy versions of every token generated since the last :meth:`take_versions`."""

    @property
    def policy_version(self) -> int:
        return self.backend.policy_version

    def add_request(self, prompt: list[int], params: SamplingParams, *, request_id: str,
                    on_output: Callable[[RequestOutput], None]) -> None:
        self._queued.append(_Queued(list(prompt), params, request_id, on_output))

    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[RequestOutput]:
        batch, self._queued = self._queued, []
        choices = list(self._pool.map(lambda q: self.backend.generate(q.prompt, _wire(q.params)), batch))
        outputs = []
        for queued, choice in zip(batch, choices):
            versions = [int(v) for v in choice["policy_versions"]]
            self.versions.update(versions)
            out = RequestOutput(queued.request_id, token_ids=list(choice["token_ids"]), versions=versions,
                                finished=True, finish_reason=FinishReason(choice["finish_reason"] or "abort"))
            queued.on_output(out)
            outputs.append(out)
        return outputs

    def map(self, fn, items) -> list:
        """``fn`` over ``items`` on the engine's threads (verifiers episodes), in order."""
        return list(self._pool.map(fn, items))

    def take_versions(self) -> set[int]:
        versions, self.versions = self.versions, set()
        return versions

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _wire(params: SamplingParams) -> dict:
    """The ``sampling_params`` of ``/inference/v1/generate`` for an evaluation call: the engine's
    own fields, token ids back untouched."""
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "seed": params.seed, "skip_special_tokens": False}


class ServedEvaluator(Evaluator):
    """:class:`Evaluator` whose engine is the inference servers (module docstring). The trainer's
    first rank (``topology.leader``; one replica spanning the world) plays every held-out episode —
    the servers do the work — so each episode's seed is its position in the whole held-out list, as
    in a single-rank co-located run, whatever the trainer's layout; the other ranks only join the
    gathers. No teacher metrics (disaggregated mode is RL only)."""

    def mine(self) -> list[tuple[str, int]]:
        return self.items() if self.topology.leader else []

    def play(self, engine, items, temperature: float):
        """Token-level episodes through :meth:`Evaluator.play`; verifiers environments' held-out
        tasks (all datasets are verifiers ones then, as co-located) as verifiers episodes against
        the servers, agentic environments' held-out instances as harness episodes through a gateway
        over the servers (:mod:`.served_agentic`), episode ``k`` seeded :func:`episode_seed` ``(k)``
        as the co-located :class:`~megatron_s2.posttrain.rollout.evaluation.VerifiersEvaluator` seeds them."""
        backend = self.engine.backend
        if backend.verifiers is None and backend.agentic is None:
            return super().play(engine, items, temperature)
        from megatron_s2.posttrain.rollout.evaluation import EvalItem, episode_seed

        def one(key: int, name: str, index: int):
            if backend.agentic is not None:  # held-out instances as harness episodes, seeded as co-located
                return backend.play_agentic(name, index, "eval", sample_id=key, temperature=temperature,
                                            max_tokens=self.max_new_tokens, seed=episode_seed(key),
                                            where=f"eval: agentic episode of held-out instance {index} of {name}")
            return backend.play_verifiers(name, index, "eval", sample_id=key, temperature=temperature, top_p=1.0,
                                          max_tokens=self.max_new_tokens, seed=episode_seed(key),
                                          where=f"eval: verifiers episode of held-out task {index} of {name}")

        samples = self.engine.map(lambda arg: one(arg[0], *arg[1]), list(enumerate(items)))
        out = []
        for (name, index), s in zip(items, samples):
            self.engine.versions.update(v for v in s.versions if v >= 0)
            start, end = s.spans[0]
            out.append(EvalItem(name, index, s.tokens[:start], s.tokens[start:end], s.correct, float(s.reward),
                                s.num_generated, s.finish_reason == "length", s.metrics))
        return out

    def __init__(self, engine: ServedEvalEngine, environments: Mapping[str, Environment], topology: ReplicaTopology,
                 config, max_new_tokens: int, max_model_len: int, *, rank: int):
        super().__init__(engine, environments, topology, config, max_new_tokens, max_model_len)
        self.rank = rank

    def run(self, step: int, teacher=None, scorer_groups=None) -> dict[str, float]:
        """Evaluate policy version ``step`` on the servers; collective over the trainer's ranks."""
        if teacher is not None:
            raise ValueError("disaggregated RL evaluates no teacher metrics")
        error = None
        if self.rank == 0:  # one rank loads the servers (the published checkpoint is committed by now)
            try:
                self.engine.backend.update_weights(step)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in gather_objects(error, self.topology) if e]
        if errors:
            raise RuntimeError(f"disaggregated RL: evaluation at step {step}: the servers did not load version "
                               f"{step}: {errors[0]}")
        self.engine.backend.set_version(step)
        self.engine.take_versions()
        out = super().run(step)
        seen = sorted({v for part in gather_objects(sorted(self.engine.take_versions()), self.topology) for v in part})
        if seen and seen != [step]:  # another client moved the servers: the figures would mix policies
            raise RuntimeError(f"disaggregated RL: the evaluation at step {step} got tokens of policy versions {seen}; "
                               "is another trainer or orchestrator using these servers?")
        return out  # eval_policy_version: the backend's, set to step above
