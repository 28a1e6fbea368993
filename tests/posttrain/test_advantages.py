"""Advantages against the walkthrough's worked examples (Ch. 5, 7) and their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.posttrain.advantages import (
    ADVANTAGE_TRANSFORMS,
    AdvantagePipeline,
    GroupRollouts,
    adaptive_length_regularization,
    batch_thresholds,
    gepo_rebalance,
    group_entropy,
    group_mean_advantages,
    is_informative,
    labelled_segment_advantages,
    leave_one_out_advantages,
    length_weights,
    segment_advantages,
    std_normalize,
    token_advantages,
)
from megatron_s2.config.posttrain import AdvantageConfig, GepoConfig, LengthRegularizationConfig

WE14_REWARDS = [1, 1, 1, 0, 1, 0, 1, 1]
WE16_LENGTHS = [900, 1200, 1500, 2400, 3000, 5000]


# ---- Eq. 27 leave-one-out, worked examples 14 and 22 --------------------------------------------
def test_loo_group_of_eight_worked_example_14():
    a = leave_one_out_advantages(WE14_REWARDS)
    for r, v in zip(WE14_REWARDS, a.tolist()):
        assert v == pytest.approx(0.285714 if r else -0.857143, abs=5e-7)
    assert float(a.sum()) == pytest.approx(0.0, abs=1e-12)  # 6(+0.285714) + 2(-0.857143) = 0
    assert a[0] == pytest.approx(1 - 5 / 7) and a[3] == pytest.approx(0 - 6 / 7)


def test_loo_session_group_worked_example_22():
    a = leave_one_out_advantages([1, 0, 0, 1, 0, 0])
    assert a.tolist() == pytest.approx([0.8, -0.4, -0.4, 0.8, -0.4, -0.4])
    assert float(a.sum()) == pytest.approx(0.0, abs=1e-12)


def test_loo_is_scaled_mean_centring_and_against_hand_loop():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(7, generator=gen, dtype=torch.float64)
    g = r.numel()
    hand = torch.tensor([r[i] - sum(float(r[j]) for j in range(g) if j != i) / (g - 1) for i in range(g)],
                        dtype=torch.float64)
    torch.testing.assert_close(leave_one_out_advantages(r), hand)
    torch.testing.assert_close(leave_one_out_advantages(r), g / (g - 1) * group_mean_advantages(r))
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_advantages([1.0])
    with pytest.raises(ValueError, match="finite"):
        leave_one_out_advantages([1.0, math.nan])


def test_shuffled_control_keeps_the_sizes_and_drops_the_link_to_the_reward():
    """leave_one_out_shuffled (the control): the same multiset of advantages as Eq. 27, but the
    right responses (WE14: six 1s) no longer always get the positive ones."""
    from megatron_s2.posttrain.advantages.group import GROUP_ESTIMATORS

    control = GROUP_ESTIMATORS["leave_one_out_shuffled"]
    real = sorted(leave_one_out_advantages(WE14_REWARDS).tolist())
    torch.manual_seed(0)
    wrong_got_positive = 0
    for _ in range(20):
        a = control(WE14_REWARDS)
        assert sorted(a.tolist()) == pytest.approx(real)
        wrong_got_positive += sum(v > 0 for r, v in zip(WE14_REWARDS, a.tolist()) if r == 0)
    assert wrong_got_positive > 0  # by chance: 2 wrong of 8, 6 positive slots: ~1.5 a draw


def test_group_mean_and_std_normalisation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    a = group_mean_advantages(r)
    assert a.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert std_normalize(a, r, 0.0).tolist() == [1.0, -1.0, -1.0, 1.0]  # population std = 0.5


def test_dapo_dynamic_sampling_filters_identical_groups():
    assert not is_informative([1, 1, 1, 1])
    assert not is_informative([0.0] * 8)
    assert is_informative(WE14_REWARDS)
    assert not is_informative([1.0, 1.0 + 1e-9], atol=1e-6) and is_informative([1.0, 1.0 + 1e-9])
    pipe = AdvantagePipeline(AdvantageConfig())
    out = pipe.compute([GroupRollouts([1] * 4, [5] * 4), GroupRollouts([1, 0, 1, 0], [5] * 4)])
    assert not out[0].informative and out[0].advantages.abs().sum() == 0
    assert out[1].informative and out[1].keep.all()
    assert not pipe.informative(GroupRollouts([0] * 4, [3] * 4))


# ---- Eq. 25-26 GEPO, worked example 15 ---------------------------------------------------------------
def test_gepo_group_entropy_and_rebalance_worked_example_15():
    h_m = group_entropy([5 * -0.05] * 4)
    h_s = group_entropy([5 * -1.20] * 4)
    assert h_m == pytest.approx(0.25) and h_s == pytest.approx(6.00) and h_s / h_m == pytest.approx(24.0)
    a = leave_one_out_advantages(WE14_REWARDS)
    kwargs = dict(h_low=1.0, h_high=4.0, low_positive_scale=0.5, high_negative_scale=0.8)
    m = gepo_rebalance(a, h_m, **kwargs)
    s = gepo_rebalance(a, h_s, **kwargs)
    for r, vm, vs in zip(WE14_REWARDS, m.tolist(), s.tolist()):
        assert vm == pytest.approx(0.142857 if r else -0.857143, abs=5e-7)  # positives damped
        assert vs == pytest.approx(0.285714 if r else -0.685714, abs=5e-7)  # negatives damped
    torch.testing.assert_close(gepo_rebalance(a, 2.0, **kwargs), a)  # mid regime: unchanged


def test_gepo_batch_quantile_thresholds():
    lo, hi = batch_thresholds([0.0, 1.0, 2.0, 3.0, 4.0], 0.25, 0.75)
    assert (lo, hi) == (1.0, 3.0)


# ---- Eq. 14-17 adaptive length regularisation, worked examples 16 and 17 --------------------------
def test_length_regularisation_worked_example_16():
    a = leave_one_out_advantages(WE14_REWARDS)
    positives = [i for i, r in enumerate(WE14_REWARDS) if r]
    lengths = [0] * 8
    for i, length in zip(positives, WE16_LENGTHS):
        lengths[i] = length
    lengths[3], lengths[5] = 7000, 200  # negatives: lengths do not matter
    out, info = adaptive_length_regularization(a, lengths, tau=0.5, alpha=0.2, gamma=1.0)
    assert info.applied  # |P| = 6 >= tau * G = 4
    w = info.weights[positives]
    assert w.tolist() == pytest.approx([1.0, 0.94146, 0.88293, 0.70732, 0.59024, 0.2], abs=5e-6)
    assert float(w.sum()) == pytest.approx(4.32195, abs=5e-6)
    assert info.normaliser == pytest.approx(1.388263, abs=2e-6)
    assert out[positives].tolist() == pytest.approx([info.normaliser * wi * 2 / 7 for wi in w.tolist()])
    assert float(out[positives].sum()) == pytest.approx(6 * 2 / 7, abs=1e-12)  # 1.714286: mass preserved
    assert out[3] == a[3] and out[5] == a[5]  # negatives untouched


def test_length_regularisation_gate_and_degenerate_lengths():
    three_of_eight = leave_one_out_advantages([1, 1, 1, 0, 0, 0, 0, 0])
    out, info = adaptive_length_regularization(three_of_eight, list(range(8)), tau=0.5, alpha=0.2, gamma=1.0)
    assert not info.applied and torch.equal(out, three_of_eight)  # 3 < 4: nothing happens
    w = length_weights(torch.tensor([700.0, 700.0]), 0.2, 1.0)
    assert w.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("gamma,expected", [(2.0, 0.4), (0.5, 0.76569), (1.0, 0.6)])
def test_length_weight_shape_worked_example_17(gamma, expected):
    w = length_weights(torch.tensor([0.0, 50.0, 100.0]), 0.2, gamma)  # r = 0, 0.5, 1
    assert w[1].item() == pytest.approx(expected, abs=5e-6)
    assert w[0].item() == 1.0 and w[2].item() == pytest.approx(0.2)


# ---- Eq. 28 composition ----------------------------------------------------------------------------
def test_pipeline_composes_loo_gepo_then_length_eq_28():
    cfg = AdvantageConfig(transforms=("gepo", "length_regularization"),
                          gepo=GepoConfig(h_low=1.0, h_high=4.0, low_positive_scale=0.5, high_negative_scale=0.8),
                          length_regularization=LengthRegularizationConfig(tau=0.5, alpha=0.2, gamma=1.0))
    lengths = [900, 1200, 1500, 3000, 2400, 3000, 3000, 5000]
    group = GroupRollouts(WE14_REWARDS, lengths, logprob_sums=[-0.25] * 8)  # H = 0.25: low-entropy regime
    out = AdvantagePipeline(cfg).compute([group])[0]
    manual = gepo_rebalance(leave_one_out_advantages(WE14_REWARDS), 0.25, h_low=1.0, h_high=4.0,
                            low_positive_scale=0.5, high_negative_scale=0.8)
    manual, _ = adaptive_length_regularization(manual, lengths, tau=0.5, alpha=0.2, gamma=1.0)
    torch.testing.assert_close(out.advantages, manual)
    positives = torch.tensor(WE14_REWARDS).bool()
    assert float(out.advantages[positives].sum()) == pytest.approx(6 * 0.5 * 2 / 7)  # post-GEPO mass preserved
    assert out.diagnostics["gepo_low_entropy_units"] == 1 and out.diagnostics["length_reg_applied_units"] == 1
    assert set(ADVANTAGE_TRANSFORMS) == {"gepo", "length_regularization"}


def test_pipeline_gepo_needs_logprob_sums():
    pipe = AdvantagePipeline(AdvantageConfig(transforms=("gepo",)))
    with pytest.raises(ValueError, match="logprob"):
        pipe.compute([GroupRollouts([1, 0], [3, 4])])


# ---- Eq. 30 process-weighted session credit, worked examples 21-23 ----------------------------------
def test_session_credit_positive_only_eq_30():
    weights = [1.0, 0.0, -0.5, 1.0]  # good, malformed, repeated failed call, good
    assert segment_advantages(0.60, weights) == pytest.approx([0.60, 0.0, -0.30, 0.60])
    assert segment_advantages(-0.60, weights) == pytest.approx([-0.60] * 4)
    assert segment_advantages(0.10, weights) == pytest.approx([0.10, 0.0, -0.05, 0.10])  # expected success
    adv = token_advantages(0.8, [(2, 5), (8, 10)], [1.0, 0.5], num_tokens=12)
    assert adv.tolist() == [0, 0, 0.8, 0.8, 0.8, 0, 0, 0, 0.4, 0.4, 0, 0]  # tool/user tokens stay zero
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        segment_advantages(0.5, [1.5])
    # the walkthrough's assign over a transcript: observations (system, user, tools) stay zero
    assert labelled_segment_advantages(0.6, [False, True, False, True], [1.0, -0.5]) == pytest.approx([0, 0.6, 0, -0.3])
    with pytest.raises(ValueError, match="2 trainable segments but 1 process weights"):
        labelled_segment_advantages(0.6, [True, False, True], [1.0])


# ---- per-turn credit of multi-turn sessions (credit: turn) ------------------------------------
def _retry_session(sample_id: int, first_right: bool, second_right: bool | None):
    """A hand-made retry session: prompt (3 tokens), reply 1 (2 tokens), and, after a wrong first
    reply, the feedback (2 masked tokens) and reply 2 (2 tokens); reward 1 / 0.5 / 0 as vf_retry."""
    from megatron_s2.posttrain.orchestrator import RolloutSample

    mask = [False] * 3 + [True] * 2
    turns = [float(first_right)]
    if second_right is not None:
        mask += [False] * 2 + [True] * 2
        turns.append(float(second_right))
    reward = 1.0 if first_right else 0.5 if second_right else 0.0
    spans = [(3, 5)] + ([(7, 9)] if second_right is not None else [])
    n = len(mask)
    return RolloutSample(sample_id, list(range(1, n + 1)), mask, [-0.5 if m else 0.0 for m in mask],
                         [0 if m else -1 for m in mask], prompt_length=3, reward=reward, spans=spans,
                         process_weights=[1.0] * len(spans), turn_rewards=turns)


def _label_values(batch, row: int, span: tuple[int, int]) -> list[float]:
    start, end = span  # token positions -> label positions (labels = ids[1:])
    return batch.advantages[row, start - 1:end - 1].tolist()


def test_turn_credit_trains_the_first_reply_on_the_first_try_alone():
    """Four sessions of one task: right at once (R 1), wrong then right (0.5), wrong twice (0),
    wrong then right (0.5). Session credit gives each session one leave-one-out advantage (a saved
    wrong first reply: 0.5 - 1.5 / 3 = 0 here, > 0 in a group whose mean is below 0.5); turn credit
    gives every first reply Eq. 27 of the first-try rewards (1, 0, 0, 0) alone — each wrong first
    reply -1/3, whatever its second reply — and compares the second replies among the three
    sessions that reached them (1, 0, 1)."""
    from megatron_s2.posttrain.batch import collate

    samples = [_retry_session(0, True, None), _retry_session(1, False, True), _retry_session(2, False, False),
               _retry_session(3, False, True)]
    session = AdvantagePipeline(AdvantageConfig()).compute([GroupRollouts.from_samples(samples)])[0]
    assert session.turn_advantages is None
    assert session.advantages.tolist() == pytest.approx([1 - 1 / 3, 0.5 - 1.5 / 3, 0 - 2 / 3, 0.5 - 1.5 / 3])
    turn = AdvantagePipeline(AdvantageConfig(credit="turn")).compute([GroupRollouts.from_samples(samples)])[0]
    first = leave_one_out_advantages([1, 0, 0, 0]).tolist()
    second = leave_one_out_advantages([1, 0, 1]).tolist()
    assert [t[0] for t in turn.turn_advantages] == pytest.approx(first)
    assert [t[1] for t in turn.turn_advantages[1:]] == pytest.approx(second)
    batch = collate(samples, turn.turn_advantages, seq_length=10)
    for row, s in enumerate(samples):
        assert _label_values(batch, row, s.spans[0]) == pytest.approx([first[row]] * 2)  # first try only
    assert _label_values(batch, 1, samples[1].spans[1]) == pytest.approx([second[0]] * 2)
    assert _label_values(batch, 2, samples[2].spans[1]) == pytest.approx([second[1]] * 2)
    assert batch.advantages[1, 4:6].tolist() == [0.0, 0.0]  # the feedback turn: no credit
    # the flaw session credit has: in a group whose mean is below 0.5 a saved wrong first reply goes up
    weak = [_retry_session(0, False, True), _retry_session(1, False, False), _retry_session(2, False, False),
            _retry_session(3, False, False)]
    sess = AdvantagePipeline(AdvantageConfig()).compute([GroupRollouts.from_samples(weak)])[0]
    assert float(sess.advantages[0]) > 0  # session credit pushes the wrong first reply up
    per_turn = AdvantagePipeline(AdvantageConfig(credit="turn")).compute([GroupRollouts.from_samples(weak)])[0]
    assert [t[0] for t in per_turn.turn_advantages] == [0.0] * 4  # first tries all wrong: nothing to compare
    assert per_turn.turn_advantages[0][1] > 0 and per_turn.turn_advantages[1][1] < 0  # the retry's own credit
    b = collate(weak, per_turn.turn_advantages, seq_length=10)
    assert _label_values(b, 0, weak[0].spans[0]) == [0.0, 0.0]


def test_turn_credit_keeps_eq30_per_turn_and_falls_back_to_the_session_reward_for_one_turn():
    from megatron_s2.posttrain.batch import collate

    s = _retry_session(0, False, True)
    s.process_weights = [0.5, 0.5]
    b = collate([s], [[0.4, -0.2]], seq_length=10)
    assert _label_values(b, 0, s.spans[0]) == pytest.approx([0.2, 0.2])  # Eq. 30: w * A on a positive A
    assert _label_values(b, 0, s.spans[1]) == pytest.approx([-0.2, -0.2])  # a negative A in full
    with pytest.raises(ValueError, match="2 assistant turns"):
        collate([s], [[0.4]], seq_length=10)
    # responses without per-turn rewards: one turn rewarded by the session reward = session credit
    plain = GroupRollouts([1.0, 0.0, 0.0], [2, 2, 2])
    res = AdvantagePipeline(AdvantageConfig(credit="turn")).compute([plain])[0]
    assert [t[0] for t in res.turn_advantages] == pytest.approx(res.advantages.tolist())


def test_turn_credit_config_rejects_what_it_does_not_support():
    from megatron_s2.config.schema import ConfigError

    with pytest.raises(ConfigError, match="credit"):
        AdvantageConfig(credit="episode")
    with pytest.raises(ConfigError, match="credit"):
        AdvantageConfig(credit="turn", transforms=("gepo",))
