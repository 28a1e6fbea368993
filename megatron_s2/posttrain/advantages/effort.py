"""Controllable reasoning effort in RL (DeepSeek-V4.1-Flash report §5.1.4, Eq. 8-10, Table 2, App. C).

A scalar effort level b in 1..100 conditions the policy through an instruction prepended to
the system prompt (:data:`EFFORT_PROMPT`). For each training prompt x, M_b responses are
sampled at every training level b (**Eq. 8**); responses sharing (x, b) form a *subgroup*
within which rewards are mean-centred, so responses at different efforts are never compared.
Effort-dependent behaviour comes from a length deduction added to each reward (**Eq. 9**)::

    r_len(b, j) = -min(C_max, k(b) * l_{b,j} / L_norm)

with l the number of reasoning tokens, and a penalty coefficient that decays exponentially
with effort (**Eq. 10**)::

    k(b) = k0 * exp(-(b - b_min) / tau),   tau = lambda * delta_b

(b_min the lowest training level, delta_b the average spacing between training levels):
raising b by tau multiplies k by 1/e. Appendix C derives from Eq. 10 an affine trend of the
preferred length in b with slope s_x / tau (Eq. 16-17 there).

Deployment tiers (**Table 2**): max = 100, high = 75, low = 50.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = [
    "EFFORT_PROMPT",
    "EFFORT_TIERS",
    "effort_instruction",
    "with_effort",
    "tier_effort",
    "level_spacing",
    "penalty_coefficient",
    "length_penalty",
]

EFFORT_PROMPT = "Reasoning Effort: {effort} (range 1\u2013100; higher values request more thorough reasoning)"
"""The instruction prepended to the system prompt (report §5.1.4, verbatim)."""

EFFORT_TIERS: dict[str, int] = {"max": 100, "high": 75, "low": 50}
"""Report Table 2: public API reasoning-effort tier -> scalar effort value b."""


def _check_level(b: int) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 100:
        raise ValueError(f"effort level must be an integer in 1..100, got {b!r}")


def effort_instruction(b: int) -> str:
    _check_level(b)
    return EFFORT_PROMPT.format(effort=b)


def with_effort(system_prompt: str, b: int) -> str:
    """The system prompt with the effort instruction prepended (one line, then the prompt)."""
    line = effort_instruction(b)
    return f"{line}\n{system_prompt}" if system_prompt else line


def tier_effort(tier: str) -> int:
    try:
        return EFFORT_TIERS[tier]
    except KeyError:
        raise ValueError(f"unknown reasoning-effort tier '{tier}'; valid tiers: {', '.join(EFFORT_TIERS)}") from None


def level_spacing(levels: Sequence[int]) -> float:
    """delta_b: the average spacing between the (distinct, sorted) training levels; 0 for one level."""
    distinct = sorted(set(int(b) for b in levels))
    if not distinct:
        raise ValueError("effort: at least one training level is needed")
    for b in distinct:
        _check_level(b)
    if len(distinct) == 1:
        return 0.0
    return (distinct[-1] - distinct[0]) / (len(distinct) - 1)


def penalty_coefficient(b: int, levels: Sequence[int], k0: float, decay_lambda: float) -> float:
    """Eq. 10: k(b) = k0 * exp(-(b - b_min) / (lambda * delta_b))."""
    _check_level(b)
    b_min = min(levels)
    if b < b_min:
        raise ValueError(f"effort level {b} is below the lowest training level {b_min}")
    spacing = level_spacing(levels)
    if b == b_min:
        return float(k0)
    tau = decay_lambda * spacing
    if tau <= 0:
        raise ValueError(f"effort: tau = lambda * delta_b must be positive, got {decay_lambda} * {spacing}")
    return float(k0) * math.exp(-(b - b_min) / tau)


def length_penalty(num_reasoning_tokens: int, b: int, levels: Sequence[int], *, k0: float, decay_lambda: float,
                   l_norm: float, c_max: float) -> float:
    """Eq. 9: r_len = -min(C_max, k(b) * l / L_norm)."""
    if num_reasoning_tokens < 0:
        raise ValueError(f"reasoning token count must be >= 0, got {num_reasoning_tokens}")
    k = penalty_coefficient(b, levels, k0, decay_lambda)
    return -min(float(c_max), k * num_reasoning_tokens / float(l_norm))
