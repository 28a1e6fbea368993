"""The inference engine as the orchestrator's rollout backend (report §5.2.1-5.2.3, walkthrough Ch. 4, 6).

:class:`EngineRolloutBackend` implements :class:`~megatron_s2.posttrain.orchestrator.RolloutBackend`
over an :class:`~megatron_s2.inference.InferenceEngine` running on the training ranks:

* each sample is an **episode** of an environment: one engine request per model call, the
  environment's tokens between calls, the calls assembled token-in/token-out into one sample by
  :class:`~megatron_s2.posttrain.multiturn.SessionBuilder` (environment tokens loss-masked);
* **partial rollout with token-level interruption**: :meth:`pause` stops every request at a
  token boundary (the engine keeps its KV), :meth:`update_weights` loads the learner's weights
  (policy version + 1), :meth:`resume` continues every request from its cached state — tokens
  then carry the new version, and the routing recorded before and after the swap is
  concatenated (R3, §5.2.1);
* :meth:`snapshot` returns the partial state of every in-flight sample (exact while paused),
  which the orchestrator checkpoints; a request with ``resume_from`` continues such a prefix
  after a restart (the engine re-prefills it; the prefix keeps its recorded log-probs, versions
  and routing, and its completed model calls are replayed through a fresh episode);
* work is divided over rollout replicas (:mod:`.replicas`); every :meth:`poll` steps this
  replica's engine once and all-gathers the replicas' completions.

Routing records: the engine reports -1 for decoder layers it did not run (decoder bounded
replay, §3.2.2); those positions are dead ends for every later position once the training
forward truncates the decoder window the same way, so they are replayed with experts
``0..topk-1`` (any valid id gives the same result there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from megatron_s2.inference import EngineDriver, SamplingParams
from megatron_s2.inference.request import CompletedRequest
from megatron_s2.inference.sampling import call_seed
from megatron_s2.posttrain.envs.base import Environment, Episode
from megatron_s2.posttrain.multiturn import SessionBuilder
from megatron_s2.posttrain.orchestrator import RolloutSample, SampleRequest
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology, gather_objects
from megatron_s2.posttrain.routing import RoutingRecord

__all__ = ["EngineRolloutBackend", "RolloutStats", "routing_record"]


def routing_record(routed: torch.Tensor, layer_ids: Sequence[int], start: int, end: int,
                   versions: torch.Tensor) -> RoutingRecord:
    """Positions [start, end) of an engine's ``routed_experts`` table [positions, layers, topk]
    as a record (-1 entries of layers that did not run become 0..topk-1, module docstring)."""
    ids = routed[start:end].to(torch.int32).cpu()
    if ids.size(0) != end - start:
        raise ValueError(f"routing: the engine recorded {ids.size(0)} of positions {start}..{end}")
    pad = torch.arange(ids.size(-1), dtype=torch.int32).expand_as(ids)
    ids = torch.where(ids < 0, pad, ids)
    rec = RoutingRecord.from_array(ids, list(layer_ids), start=start)
    rec.versions = versions.to(torch.int32).reshape(-1).clone()
    return rec


@dataclass
class RolloutStats:
    """Counters since the last :meth:`EngineRolloutBackend.take_stats` (this replica)."""

    generated_tokens: int = 0
    engine_steps: int = 0
    engine_time_s: float = 0.0
    replayed: int = 0
    """Client-played episodes played again with the same seed after a transport error
    (:data:`~megatron_s2.posttrain.rollout.episode_backend.MAX_REPLAYS`); metric ``rollout_replayed``."""


@dataclass
class _Carried:
    """The part of an open model call generated before a restart (restored from a checkpoint)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: RoutingRecord | None
    """The sample's routing record up to where the prefix was fed."""


@dataclass
class _Session:
    request: SampleRequest
    episode: Episode
    builder: SessionBuilder
    prompt: list[int] = field(default_factory=list)
    """Context of the current model call (for a restored call: context + carried tokens)."""
    call: CompletedRequest | None = None
    fed_versions: dict[int, int] = field(default_factory=dict)
    """Position -> policy version of the step that fed it (this call)."""
    rid: str = ""
    calls: int = 0
    carried: _Carried | None = None
    replay_start: int = 0
    """Decoder bounded replay start of the first call (report §3.2.2), for train-aware replay."""
    order: int = 0
    """When its current call reached the engine (the engine serves calls in that order)."""

    @property
    def context(self) -> list[int]:
        """The call's context without the carried tokens."""
        return self.prompt[:len(self.prompt) - len(self.carried.ids)] if self.carried else self.prompt

    def generated(self) -> tuple[list[int], list[float], list[int]]:
        c = self.carried
        return ((c.ids if c else []) + list(self.call.token_ids), (c.logprobs if c else []) + list(self.call.logprobs),
                (c.versions if c else []) + list(self.call.versions))


