"""The rollout orchestrator of co-located asynchronous RL / OPD (report §5.2.1-5.2.2, walkthrough Ch. 4).

Responsibilities, each from the report:

* **Sample-level dispatch** (§5.2.1): the in-flight bound is filled at the start; afterwards,
  once the number of newly completed (or discarded) samples reaches the group size of the
  next prompt, that prompt is dispatched, regardless of which groups produced the
  completions. Equivalently: a prompt is dispatched whenever its whole group fits under the
  bound, so the bound holds throughout and concurrency stays steady.
* **Per-dataset concurrency limits** (§5.2.2): the next prompt's dataset is drawn by weight
  among the datasets whose group also fits under their own limit.
* **Warm-up discard of early-returned short samples** (§5.2.2): during the first
  ``warmup_samples`` completions, a sample shorter than ``min_tokens`` is dropped and its
  group gets a replacement attempt.
* **Staleness bound** (§5.2.2, walkthrough Ch. 4: "discarded if its oldest retained segment was
  generated more than three policy updates before the current learner"): in ``discard`` mode
  a sample whose oldest token lags by more than ``max_staleness`` versions is dropped —
  completed, waiting for training, or still in flight at a weight update — and replaced; in
  ``mask`` mode it is kept and the loss masks its stale tokens.
* **Group bookkeeping**: a group completes with G accepted samples; DAPO dynamic sampling
  (``group_filter``) drops uninformative groups, which are *replaced* by further prompts and
  never counted toward a batch. Every completed group's rewards are recorded *before* the filter
  judges it (:class:`RolloutOutcomes`, :meth:`Orchestrator.take_outcomes`): the unfiltered
  ``rollout_*`` metrics of :mod:`megatron_s2.posttrain.metrics`.
* **Crash-safe state** (:meth:`state_dict`): prompt cursors, dispatch counters (the random
  streams), the policy version, open groups with their accepted samples and the partial state
  of in-flight samples, ready groups, and a ledger. After a restart in-flight samples are
  restored from their prefix or resampled per ``resume_in_flight`` and the staleness rule:
  no prompt is trained twice or silently skipped.

The loop (co-located time sharing, §5.2.1)::

    while not orch.batch_ready(): engine runs; orch.pump()
    batch = orch.begin_training()       # pause at a token boundary, take the groups
    ... optimiser steps on batch: policy v -> v + 1 ...
    orch.finish_update(v + 1)           # load weights into the engine, apply the staleness rule
    checkpoint(model, optimiser, orch.state_dict())   # paused: in-flight state is exact
    orch.resume()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megatron_s2.posttrain.orchestrator.backend import PromptSource, RolloutBackend, SampleRequest
from megatron_s2.posttrain.orchestrator.dispatch import PromptCursor, choose_dataset, sample_seed
from megatron_s2.posttrain.orchestrator.sample import RolloutSample

__all__ = ["PromptGroup", "RolloutOutcomes", "Orchestrator", "STATE_VERSION"]

STATE_VERSION = 1


@dataclass
class PromptGroup:
    """One prompt and the samples it needs (G, one effort level per slot)."""

    group_id: int
    prompt_uid: str
    dataset: str
    index: int
    efforts: list[int | None]
    """Effort level of each of the G slots (None without effort conditioning)."""
    accepted: list[RolloutSample] = field(default_factory=list)
    """Completed samples kept for training."""
    in_flight: dict[int, int | None] = field(default_factory=dict)
    """sample_id -> effort of each outstanding generation attempt."""
    pending: list[int | None] = field(default_factory=list)
    """Efforts of replacement attempts not yet submitted (waiting for room)."""

    @property
    def size(self) -> int:
        return len(self.efforts)

    @property
    def complete(self) -> bool:
        return len(self.accepted) == self.size

    def state_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "prompt_uid": self.prompt_uid, "dataset": self.dataset,
                "index": self.index, "efforts": list(self.efforts),
                "accepted": [s.state_dict() for s in self.accepted],
                "in_flight": [[sid, e] for sid, e in self.in_flight.items()], "pending": list(self.pending)}

    @classmethod
    def from_state_dict(cls, s: Mapping[str, Any]) -> "PromptGroup":
        return cls(s["group_id"], s["prompt_uid"], s["dataset"], s["index"], list(s["efforts"]),
                   [RolloutSample.from_state_dict(x) for x in s["accepted"]],
                   {int(sid): e for sid, e in s["in_flight"]}, list(s["pending"]))


@dataclass
class RolloutOutcomes:
    """What the policy's completed episodes scored since the last training step, recorded as they
    arrive: before dynamic sampling judges their groups (the unfiltered ``rollout_*`` metrics).
    Attempts dropped by the warm-up or staleness discards are replaced, not scored here (ledger)."""

    rewards: list[float] = field(default_factory=list)
    """Reward of every accepted episode."""
    correct: list[bool | None] = field(default_factory=list)
    """Whether each episode's final answer verified (None where the environment gives no verdict)."""
    groups: int = 0
    """Groups completed."""
    filtered: int = 0
    """Of which the group filter (DAPO dynamic sampling) dropped as uninformative."""
    solved: int = 0
    """Of which every episode earned the same positive reward."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """The environment's per-episode metrics (:attr:`RolloutSample.metrics`), by name, of the episodes
    that report them."""

    def add_episode(self, sample: RolloutSample) -> None:
        self.rewards.append(float(sample.reward))
        self.correct.append(sample.correct)
        for name, value in sample.metrics.items():
            self.metrics.setdefault(name, []).append(float(value))

    def add_group(self, group: PromptGroup, kept: bool) -> None:
        rewards = {s.reward for s in group.accepted}
        self.groups += 1
        self.filtered += 0 if kept else 1
        self.solved += 1 if len(rewards) == 1 and min(rewards) > 0 else 0

    def state_dict(self) -> dict[str, Any]:
        return {"rewards": list(self.rewards), "correct": list(self.correct), "groups": self.groups,
                "filtered": self.filtered, "solved": self.solved,
                "metrics": {name: list(values) for name, values in self.metrics.items()}}


class Orchestrator:
    """Dispatch, staleness, warm-up discard and group bookkeeping over a :class:`RolloutBackend`."""

    def __init__(self, config, sources: Mapping[str, PromptSource], backend: RolloutBackend, *, seed: int,
                 effort_levels: Sequence[int] = (), samples_per_level: int = 0,
                 group_filter: Callable[[list[RolloutSample]], bool] | None = None,
                 scorer: Callable[[RolloutSample], float] | None = None):
        """``config``: a :class:`~megatron_s2.config.posttrain.RolloutConfig`; ``sources``: the
        prompt datasets by name (every ``config.datasets`` entry, or one entry when the list is
        empty); ``group_filter``: False drops a complete group (DAPO, e.g.
        ``AdvantagePipeline.informative``); ``scorer``: reward of a sample the backend did not score."""
        self.config, self.backend, self.seed = config, backend, seed
        self.group_filter, self.scorer = group_filter, scorer
        slots = list(config.datasets)
        if not slots:
            if len(sources) != 1:
                raise ValueError("rollout.datasets is empty, so exactly one prompt source is expected, "
                                 f"got {sorted(sources)}")
            self.names = list(sources)
            self.weights, self.limits = [1.0], {self.names[0]: 0}
        else:
            self.names = [d.name for d in slots]
            missing = [n for n in self.names if n not in sources]
            if missing:
                raise ValueError(f"no prompt source for rollout dataset(s) {missing}")
            self.weights = [d.weight for d in slots]
            self.limits = {d.name: d.max_in_flight for d in slots}
        self.sources = {n: sources[n] for n in self.names}
        self.cursors = {n: PromptCursor(n, len(self.sources[n]), seed) for n in self.names}
        if effort_levels:
            if samples_per_level < 1:
                raise ValueError("effort levels need samples_per_level >= 1")
            self.slot_efforts: list[int | None] = [b for b in effort_levels for _ in range(samples_per_level)]
        else:
            self.slot_efforts = []
        for n in self.names:
            size = self._group_size(n)
            if size > config.max_in_flight:
                raise ValueError(f"group size {size} of dataset '{n}' exceeds max_in_flight={config.max_in_flight}")
        self.version = backend.policy_version
        self.groups: dict[int, PromptGroup] = {}
        self.ready: list[int] = []
        self.owner: dict[int, int] = {}  # sample_id -> group_id
        self.next_group_id = self.next_sample_id = self.dispatched = 0
        self.completed_total = 0
        self.outcomes = RolloutOutcomes()  # every episode and group completed since the last take_outcomes()
        self.paused = False
        self.ledger = {"dispatched": 0, "trained": 0, "filtered": 0, "discarded_short": 0, "discarded_stale": 0,
                       "replacements": 0, "completed": 0}

    # ---- helpers ---------------------------------------------------------------------------------
    def _group_size(self, dataset: str) -> int:
        return len(self.slot_efforts) if self.slot_efforts else self.config.group_of(dataset)

    @property
    def in_flight(self) -> int:
        return sum(len(g.in_flight) for g in self.groups.values())

    def in_flight_of(self, dataset: str) -> int:
        return sum(len(g.in_flight) + len(g.pending) for g in self.groups.values() if g.dataset == dataset)

    def _stale(self, sample: RolloutSample) -> bool:
        bound = self.config.max_staleness
        return (self.config.staleness_action == "discard" and bound >= 0
                and sample.staleness(self.version) > bound)

    def _request(self, group: PromptGroup, effort: int | None, sample_id: int | None = None,
                 resume_from: RolloutSample | None = None) -> SampleRequest:
        if sample_id is None:
            sample_id = self.next_sample_id
            self.next_sample_id += 1
        self.owner[sample_id] = group.group_id
        group.in_flight[sample_id] = effort
        c = self.config
        return SampleRequest(sample_id=sample_id, group_id=group.group_id, prompt_uid=group.prompt_uid,
                             dataset=group.dataset, index=group.index,
                             prompt_tokens=tuple(self.sources[group.dataset].prompt_tokens(group.index, effort)),
                             seed=sample_seed(self.seed, sample_id), max_new_tokens=c.max_new_tokens,
                             temperature=c.temperature, top_p=c.top_p, effort=effort, resume_from=resume_from)

    def _replace(self, group: PromptGroup, effort: int | None) -> None:
        group.pending.append(effort)
        self.ledger["replacements"] += 1

    # ---- dispatch -------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        if self.paused:
            return
        free = self.config.max_in_flight - self.in_flight
        for group in self.groups.values():  # replacements first: they reuse freed slots
            while group.pending and free > 0:
                self.backend.submit([self._request(group, group.pending.pop(0))])
                free -= 1
        while True:
            eligible = [(n, w) for n, w in zip(self.names, self.weights)
                        if self._group_size(n) <= free
                        and (not self.limits[n] or self.in_flight_of(n) + self._group_size(n) <= self.limits[n])]
            if not eligible or not self._may_open_group():
                return
            name = choose_dataset([n for n, _ in eligible], [w for _, w in eligible], self.seed, self.dispatched)
            index, epoch = self.cursors[name].next()
            size = self._group_size(name)
            group = PromptGroup(self.next_group_id, f"{name}:{epoch}:{index}", name, index,
                                list(self.slot_efforts) if self.slot_efforts else [None] * size)
            self.next_group_id += 1
            self.dispatched += 1
            self.ledger["dispatched"] += 1
            self.groups[group.group_id] = group
            self.backend.submit([self._request(group, e) for e in group.efforts])
            free -= size

    def _may_open_group(self) -> bool:
        """Whether a new prompt group may be dispatched now (beyond the in-flight bounds): always
        here; the disaggregated orchestrator limits it to groups its next batches can still use."""
        return True

    # ---- completions ------------------------------------------------------------------------------------
    def pump(self) -> int:
        """Ingest completed samples, then dispatch what fits; returns the completions ingested."""
        done = self.backend.poll()
        for sample in done:
            self._ingest(sample)
        self._dispatch()
        return len(done)

    def _ingest(self, sample: RolloutSample) -> None:
        gid = self.owner.pop(sample.sample_id, None)
        if gid is None or gid not in self.groups or sample.sample_id not in self.groups[gid].in_flight:
            raise ValueError(f"backend returned sample {sample.sample_id}, which is not in flight")
        group = self.groups[gid]
        effort = group.in_flight.pop(sample.sample_id)
        self.completed_total += 1
        self.ledger["completed"] += 1
        for row in sample.rows:  # the sample and the further branches of its episode
            row.group_id, row.prompt_uid, row.dataset, row.effort = gid, group.prompt_uid, group.dataset, effort
        warm = self.config.discard_short
        if self.completed_total <= warm.warmup_samples and sample.num_generated < warm.min_tokens:
            self.ledger["discarded_short"] += 1
            self._replace(group, effort)
            return
        if self._stale(sample):
            self.ledger["discarded_stale"] += 1
            self._replace(group, effort)
            return
        if sample.reward is None:
            if self.scorer is None:
                raise ValueError(f"sample {sample.sample_id} carries no reward and the orchestrator has no scorer")
            sample.reward = float(self.scorer(sample))
        if not math.isfinite(sample.reward):
            raise ValueError(f"sample {sample.sample_id} of prompt {group.prompt_uid} has reward {sample.reward}; "
                             "the verifier must return a finite number")
        group.accepted.append(sample)
        self.outcomes.add_episode(sample)
        if group.complete:
            self._close(group)

    def _close(self, group: PromptGroup) -> None:
        kept = self.group_filter is None or bool(self.group_filter(list(group.accepted)))
        self.outcomes.add_group(group, kept)  # before filtering: the policy's own rewards
        if not kept:
            self.ledger["filtered"] += 1
            del self.groups[group.group_id]
            return
        self.ready.append(group.group_id)

    def take_outcomes(self) -> RolloutOutcomes:
        """What every episode and group completed (kept or filtered) since the previous call scored."""
        outcomes, self.outcomes = self.outcomes, RolloutOutcomes()
        return outcomes

    # ---- training handshake -------------------------------------------------------------------------------
    def batch_ready(self) -> bool:
        return len(self.ready) >= self.config.batch_groups

    def begin_training(self) -> list[PromptGroup]:
        """Pause the engine at a token boundary and take ``batch_groups`` ready groups (oldest first)."""
        if not self.batch_ready():
            raise RuntimeError(f"begin_training: {len(self.ready)} ready groups, {self.config.batch_groups} needed")
        self.backend.pause()
        self.paused = True
        take, self.ready = self.ready[:self.config.batch_groups], self.ready[self.config.batch_groups:]
        batch = [self.groups.pop(gid) for gid in take]
        self.ledger["trained"] += len(batch)
        return batch

    def finish_update(self, version: int) -> None:
        """Load the new weights into the (paused) engine and apply the staleness rule."""
        if not self.paused:
            raise RuntimeError("finish_update: the engine is not paused (call begin_training first)")
        if version < self.version:
            raise ValueError(f"finish_update: version {version} is older than the current {self.version}")
        self.backend.update_weights(version)
        self.version = version
        if self.config.staleness_action != "discard" or self.config.max_staleness < 0:
            return
        stale = [s for s in self.backend.snapshot() if self._stale(s)]
        if stale:
            self.backend.abort([s.sample_id for s in stale])
            for s in stale:
                group = self.groups[self.owner.pop(s.sample_id)]
                self.ledger["discarded_stale"] += 1
                self._replace(group, group.in_flight.pop(s.sample_id))
        self.drop_stale_accepted()

    def drop_stale_accepted(self) -> None:
        """Completed but untrained samples age too: the stale ones are replaced (discard mode)."""
        for group in self.groups.values():
            keep = [s for s in group.accepted if not self._stale(s)]
            if len(keep) == len(group.accepted):
                continue
            for s in group.accepted:
                if self._stale(s):
                    self.ledger["discarded_stale"] += 1
                    self._replace(group, s.effort)
            group.accepted = keep
            if group.group_id in self.ready:
                self.ready.remove(group.group_id)

    def advance_version(self, version: int) -> None:
        """A policy update made before any rollout (OPD's SFT warm-up steps): the engine gets the
        new weights and version; nothing may have been dispatched yet."""
        if self.dispatched or self.groups or self.in_flight:
            raise RuntimeError("advance_version: rollouts have started; use begin_training / finish_update")
        if version < self.version:
            raise ValueError(f"advance_version: version {version} is older than the current {self.version}")
        self.backend.update_weights(version)
        self.version = version

    def resume(self) -> None:
        self.backend.resume()
        self.paused = False
        self._dispatch()

    # ---- crash-safe state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state; the engine must be paused (or idle) so in-flight prefixes are exact."""
        if self.in_flight and not self.paused:
            raise RuntimeError("state_dict: samples are in flight and the engine is running; checkpoint between "
                               "finish_update and resume")
        partial = {s.sample_id: s for s in self.backend.snapshot()} if self.in_flight else {}
        groups = []
        for g in self.groups.values():
            state = g.state_dict()
            state["partial"] = [partial[sid].state_dict() for sid in g.in_flight if sid in partial]
            groups.append(state)
        return {"version": STATE_VERSION, "policy_version": self.version, "seed": self.seed,
                "cursors": {n: c.state_dict() for n, c in self.cursors.items()},
                "next_group_id": self.next_group_id, "next_sample_id": self.next_sample_id,
                "dispatched": self.dispatched, "completed_total": self.completed_total,
                "groups": groups, "ready": list(self.ready), "ledger": dict(self.ledger),
                "outcomes": self.outcomes.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore on a fresh orchestrator whose backend runs the checkpoint's weights; in-flight
        samples are resubmitted (from their prefix, or afresh) and the engine is left paused."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"orchestrator state version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["seed"] != self.seed:
            raise ValueError(f"orchestrator state was saved with seed {state['seed']}, this run uses {self.seed}")
        if self.groups or self.dispatched:
            raise RuntimeError("load_state_dict: this orchestrator has already dispatched prompts")
        if set(state["cursors"]) != set(self.cursors):
            raise ValueError(f"orchestrator state has datasets {sorted(state['cursors'])}, this run {sorted(self.cursors)}")
        if self.backend.policy_version != state["policy_version"]:
            raise ValueError(f"the engine runs policy version {self.backend.policy_version}, the checkpoint's "
                             f"orchestrator state {state['policy_version']}; load the checkpoint's weights first")
        for n, c in state["cursors"].items():
            self.cursors[n].load_state_dict(c)
        self.version = state["policy_version"]
        self.next_group_id, self.next_sample_id = state["next_group_id"], state["next_sample_id"]
        self.dispatched, self.completed_total = state["dispatched"], state["completed_total"]
        self.ledger = dict(state["ledger"])
        self.ready = list(state["ready"])
        self.outcomes = RolloutOutcomes(**state.get("outcomes", {}))  # absent in older checkpoints
        self.backend.pause()
        self.paused = True
        restore = self.config.resume_in_flight == "restore"
        requests = []  # one submission: the backend puts them back in the order its engine held them
        for gs in state["groups"]:
            group = PromptGroup.from_state_dict(gs)
            partial = {p["sample_id"]: RolloutSample.from_state_dict(p) for p in gs.get("partial", [])}
            in_flight, group.in_flight = group.in_flight, {}
            self.groups[group.group_id] = group
            for sid, effort in in_flight.items():
                prefix = partial.get(sid)
                if prefix is not None and prefix.num_generated and restore and not self._stale(prefix):
                    requests.append(self._request(group, effort, sid, resume_from=prefix))
                elif prefix is not None and prefix.num_generated and not restore:
                    self._replace(group, effort)
                elif prefix is not None and prefix.num_generated:
                    self.ledger["discarded_stale"] += 1
                    self._replace(group, effort)
                else:  # nothing generated yet: the same attempt starts again
                    requests.append(self._request(group, effort, sid))
        if requests:
            self.backend.submit(requests)
