"""Orchestrator logic on a deterministic simulated engine with a fake clock (report §5.2.1-5.2.2):
sample-level dispatch, the in-flight bound, per-dataset limits, warm-up discard, staleness
(discard and mask), DAPO replacement, per-token versions and crash-safe resume."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.config.posttrain import AdvantageConfig, DatasetSlotConfig, RolloutConfig, ShortSampleDiscardConfig
from megatron_s2.posttrain.losses import staleness_mask
from megatron_s2.posttrain.orchestrator import Orchestrator
from tests.posttrain.sim_engine import PromptList, SimulatedEngine

SEED = 5


def make(config: RolloutConfig, *, engine=None, sources=None, **kw):
    engine = engine or SimulatedEngine(in_flight_bound=config.max_in_flight)
    sources = sources or {"default": PromptList(40)}
    return Orchestrator(config, sources, engine, seed=SEED, **kw), engine


def train_steps(orch, engine, steps, *, log=None, after_update=None, max_ticks=5000):
    """The co-located loop: generate until a batch is ready, pause, 'train', update, resume."""
    batches, ticks = [], 0
    for _ in range(steps):
        orch.pump()
        while not orch.batch_ready():
            engine.tick()
            orch.pump()
            ticks += 1
            if log is not None:
                log.append((engine.clock, orch.in_flight))
            assert ticks < max_ticks, "no progress"
        batch = orch.begin_training()
        assert all(len(g.accepted) == g.size for g in batch)
        batches.append(batch)
        orch.finish_update(orch.version + 1)
        if after_update is not None:
            orch, engine = after_update(orch, engine, len(batches))
        orch.resume()
    return batches, orch, engine


def uids(batches):
    return [g.prompt_uid for b in batches for g in b]


# ---- dispatch and bounds ----------------------------------------------------------------------------
def test_sample_level_dispatch_keeps_the_in_flight_bound_and_steady_concurrency():
    cfg = RolloutConfig(group_size=4, max_in_flight=12, batch_groups=3, max_staleness=-1)
    orch, engine = make(cfg)
    orch.pump()
    assert orch.in_flight == 12 and orch.ledger["dispatched"] == 3  # filled at the start
    sample_level = 0
    for _ in range(60):
        before_ready, before_dispatched = len(orch.ready) + orch.ledger["trained"], orch.ledger["dispatched"]
        engine.tick()
        done = orch.pump()
        assert orch.in_flight <= 12 and engine.peak_in_flight <= 12
        assert orch.in_flight > 12 - 4  # refilled as soon as a group's worth of slots is free
        groups_closed = len(orch.ready) + orch.ledger["trained"] - before_ready
        if orch.ledger["dispatched"] > before_dispatched and groups_closed == 0 and done:
            sample_level += 1  # dispatched on completions from unfinished groups
        if orch.batch_ready():
            orch.begin_training()
            orch.finish_update(orch.version + 1)
            orch.resume()
    assert sample_level > 0


def test_per_dataset_concurrency_limit():
    cfg = RolloutConfig(group_size=4, max_in_flight=16, batch_groups=4, max_staleness=-1,
                        datasets=(DatasetSlotConfig("a", weight=100.0, max_in_flight=8), DatasetSlotConfig("b")))
    orch, engine = make(cfg, sources={"a": PromptList(30), "b": PromptList(30, offset=7)})
    seen_a = []
    for _ in range(80):
        engine.tick()
        orch.pump()
        seen_a.append(orch.in_flight_of("a"))
        assert orch.in_flight_of("a") <= 8 and orch.in_flight <= 16
        if orch.batch_ready():
            orch.begin_training()
            orch.finish_update(orch.version + 1)
            orch.resume()
    assert max(seen_a) == 8  # the weight alone would fill the bound with 'a'
    assert orch.ledger["dispatched"] > 8


def test_warmup_discards_early_short_samples_and_replaces_them():
    cfg = RolloutConfig(group_size=4, max_in_flight=8, batch_groups=2, max_staleness=-1,
                        discard_short=ShortSampleDiscardConfig(warmup_samples=20, min_tokens=6))
    orch, engine = make(cfg)
    batches, orch, engine = train_steps(orch, engine, 6)
    assert orch.ledger["discarded_short"] > 0 and orch.ledger["replacements"] >= orch.ledger["discarded_short"]
    short_accepted = [s for b in batches for g in b for s in g.accepted if s.num_generated < 6]
    assert short_accepted  # after the warm-up short samples are kept again
    assert all(len(g.accepted) == 4 for b in batches for g in b)
    # the first 20 completions contained no accepted short sample
    first = sorted((s for b in batches for g in b for s in g.accepted), key=lambda s: s.sample_id)
    early = [s for s in first if s.sample_id < 8]  # the first wave, completed within the warm-up
    assert early and all(s.num_generated >= 6 for s in early)


# ---- staleness and per-token versions -----------------------------------------------------------
def test_staleness_discard_bounds_every_trained_token_and_samples_span_versions():
    cfg = RolloutConfig(group_size=2, max_in_flight=16, batch_groups=2, max_staleness=1, staleness_action="discard")
    long = lambda r: 2 + (r.seed % 5) * 6  # noqa: E731  lengths 2..26: some samples live across updates
    orch, engine = make(cfg, engine=SimulatedEngine(length=long, in_flight_bound=16))
    spans, max_lag = 0, 0
    for _ in range(10):
        orch.pump()
        while not orch.batch_ready():
            engine.tick()
            orch.pump()
        batch = orch.begin_training()
        for s in (s for g in batch for s in g.accepted):
            max_lag = max(max_lag, s.staleness(orch.version))
            spans += len(set(s.policy_versions)) > 1
        orch.finish_update(orch.version + 1)
        orch.resume()
    assert max_lag <= 1 and spans > 0  # partial rollouts across an update, never beyond the bound
    assert orch.ledger["discarded_stale"] > 0


def test_staleness_mask_mode_keeps_samples_and_the_loss_masks_old_tokens():
    cfg = RolloutConfig(group_size=2, max_in_flight=16, batch_groups=2, max_staleness=1, staleness_action="mask")
    long = lambda r: 2 + (r.seed % 5) * 6  # noqa: E731
    orch, engine = make(cfg, engine=SimulatedEngine(length=long, in_flight_bound=16))
    batches, orch, engine = train_steps(orch, engine, 10)
    assert orch.ledger["discarded_stale"] == 0
    masked = 0
    for step, batch in enumerate(batches):
        version = step  # the learner's version while training batch `step`
        for s in (s for g in batch for s in g.accepted):
            v = torch.tensor(s.versions)
            keep = staleness_mask(torch.where(v >= 0, v, torch.full_like(v, version)), version, 1)
            masked += int((~keep).sum())
    assert masked > 0


def test_samples_carry_per_token_versions_and_concatenated_routing():
    cfg = RolloutConfig(group_size=2, max_in_flight=8, batch_groups=1, max_staleness=-1)
    orch, engine = make(cfg, engine=SimulatedEngine(in_flight_bound=8))
    batches, _, _ = train_steps(orch, engine, 4)
    found = False
    for s in (s for b in batches for g in b for s in g.accepted):
        assert s.routing is not None and s.routing.start == 0 and len(s.routing) == len(s.tokens) - 1
        if len(set(s.policy_versions)) == 2:
            found = True
            rv = s.routing.versions.tolist()
            first_new = s.versions.index(max(s.policy_versions))
            # the last token before the switch is routed (fed) by the new version
            assert rv[first_new - 2] == min(s.policy_versions) and rv[first_new - 1] == max(s.policy_versions)
    assert found


# ---- DAPO replacement ----------------------------------------------------------------------------------
def test_uninformative_groups_are_filtered_and_replaced():
    cfg = RolloutConfig(group_size=4, max_in_flight=16, batch_groups=3, max_staleness=-1)
    pipe = AdvantagePipeline(AdvantageConfig())
    keep = lambda samples: pipe.informative(GroupRollouts.from_samples(samples))  # noqa: E731
    orch, engine = make(cfg, group_filter=keep)
    batches, orch, _ = train_steps(orch, engine, 5)
    assert orch.ledger["filtered"] > 0
    for g in (g for b in batches for g in b):
        assert len({s.reward for s in g.accepted}) > 1 and len(g.accepted) == 4


def test_outcomes_record_every_completed_group_before_dynamic_sampling_and_survive_a_checkpoint():
    """The unfiltered rollout metrics' source: every accepted episode's reward (the simulated
    engine's reward is a known function of the request seed) and every closed group, the filtered
    ones included; the outcomes not yet taken travel in the orchestrator's state."""
    from megatron_s2.posttrain.orchestrator import sample_seed

    cfg = RolloutConfig(group_size=4, max_in_flight=16, batch_groups=3, max_staleness=-1)
    pipe = AdvantagePipeline(AdvantageConfig())
    keep = lambda samples: pipe.informative(GroupRollouts.from_samples(samples))  # noqa: E731
    orch, engine = make(cfg, group_filter=keep)
    accepted = []  # no discards here (no staleness bound, no warm-up): every completion is accepted
    ingest = orch._ingest
    orch._ingest = lambda s: (ingest(s), accepted.append(s))
    while orch.ledger["filtered"] < 2 or not orch.batch_ready():
        engine.tick()
        orch.pump()
    ready = len(orch.ready)
    orch.begin_training()
    orch.finish_update(1)
    state = json.loads(json.dumps(orch.state_dict()))  # what a checkpoint stores (outcomes not taken yet)
    restored, _ = make(cfg, engine=SimulatedEngine(version=1, in_flight_bound=16), group_filter=keep)
    restored.load_state_dict(state)
    for o in (orch.take_outcomes(), restored.take_outcomes()):
        assert o.rewards == [float((sample_seed(SEED, s.sample_id) // 7) % 2) for s in accepted]
        assert o.groups == ready + o.filtered and o.filtered == orch.ledger["filtered"] >= 2
    assert orch.take_outcomes().rewards == [], "taken outcomes must not be counted again"


# ---- crash-safe resume -------------------------------------------------------------------------------------
def _restart(config, seed_sources, kw, at_step, seen=None):
    def after_update(orch, engine, step):
        if step != at_step:
            return orch, engine
        state = json.loads(json.dumps(orch.state_dict()))  # what the checkpoint stores
        fresh = SimulatedEngine(version=state["policy_version"], in_flight_bound=config.max_in_flight,
                                length=engine.length)
        new = Orchestrator(config, seed_sources(), fresh, seed=SEED, **kw)
        new.load_state_dict(state)
        if seen is not None:
            seen["restored"] = sum(r.resume_from is not None for r in fresh.submitted)
            seen["replacements_at_load"] = new.ledger["replacements"] - state["ledger"]["replacements"]
            seen["in_flight_at_save"] = sum(len(g["in_flight"]) for g in state["groups"])
        return new, fresh
    return after_update


def _summary(batches):
    return [[(g.prompt_uid, [(s.sample_id, s.tokens, s.versions, s.logprobs, s.routing.state_dict())
                             for s in g.accepted]) for g in b] for b in batches]


@pytest.mark.parametrize("staleness_action", ["discard", "mask"])
def test_resume_restores_in_flight_samples_and_matches_an_uninterrupted_run(staleness_action):
    cfg = RolloutConfig(group_size=2, max_in_flight=10, batch_groups=2, max_staleness=1,
                        staleness_action=staleness_action, resume_in_flight="restore",
                        datasets=(DatasetSlotConfig("a", max_in_flight=6), DatasetSlotConfig("b", weight=2.0)))
    sources = lambda: {"a": PromptList(9), "b": PromptList(7, offset=20)}  # noqa: E731  small: epochs wrap
    long = lambda r: 2 + (r.seed % 5) * 4  # noqa: E731
    eng_a = SimulatedEngine(length=long, in_flight_bound=10)
    run_a, orch_a, _ = train_steps(Orchestrator(cfg, sources(), eng_a, seed=SEED), eng_a, 8)
    eng_b = SimulatedEngine(length=long, in_flight_bound=10)
    seen = {}
    run_b, orch_b, _ = train_steps(Orchestrator(cfg, sources(), eng_b, seed=SEED), eng_b, 8,
                                   after_update=_restart(cfg, sources, {}, at_step=3, seen=seen))
    assert seen["restored"] > 0  # partial samples continued from their saved prefix
    assert _summary(run_a) == _summary(run_b)
    assert orch_a.ledger == orch_b.ledger
    trained = uids(run_a)
    assert len(trained) == len(set(trained))  # no prompt trained twice (epochs make uids distinct)


def test_resume_with_discarded_in_flight_skips_no_prompt():
    cfg = RolloutConfig(group_size=3, max_in_flight=12, batch_groups=2, max_staleness=2, resume_in_flight="discard")
    sources = lambda: {"default": PromptList(11)}  # noqa: E731
    engine = SimulatedEngine(in_flight_bound=12)
    orch = Orchestrator(cfg, sources(), engine, seed=SEED)
    seen = {}
    batches, orch, _ = train_steps(orch, engine, 7, after_update=_restart(cfg, sources, {}, at_step=2, seen=seen))
    assert seen["restored"] == 0 and seen["replacements_at_load"] > 0  # in-flight prefixes resampled
    trained = uids(batches)
    assert len(trained) == len(set(trained))
    open_uids = [g.prompt_uid for g in orch.groups.values()]
    dispatched = trained + open_uids
    assert len(dispatched) == orch.ledger["dispatched"] - orch.ledger["filtered"]
    # the prompt cursor is contiguous: epoch 0 holds every index exactly once before epoch 1 starts
    by_epoch: dict[int, list[int]] = {}
    for uid in dispatched:
        _, epoch, index = uid.split(":")
        by_epoch.setdefault(int(epoch), []).append(int(index))
    assert sorted(by_epoch[0]) == list(range(11))
    assert orch.ledger["replacements"] > 0


def test_state_requires_a_paused_engine_and_matching_weights():
    cfg = RolloutConfig(group_size=2, max_in_flight=4, batch_groups=1, max_staleness=-1)
    orch, engine = make(cfg)
    orch.pump()
    with pytest.raises(RuntimeError, match="engine is running"):
        orch.state_dict()
    orch2, _ = make(cfg, engine=SimulatedEngine(version=3))
    state = {**json.loads(json.dumps(_paused_state(orch, engine)))}
    with pytest.raises(ValueError, match="load the checkpoint's weights first"):
        orch2.load_state_dict(state)


def _paused_state(orch, engine):
    engine.tick()
    orch.pump()
    engine.pause()
    orch.paused = True
    return orch.state_dict()


def test_effort_levels_expand_groups_into_subgroups():
    from megatron_s2.config.posttrain import EffortConfig

    effort = EffortConfig(levels=(50, 100), samples_per_level=2, k0=0.2, l_norm=10.0)
    cfg = RolloutConfig(group_size=4, max_in_flight=8, batch_groups=2, max_staleness=-1)
    orch, engine = make(cfg, effort_levels=effort.levels, samples_per_level=effort.samples_per_level)
    batches, _, engine = train_steps(orch, engine, 2)
    pipe = AdvantagePipeline(AdvantageConfig(estimator="group_mean", dynamic_sampling=False), effort)
    for g in (g for b in batches for g in b):
        assert sorted(s.effort for s in g.accepted) == [50, 50, 100, 100]
        for s in g.accepted:
            assert s.tokens[0] == s.effort % 50  # PromptList renders the effort into the prompt
        res = pipe.compute([GroupRollouts.from_samples(g.accepted)])[0]
        for b in (50, 100):  # each (prompt, effort) subgroup is mean-centred on its own (report Eq. 8)
            idx = [i for i, s in enumerate(g.accepted) if s.effort == b]
            assert float(res.advantages[idx].sum()) == pytest.approx(0.0, abs=1e-12)
    assert {r.effort for r in engine.submitted} == {50, 100}
