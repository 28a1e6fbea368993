"""Session-aware outcome credit with process weights (walkthrough Ch. 7, Eq. 30).

An agentic session earns one outcome reward; its group-relative advantage A_i (computed over
the group of sessions of the same task, exactly as for single responses) is assigned to every
*trainable* policy-generated segment of the session. A deterministic process annotator may
attach a weight w_{i,k} in [-1, 1] to segment k, which applies **only to positive**
advantages (**Eq. 30**)::

    A_{i,k} = w_{i,k} * A_i   if A_i > 0
    A_{i,k} = A_i             otherwise

so a failed session keeps its full negative signal on every segment, and a malformed or
repeated step inside a successful session earns nothing or is pushed down. Non-trainable
tokens (system, user, tool observations) get advantage zero. The weights come from the
deterministic process annotator (:mod:`megatron_s2.posttrain.agentic.annotator`);
:func:`labelled_segment_advantages` is the walkthrough's ``assign`` over a whole transcript.

**Per-turn credit** (``rl.advantage.credit: turn``): when the environment scores each assistant
turn (e.g. a retry session: the first reply's reward is first-try correctness, the second's is
second-try correctness), :func:`turn_group_advantages` gives turn k of every session of a group
the group-relative advantage of the turn-k rewards over the sessions that reached turn k, instead
of the session's one A_i; :func:`turn_segment_advantages` then applies Eq. 30 per turn. A wrong
first reply is then pushed down whatever the retry achieved afterwards.

Worked example 22: six sessions with R = (1,0,0,1,0,0) have leave-one-out advantages +0.8 and
-0.4; worked example 21/23: with weights (1, 0, -0.5, 1) a success at +0.60 gives
(0.60, 0, -0.30, 0.60) and a failure at -0.60 gives -0.60 on every segment.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_s2.posttrain.advantages.group import is_informative, std_normalize

__all__ = ["segment_advantages", "labelled_segment_advantages", "token_advantages", "turn_segment_advantages",
           "turn_group_advantages"]


def segment_advantages(advantage: float, process_weights: Sequence[float]) -> list[float]:
    """Eq. 30 for the trainable segments of one session."""
    out = []
    for k, w in enumerate(process_weights):
        if not -1.0 <= float(w) <= 1.0:
            raise ValueError(f"process weight of segment {k} must lie in [-1, 1], got {w}")
        out.append(float(w) * advantage if advantage > 0 else float(advantage))
    return out


def turn_segment_advantages(advantages: Sequence[float], process_weights: Sequence[float]) -> list[float]:
    """Eq. 30 per turn: segment k's own advantage ``advantages[k]`` under its weight (empty
    ``process_weights`` = all 1.0)."""
    weights = list(process_weights) or [1.0] * len(advantages)
    if len(weights) != len(advantages):
        raise ValueError(f"{len(advantages)} turn advantages but {len(weights)} process weights")
    return [segment_advantages(float(a), [w])[0] for a, w in zip(advantages, weights)]


def turn_group_advantages(turn_rewards: Sequence[Sequence[float]], estimator: Callable[[torch.Tensor], torch.Tensor],
                          *, atol: float = 0.0, std_eps: float | None = None) -> list[list[float]]:
    """Per-turn group-relative advantages of one group of sessions: ``turn_rewards[i][k]`` is
    session i's reward of its turn k. Turn k's advantages come from ``estimator`` over the rewards
    of the sessions that have a turn k; a turn that fewer than two sessions reached, or whose
    rewards are all equal (within ``atol``), gets 0 (nothing to compare). ``std_eps`` (when given)
    divides each turn's advantages by that turn's reward std + eps."""
    out = [[0.0] * len(r) for r in turn_rewards]
    for k in range(max((len(r) for r in turn_rewards), default=0)):
        who = [i for i, r in enumerate(turn_rewards) if len(r) > k]
        rewards = torch.tensor([float(turn_rewards[i][k]) for i in who], dtype=torch.float64)
        if len(who) < 2 or not is_informative(rewards, atol):
            continue
        adv = estimator(rewards)
        if std_eps is not None:
            adv = std_normalize(adv, rewards, std_eps)
        for i, a in zip(who, adv.tolist()):
            out[i][k] = float(a)
    return out


def labelled_segment_advantages(advantage: float, trainable: Sequence[bool],
                                process_weights: Sequence[float]) -> list[float]:
    """Every segment of a session in order (walkthrough Ch. 7, ``assign``): Eq. 30 on the trainable
    (policy) segments, whose weights ``process_weights`` lists in order; 0 on the rest."""
    if sum(map(bool, trainable)) != len(process_weights):
        raise ValueError(f"{sum(map(bool, trainable))} trainable segments but {len(process_weights)} process weights")
    values = iter(segment_advantages(advantage, process_weights))
    return [next(values) if t else 0.0 for t in trainable]


def token_advantages(advantage: float, spans: Sequence[tuple[int, int]], process_weights: Sequence[float],
                     num_tokens: int) -> torch.Tensor:
    """Per-token advantages [num_tokens] of one session: segment k's value on tokens
    ``spans[k] = (start, end)``, zero elsewhere (non-policy tokens)."""
    if len(spans) != len(process_weights):
        raise ValueError(f"{len(spans)} trainable spans but {len(process_weights)} process weights")
    adv = torch.zeros(num_tokens, dtype=torch.float64)
    for (start, end), value in zip(spans, segment_advantages(advantage, process_weights)):
        if not 0 <= start <= end <= num_tokens:
            raise ValueError(f"span ({start}, {end}) lies outside a session of {num_tokens} tokens")
        adv[start:end] = value
    return adv
