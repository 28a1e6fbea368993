"""A deterministic simulated rollout engine with a fake clock (the real engine comes with the
inference issue). It implements :class:`~megatron_s2.posttrain.orchestrator.RolloutBackend`:

* continuous batching: every :meth:`tick`, each running sample generates ``rate`` tokens;
* a sample's length and tokens are functions of its request seed and positions only, so a
  sample resumed from its prefix continues exactly as if never stopped;
* every generated token carries the engine's current policy version; every fed position gets
  a routing record (prefill routes the prompt, each decode step the previous token), with
  expert ids depending on the version — so a sample paused across an update carries both;
* token-level pause / resume / update_weights / snapshot / abort.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron_s2.posttrain.orchestrator import RolloutSample, SampleRequest
from megatron_s2.posttrain.routing import RoutingRecord

LAYERS, TOPK, EXPERTS, VOCAB = (1, 3), 2, 8, 50


def default_length(request: SampleRequest) -> int:
    return 2 + request.seed % 15


def default_reward(request: SampleRequest, tokens: list[int]) -> float:
    return float((request.seed // 7) % 2)


def token_at(seed: int, position: int) -> int:
    return (seed * 31 + position * 17) % VOCAB


def routing_for(positions: range, tokens: list[int], version: int) -> RoutingRecord:
    layers = {}
    for layer in LAYERS:
        rows = [[(tokens[p] * 7 + p + 3 * version + layer + j) % EXPERTS for j in range(TOPK)] for p in positions]
        layers[layer] = torch.tensor(rows, dtype=torch.int32).reshape(len(positions), TOPK)
    return RoutingRecord(layers, positions.start, torch.full((len(positions),), version, dtype=torch.int32))


@dataclass
class _Running:
    request: SampleRequest
    target: int
    tokens: list[int]
    policy_mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    routing: list[RoutingRecord] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return sum(self.policy_mask)

    @property
    def routed_end(self) -> int:
        return self.routing[-1].end if self.routing else 0

    def sample(self, finish_reason: str = "", reward: float | None = None) -> RolloutSample:
        r = self.request
        return RolloutSample(r.sample_id, list(self.tokens), list(self.policy_mask), list(self.logprobs),
                             list(self.versions), prompt_length=len(r.prompt_tokens), group_id=r.group_id,
                             prompt_uid=r.prompt_uid, dataset=r.dataset, effort=r.effort,
                             routing=RoutingRecord.concatenate(self.routing) if self.routing else None,
                             reward=reward, finish_reason=finish_reason)


class SimulatedEngine:
    def __init__(self, *, version: int = 0, rate: int = 1, length: Callable[[SampleRequest], int] = default_length,
                 reward: Callable[[SampleRequest, list[int]], float] | None = default_reward,
                 in_flight_bound: int | None = None):
        self._version, self.rate, self.length, self.reward = version, rate, length, reward
        self.paused = False
        self.running: dict[int, _Running] = {}
        self.done: list[RolloutSample] = []
        self.in_flight_bound = in_flight_bound
        self.peak_in_flight = 0
        self.clock = 0
        self.submitted: list[SampleRequest] = []

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[SampleRequest]) -> None:
        for r in requests:
            if r.sample_id in self.running:
                raise AssertionError(f"sample {r.sample_id} submitted twice")
            self.submitted.append(r)
            if r.resume_from is not None:
                p = r.resume_from
                assert list(p.tokens[:len(r.prompt_tokens)]) == list(r.prompt_tokens), "resumed prefix differs"
                run = _Running(r, self.length(r), list(p.tokens), list(p.policy_mask), list(p.logprobs),
                               list(p.versions), [p.routing] if p.routing is not None else [])
            else:
                n = len(r.prompt_tokens)
                run = _Running(r, self.length(r), list(r.prompt_tokens), [False] * n, [0.0] * n, [-1] * n)
            self.running[r.sample_id] = run
        self.peak_in_flight = max(self.peak_in_flight, len(self.running))
        if self.in_flight_bound is not None and len(self.running) > self.in_flight_bound:
            raise AssertionError(f"{len(self.running)} samples in flight, bound {self.in_flight_bound}")

    def tick(self) -> None:
        """One decode step of every running sample (nothing while paused)."""
        if self.paused:
            return
        self.clock += 1
        for sid in sorted(self.running):
            run = self.running[sid]
            for _ in range(self.rate):
                pos = len(run.tokens)
                if run.routed_end < pos:  # prefill, or feed the previous token
                    run.routing.append(routing_for(range(run.routed_end, pos), run.tokens, self._version))
                tok = token_at(run.request.seed, pos)
                run.tokens.append(tok)
                run.policy_mask.append(True)
                run.logprobs.append(-0.1 - (tok % 5) / 10)
                run.versions.append(self._version)
                if run.generated >= run.target:
                    reward = None if self.reward is None else self.reward(run.request, run.tokens)
                    self.done.append(run.sample("length", reward))
                    del self.running[sid]
                    break

    def poll(self) -> list[RolloutSample]:
        out, self.done = sorted(self.done, key=lambda s: s.sample_id), []
        return out

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, version: int) -> None:
        assert self.paused, "weights are loaded while generation is paused"
        self._version = version

    def snapshot(self) -> list[RolloutSample]:
        return [self.running[sid].sample() for sid in sorted(self.running)]

    def abort(self, sample_ids: Sequence[int]) -> None:
        for sid in sample_ids:
            del self.running[sid]


class PromptList:
    """A prompt dataset of ``n`` prompts, prompt ``i`` = [i % VOCAB, 1, 2] (+ effort level token)."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def prompt_tokens(self, index: int, effort: int | None) -> list[int]:
        base = [(index + self.offset) % VOCAB, 1, 2]
        return base if effort is None else [effort % VOCAB] + base
