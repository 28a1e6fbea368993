"""The adaptive DSpark schedule (megatron_s2/inference/speculation_schedule.py, report 003 §2.4.3):
measured acceptance calibrating the confidence head, the engine's step-time curves, and the gate
that decides before drafting whether drafting pays, falling back to plain decode with
exponential back-off probing. Pure arithmetic: synthetic costs and acceptance."""

from __future__ import annotations

import math

import pytest

from megatron_s2.inference.speculation_schedule import AcceptanceEstimate, DraftGate, MinimumCurve, StepCosts


def test_acceptance_estimate_starts_at_the_heads_mean_and_moves_to_the_measurement():
    est = AcceptanceEstimate(3)
    assert est.rates() == [0.5, 0.5, 0.5]            # nothing drafted: an even guess
    head = [0.9, 0.8, 0.7]
    est.record(verified=3, accepted=3, head=head)   # every position reached and accepted
    # one pseudo-round at the head's mean (0.9) + one accepted round: (1 + 0.9) / 2
    assert est.rates()[0] == pytest.approx((1 + 0.9) / 2)
    for _ in range(400):                             # the drafter rejects position 0 from now on
        est.record(verified=3, accepted=0, head=head)
    rates = est.rates()
    assert rates[0] < 0.02
    # position 1 was reached once, accepted (long ago, decayed): between the head's prior and 1
    assert 0.8 < rates[1] < 0.9
    survival = est.survival()
    assert survival == pytest.approx([rates[0], rates[0] * rates[1], rates[0] * rates[1] * rates[2]])


def test_acceptance_counts_only_rounds_that_reached_the_position():
    """Conditional acceptance: position i counts rounds that verified it with 0..i-1 accepted
    (the first rejection is reached, the positions after it are not)."""
    est = AcceptanceEstimate(4)
    est.decay = 1.0  # no forgetting: exact counts
    for accepted in (0, 1, 1, 2, 4):
        est.record(verified=4, accepted=accepted, head=[0.5] * 4)
    assert est.reached == [5, 4, 2, 1]
    assert est.accepted == [4, 2, 1, 1]
    est.record(verified=1, accepted=1, head=[0.5] * 4)  # a length-1 round reaches only position 0
    assert est.reached == [6, 4, 2, 1] and est.accepted == [5, 2, 1, 1]


def test_calibration_scales_an_overconfident_head_to_the_measured_level():
    est = AcceptanceEstimate(2)
    for i in range(400):  # the head says 0.8, one round in ten is accepted
        est.record(verified=2, accepted=1 if i % 10 == 0 else 0, head=[0.8, 0.8])
    factor = est.calibration()[0]
    assert 0.8 * factor == pytest.approx(est.rates()[0], rel=1e-6)
    assert est.rates()[0] < 0.15
    assert AcceptanceEstimate(2).calibration() == [1.0, 1.0]  # nothing measured: the head as it is


def test_minimum_curve_keeps_minima_is_monotone_and_matches_the_profile():
    curve = MinimumCurve()
    assert not curve.known and curve(7) == 1.0
    for count, seconds in ((1, 2.0), (5, 3.0), (16, 10.0), (4, 2.5), (5, 9.0), (8, 2.0)):
        curve.observe(count, seconds)
    assert curve.best[5] == 3.0  # noise only adds time: the minimum stays
    points = curve.points()
    # monotone from above: the slower 4 and 5 are lowered to what 8 took, 16 stays
    assert points == [(1, 2.0), (4, 2.0), (5, 2.0), (8, 2.0), (16, 10.0)]
    profile = curve.profile()
    for count in (0, 1, 2, 4.5, 6, 12, 16, 40):
        assert curve(count) == pytest.approx(profile(count), rel=1e-12), count


def costs(forward: dict[int, float], plain_rest: float, speculative_rest: float, batch: int) -> StepCosts:
    c = StepCosts()
    for tokens, seconds in forward.items():
        c.forward.observe(tokens, seconds)
    c.plain_rest.observe(batch, plain_rest)
    c.speculative_rest.observe(batch, speculative_rest)
    return c


def test_speedup_is_the_best_uniform_length_over_plain_decode():
    # batch 1: a forward of 1..5 tokens costs the same (overhead-bound), drafting 0.25 of it
    c = costs({1: 1.0, 5: 1.0}, plain_rest=0.0, speculative_rest=0.25, batch=1)
    survival = [0.8, 0.6, 0.4, 0.2]
    assert DraftGate.speedup(1, survival, c) == pytest.approx((1 + sum(survival)) / 1.25)
    # batch 16, compute-bound: verification tokens cost as much as decoded ones
    c = costs({16: 1.0, 80: 5.0}, plain_rest=0.0, speculative_rest=0.25, batch=16)
    # F(16 (1 + k)) = 1 + k on the line through (16, 1) and (80, 5)
    best = max((1 + sum(survival[:k])) / (1 + k + 0.25) for k in range(1, 5))
    assert DraftGate.speedup(16, survival, c) == pytest.approx(best)
    assert DraftGate.speedup(16, survival, c) < 1.0  # speculation does not pay there


