"""Effort-conditioned subgroups and length penalty (report §5.1.4, Eq. 8-10, Table 2, App. C)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.posttrain.advantages import (
    EFFORT_PROMPT,
    EFFORT_TIERS,
    AdvantagePipeline,
    GroupRollouts,
    length_penalty,
    penalty_coefficient,
    tier_effort,
    with_effort,
)
from megatron_s2.posttrain.advantages.effort import level_spacing
from megatron_s2.config.posttrain import AdvantageConfig, EffortConfig

LEVELS = (25, 50, 75, 100)


def test_effort_prompt_and_table_2_tiers():
    assert EFFORT_PROMPT.format(effort=75) == \
        "Reasoning Effort: 75 (range 1\u2013100; higher values request more thorough reasoning)"
    assert EFFORT_TIERS == {"max": 100, "high": 75, "low": 50}
    assert tier_effort("high") == 75
    assert with_effort("You are helpful.", tier_effort("max")).splitlines() == [
        "Reasoning Effort: 100 (range 1\u2013100; higher values request more thorough reasoning)", "You are helpful."]
    with pytest.raises(ValueError, match="tier"):
        tier_effort("medium")
    with pytest.raises(ValueError, match="1..100"):
        with_effort("", 0)


def test_penalty_coefficient_decays_by_e_per_tau_eq_10():
    k0, lam = 0.3, 2.0
    spacing = level_spacing(LEVELS)  # (100 - 25) / 3 = 25
    assert spacing == 25.0
    tau = lam * spacing
    assert penalty_coefficient(25, LEVELS, k0, lam) == k0
    assert penalty_coefficient(75, LEVELS, k0, lam) == pytest.approx(k0 / math.e)  # b_min + tau = 75
    ratio = penalty_coefficient(100, LEVELS, k0, lam) / penalty_coefficient(50, LEVELS, k0, lam)
    assert ratio == pytest.approx(math.exp(-50 / tau))


def test_length_penalty_cap_eq_9():
    kw = dict(k0=0.5, decay_lambda=1.0, l_norm=1000.0, c_max=0.4)
    assert length_penalty(400, 25, LEVELS, **kw) == pytest.approx(-0.2)  # 0.5 * 400 / 1000
    assert length_penalty(4000, 25, LEVELS, **kw) == pytest.approx(-0.4)  # capped at C_max
    k100 = 0.5 * math.exp(-3)
    assert length_penalty(4000, 100, LEVELS, **kw) == pytest.approx(-k100 * 4.0)  # higher effort, weaker penalty


def test_affine_preferred_length_appendix_c():
    """Eq. 13-17 of App. C: with p'(l) = a exp(-l/s), argmax_l [p(l) - k(b) l / L_norm] moves by s/tau per unit b."""
    a, s, l_norm, k0, lam = 0.01, 300.0, 1000.0, 0.5, 1.0
    tau = lam * level_spacing(LEVELS)

    def preferred(b):  # p(l) = a s (1 - exp(-l/s)); solve on a grid
        grid = torch.linspace(0, 5000, 500001, dtype=torch.float64)
        k = penalty_coefficient(b, LEVELS, k0, lam)
        obj = a * s * (1 - torch.exp(-grid / s)) - k * grid / l_norm
        return float(grid[obj.argmax()])

    assert preferred(75) - preferred(25) == pytest.approx(s / tau * 50, abs=0.05)


def test_effort_subgroups_are_mean_centred_separately_eq_8():
    effort = EffortConfig(levels=(50, 100), samples_per_level=2, k0=0.2, decay_lambda=1.0, l_norm=100.0, c_max=1.0)
    pipe = AdvantagePipeline(AdvantageConfig(estimator="group_mean", dynamic_sampling=True), effort)
    group = GroupRollouts(rewards=[1, 0, 1, 1], lengths=[50, 50, 100, 100], efforts=[50, 50, 100, 100])
    out = pipe.compute([group])[0]
    shaped = out.shaped_rewards
    assert shaped[0].item() == pytest.approx(1 - 0.2 * 0.5)  # b = b_min: k = k0
    assert shaped[2].item() == pytest.approx(1 - 0.2 * math.exp(-1) * 1.0)
    # subgroup b=50 centred on itself; subgroup b=100 has identical rewards -> filtered by DAPO
    assert out.advantages[:2].tolist() == pytest.approx([0.5, -0.5])
    assert out.keep.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="effort"):
        pipe.compute([GroupRollouts([1, 0], [3, 4])])