class EngineRolloutBackend:
    def __init__(self, engine, environments: Mapping[str, Environment], *, topology: ReplicaTopology,
                 layer_ids: Sequence[int], record_routing: bool, max_model_len: int,
                 weight_loader: Callable[[int], None] | None = None):
        """``weight_loader(version)`` moves the learner's weights into the engine's model (a
        collective over the world when the weights are transferred) before the version bump."""
        self.engine, self.envs, self.topology = engine, dict(environments), topology
        self.driver = EngineDriver(engine)  # stepped on this thread, between the trainer's collectives
        self.layer_ids = list(layer_ids)
        self.record_routing, self.max_model_len = record_routing, max_model_len
        self.weight_loader = weight_loader
        self.sessions: dict[int, _Session] = {}
        self._by_rid: dict[str, int] = {}
        self._finished_calls: list[int] = []
        self._done: list[RolloutSample] = []
        self._seq = 0
        self._saved: dict[int, tuple[int, dict[str, torch.Tensor] | None]] = {}
        self.restored = {"exact": 0, "prefilled": 0}
        """In-flight samples restored after a restart: continued from their saved engine state,
        or re-prefilled from their tokens (a changed layout or engine: not bit for bit)."""
        self.any_busy = False
        self.stats = RolloutStats()
        # Decoder bounded replay (§3.2.2) exists only for a family with a sliding window (V4.1's
        # SWA); other families have no window to replay and never truncate.
        self.window = getattr(engine.model_config, "window_size", None)
        self.decoder_replay = bool(engine.config.decoder_bounded_replay) and self.window is not None

    # ---- protocol ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, requests: Sequence[SampleRequest]) -> None:
        saved, self._saved = self._saved, {}  # a restart's saved states serve its one resubmission
        if saved:  # the restored samples reach the engine in the order it held them
            requests = sorted(requests, key=lambda r: saved[r.sample_id][0] if r.sample_id in saved else len(saved))
        for req in requests:
            if not self.topology.owns(req.sample_id):
                continue
            env = self.envs[req.dataset]
            session = _Session(req, env.episode(req.index, "train", req.effort), SessionBuilder(req.sample_id))
            self.sessions[req.sample_id] = session
            _, state = saved.get(req.sample_id, (0, None))
            if req.resume_from is not None and req.resume_from.num_generated:
                self._restore(session, req.resume_from, state)
            else:
                self._start_call(session, session.episode.prompt_tokens(), cache_state=state)

    def poll(self) -> list[RolloutSample]:
        busy = self._step()
        done = [s.state_dict() for s in self._done] if self.topology.leader else []
        self._done = []
        gathered = gather_objects({"done": done, "busy": busy}, self.topology)
        out = [RolloutSample.from_state_dict(x) for part in gathered for x in part["done"]]
        self.any_busy = any(part["busy"] for part in gathered)
        return sorted(out, key=lambda s: s.sample_id)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self, version: int) -> None:
        if self.weight_loader is not None:
            self.weight_loader(version)
        self.engine.set_policy_version(version)

    def snapshot(self) -> list[RolloutSample]:
        mine = [self._partial(s).state_dict() for s in self.sessions.values()] if self.topology.leader else []
        gathered = gather_objects(mine, self.topology)
        return sorted((RolloutSample.from_state_dict(x) for part in gathered for x in part),
                      key=lambda s: s.sample_id)

    def abort(self, sample_ids: Sequence[int]) -> None:
        for sid in sample_ids:
            session = self.sessions.pop(sid, None)
            if session is not None and session.rid:
                self._by_rid.pop(session.rid, None)
                self.engine.abort(session.rid)

    # ---- extras ----------------------------------------------------------------------------------
    def take_stats(self) -> RolloutStats:
        stats, self.stats = self.stats, RolloutStats()
        return stats

    # ---- exact resume after a restart (report §5.2.3: rollout states persisted) ---------------------
    def cache_states(self) -> dict[str, torch.Tensor]:
        """This rank's engine state of the in-flight samples (engine paused): the order in which
        the engine holds their calls, and each admitted call's cache state. With it a restarted
        engine continues every sample bit for bit; from the tokens alone it would re-prefill the
        prefix under the current weights, whose KV the running engine computed under older ones."""
        if not self.sessions:
            return {}
        if not self.engine.paused:
            raise RuntimeError("cache_states: the engine is running; save between pause and resume")
        ordered = sorted(self.sessions.values(), key=lambda s: s.order)
        out = {"order": torch.tensor([s.request.sample_id for s in ordered], dtype=torch.int64)}
        for s in ordered:
            state = self.engine.export_cache_state(s.rid)
            if state is not None:
                sid = s.request.sample_id
                out[f"{sid}.length"] = torch.tensor(len(s.prompt) + len(s.call.token_ids))
                out.update({f"{sid}.{k}": v for k, v in state.items()})
        return out

    def load_cache_states(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """What :meth:`cache_states` saved, for the next :meth:`submit` (the orchestrator's
        resubmission of the restored samples)."""
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            sid, _, name = key.partition(".")
            if name:
                states.setdefault(int(sid), {})[name] = t
        order = tensors["order"].tolist() if "order" in tensors else []
        self._saved = {int(sid): (rank, states.get(int(sid))) for rank, sid in enumerate(order)}

    # ---- engine calls ------------------------------------------------------------------------------
    def _start_call(self, session: _Session, prompt: list[int], carried: _Carried | None = None,
                    cache_state: dict[str, torch.Tensor] | None = None) -> None:
        req = session.request
        budget = req.max_new_tokens - (len(carried.ids) if carried else 0)
        room = self.max_model_len - len(prompt)
        if budget < 1 or room < 1:
            raise ValueError(f"sample {req.sample_id}: no room to generate ({len(prompt)} context tokens, "
                             f"max_model_len {self.max_model_len}); raise training.seq_length")
        self._seq += 1
        session.order = self._seq
        rid = f"s{req.sample_id}-c{session.calls}-{self._seq}"
        # One stream per model call of the episode; the engine keys each draw by the token's position
        # too, so a call restored with its carried prefix continues exactly as it would have.
        seed = call_seed(req.seed, session.calls)
        # the loss needs the behaviour log-prob under the distribution each token was drawn from
        params = SamplingParams(max_tokens=min(budget, room), temperature=req.temperature, top_p=req.top_p,
                                seed=seed, record_routing=self.record_routing, logprobs_mode="processed_logprobs")
        session.prompt, session.rid, session.carried = list(prompt), rid, carried
        session.call, session.fed_versions = CompletedRequest(rid, list(prompt)), {}
        if session.calls == 0 and carried is None and self.decoder_replay:
            session.replay_start = max(0, len(prompt) - self.window)  # the engine's rule (tiers.py)
        self._by_rid[rid] = req.sample_id
        if carried is not None or cache_state is not None:  # a call restored after a restart
            cache_state = self._usable(cache_state, prompt)
        self.engine.add_request(list(prompt), params, request_id=rid, on_output=self._on_output,
                                cache_state=cache_state)

    def _usable(self, state: dict[str, torch.Tensor] | None, prompt: list[int]) -> dict[str, torch.Tensor] | None:
        """``state`` if the engine can continue this restored call from it; else None (counted)."""
        if state is not None and int(state["length"]) == len(prompt):
            state = {k: v for k, v in state.items() if k != "length"}
            try:
                self.engine.check_cache_state(state, len(prompt))
                self.restored["exact"] += 1
                return state
            except ValueError:
                pass
        self.restored["prefilled"] += 1
        return None

    def _on_output(self, out) -> None:
        sid = self._by_rid.get(out.request_id)
        session = self.sessions.get(sid) if sid is not None else None
        if session is None or session.rid != out.request_id:
            return  # aborted
        session.call.add(out)
        version = self.engine.policy_version  # weights change only between steps
        for p in out.fed_positions:
            session.fed_versions[p] = version
        self.stats.generated_tokens += len(out.token_ids)
        if out.finished:
            self._by_rid.pop(out.request_id, None)
            self._finished_calls.append(sid)

    def _step(self) -> bool:
        """One driver iteration of this replica's engine (when it has work and runs); returns
        whether it has work."""
        if self.engine.paused or not self.engine.has_work():
            return bool(self.sessions)
        t0 = time.perf_counter()
        self.driver.step()
        self.stats.engine_steps += 1
        self.stats.engine_time_s += time.perf_counter() - t0
        finished, self._finished_calls = self._finished_calls, []
        for sid in finished:
            session = self.sessions.get(sid)
            if session is not None:
                self._after_call(session)
        return bool(self.sessions)

    def _call_routing(self, session: _Session, context: list[int], ids: list[int]) -> RoutingRecord | None:
        """The routing of the positions this call fed (context + generated[:-1]), joined to the
        carried prefix's record (§5.2.1 concatenated replay)."""
        if not self.record_routing:
            return None
        end = len(context) + len(ids) - 1
        carried = session.carried
        begin = carried.routing.end if carried is not None and carried.routing is not None else 0
        versions = torch.tensor([session.fed_versions[p] for p in range(begin, end)], dtype=torch.int32)
        rec = routing_record(session.call.routed_experts, self.layer_ids, begin, end, versions)
        if begin:
            rec = RoutingRecord.concatenate([carried.routing, rec])
        return rec

    def _after_call(self, session: _Session) -> None:
        call, req = session.call, session.request
        reason = call.finish_reason.value if call.finish_reason is not None else "abort"
        if reason == "abort":
            raise RuntimeError(f"sample {req.sample_id}: the engine aborted call {session.rid} unexpectedly")
        context = session.context
        ids, logprobs, versions = session.generated()
        routing = self._call_routing(session, context, ids)
        session.builder.add_model_call(context, ids, logprobs, versions, routing)
        session.calls += 1
        session.carried = None
        step = session.episode.step(ids, reason)
        if not step.done and len(session.builder.tokens) + len(step.delta) + 1 >= self.max_model_len:
            step.done, step.reward, step.correct = True, 0.0, False  # no room for another turn
        if not step.done:
            self._start_call(session, session.builder.tokens + step.delta)
            return
        (sample,) = session.builder.build(reward=step.reward, finish_reason=reason)
        sample.prompt_length = len(session.episode.prompt_tokens())
        sample.dataset, sample.group_id, sample.prompt_uid = req.dataset, req.group_id, req.prompt_uid
        sample.effort, sample.replay_start, sample.correct = req.effort, session.replay_start, step.correct
        del self.sessions[req.sample_id]
        self._done.append(sample)

    # ---- crash-safe partial state ------------------------------------------------------------------
    def _partial(self, session: _Session) -> RolloutSample:
        """The sample so far: its completed calls, the environment tokens after them, then the open
        call's generated tokens as the last span (possibly empty)."""
        b = session.builder
        context = session.context
        gen, lps, vers = session.generated()
        delta = context[len(b.tokens):]
        tokens = b.tokens + delta + gen
        mask = b.policy_mask + [False] * len(delta) + [True] * len(gen)
        logprobs = b.logprobs + [0.0] * len(delta) + [float(x) for x in lps]
        versions = b.versions + [-1] * len(delta) + [int(v) for v in vers]
        routing = None
        if self.record_routing:  # completed calls (or the restored prefix), then this call's new positions
            carried = session.carried
            base = carried.routing if carried is not None and carried.routing is not None else \
                (RoutingRecord.concatenate(b.routing) if b.routing else None)
            base_end = base.end if base is not None else 0
            fed = 0
            while fed in session.fed_versions:
                fed += 1
            parts = [base] if base is not None else []
            if fed > base_end:
                v = torch.tensor([session.fed_versions[p] for p in range(base_end, fed)], dtype=torch.int32)
                parts.append(routing_record(session.call.routed_experts, self.layer_ids, base_end, fed, v))
            routing = RoutingRecord.concatenate(parts) if parts else None
        spans = list(b.spans) + [(len(tokens) - len(gen), len(tokens))]
        req = session.request
        return RolloutSample(req.sample_id, tokens, mask, logprobs, versions,
                             prompt_length=b.prompt_length or len(context), group_id=req.group_id,
                             prompt_uid=req.prompt_uid, dataset=req.dataset, effort=req.effort, routing=routing,
                             spans=spans, process_weights=[1.0] * len(spans), replay_start=session.replay_start)

    def _restore(self, session: _Session, prefix: RolloutSample, cache_state: dict[str, torch.Tensor] | None) -> None:
        """Continue a checkpointed partial sample: replay its completed calls through the episode,
        then continue its open call from the prefix — from its saved engine state (exact), or
        re-prefilled when there is none."""
        spans = list(prefix.spans)
        if not spans:
            raise ValueError(f"sample {prefix.sample_id}: a partial sample without spans cannot be resumed")
        b, episode = session.builder, session.episode
        if prefix.tokens[:spans[0][0]] != episode.prompt_tokens():
            raise ValueError(f"sample {prefix.sample_id}: its saved prompt differs from the environment's prompt "
                             f"{session.request.prompt_uid}; resume with the same environment settings")
        for i, (start, end) in enumerate(spans[:-1]):
            routing = prefix.routing.slice(0, end - 1) if prefix.routing is not None else None
            b.add_model_call(prefix.tokens[:start], prefix.tokens[start:end], prefix.logprobs[start:end],
                             prefix.versions[start:end], routing)
            session.calls += 1
            step = episode.step(prefix.tokens[start:end], "stop")
            if step.done or step.delta != prefix.tokens[end:spans[i + 1][0]]:
                raise ValueError(f"sample {prefix.sample_id}: the environment no longer answers its saved turn "
                                 f"{session.calls} the same way; resume with the same environment settings")
        start, end = spans[-1]
        carried = _Carried(prefix.tokens[start:end], prefix.logprobs[start:end], prefix.versions[start:end],
                           prefix.routing)
        session.replay_start = prefix.replay_start
        self._start_call(session, prefix.tokens[:end], carried, cache_state)