def drive(gate: DraftGate, steps: int, batch: int, estimate: AcceptanceEstimate, c: StepCosts) -> list[bool]:
    return [gate.decide(batch, estimate, c) for _ in range(steps)]


def test_gate_measures_plain_first_then_probes():
    gate, est = DraftGate(4), AcceptanceEstimate(4)
    c = StepCosts()
    assert gate.decide(1, est, c) is False and not gate.probing  # no baseline yet: plain
    c.observe_plain(1, 0.010, 0.011)
    assert gate.decide(1, est, c) is True and gate.probing        # no speculative step timed yet: probe
    assert gate.probes == 1


def test_a_bad_drafter_is_probed_with_exponential_back_off():
    gate, est = DraftGate(4), AcceptanceEstimate(4)
    for _ in range(50):
        est.record(verified=1, accepted=0, head=[0.9] * 4)
    c = costs({1: 1.0, 2: 1.05, 5: 1.2}, plain_rest=0.01, speculative_rest=0.3, batch=1)
    decisions = drive(gate, 1000, 1, est, c)
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:6] == [9, 17, 33, 65, 129, 257]  # back-off 8, 16, ... plain steps between probes
    assert set(gaps[6:]) <= {257}                   # capped at BACKOFF_MAX
    assert len(probes) <= math.ceil(1000 / 256) + 6
    assert gate.plain_steps == 1000 - len(probes)


def test_a_good_drafter_drafts_every_step_and_the_back_off_resets():
    gate, est = DraftGate(4), AcceptanceEstimate(4)
    c = costs({1: 1.0, 5: 1.1}, plain_rest=0.01, speculative_rest=0.3, batch=1)
    for _ in range(20):
        est.record(verified=4, accepted=4, head=[0.5] * 4)
    decisions = drive(gate, 50, 1, est, c)
    # plain decode re-timed after 4, 8, 16 ... drafting steps (refreshes); every other step drafts
    assert [i for i, d in enumerate(decisions) if not d] == [4, 13, 30] and gate.probes == 0
    assert gate.refreshes == 3
    for _ in range(400):  # the drafter goes bad (e.g. the policy moved): the gate stops drafting
        est.record(verified=4, accepted=0, head=[0.5] * 4)
    assert drive(gate, DraftGate.BACKOFF_MIN, 1, est, c) == [False] * DraftGate.BACKOFF_MIN
    assert gate.decide(1, est, c) is True and gate.probing
    for _ in range(800):  # ... and good again (the online draft update): drafting resumes at once
        est.record(verified=4, accepted=4, head=[0.5] * 4)
    assert drive(gate, 5, 1, est, c) == [True] * 5
    assert gate.backoff == DraftGate.BACKOFF_MIN and not gate.probing


def test_the_same_drafter_pays_at_batch_1_and_not_at_batch_64():
    """A compute-bound engine: a verification forward costs per token at large batches, a fixed
    overhead at small ones. The gate drafts at batch 1 and decodes plainly at batch 64."""
    est = AcceptanceEstimate(4)
    for accepted in [4, 3, 2, 1, 0] * 20:
        est.record(verified=4, accepted=accepted, head=[0.6] * 4)
    c = StepCosts()
    for tokens in (1, 2, 5, 64, 128, 320):
        c.forward.observe(tokens, 0.02 + 0.001 * tokens)  # 20 ms overhead + 1 ms per token
    for batch in (1, 64):
        c.plain_rest.observe(batch, 0.0005 * batch)
        c.speculative_rest.observe(batch, 0.005 + 0.001 * batch)
    assert DraftGate(4).decide(1, est, c) is True
    assert DraftGate(4).decide(64, est, c) is False


def test_a_cold_first_plain_step_does_not_keep_a_losing_drafter_drafting():
    """The first plain step is timed cold (3x its steady cost). Drafting then looks like it pays
    and the gate drafts; the plain steps it re-times while drafting (refreshes) find plain decode's
    real cost, and from then on it drafts only on its probes. Batch 16, a verification forward
    costing per token (compute-bound), acceptance ~0.5 at the first position: a loss."""
    gate, est = DraftGate(4), AcceptanceEstimate(4)
    for accepted in [0, 1, 0, 2, 0, 1] * 20:
        est.record(verified=4, accepted=accepted, head=[0.5] * 4)
    c, batch = StepCosts(), 16

    def forward(tokens):
        return 0.002 + 0.001 * tokens

    decisions, cold = [], 3.0
    for _ in range(600):
        drafts = gate.decide(batch, est, c)
        decisions.append(drafts)
        if drafts:
            c.observe_speculative(batch, batch * 5, forward(batch * 5), forward(batch * 5) + 0.004)
        else:
            c.observe_plain(batch, cold * forward(batch), cold * (forward(batch) + 0.001))
            cold = 1.0
    assert sum(decisions[:10]) >= 5  # the cold baseline made drafting look like it pays
    assert sum(decisions[-300:]) <= 3  # re-timed: only back-off probes draft
    assert gate.refreshes >= 1
