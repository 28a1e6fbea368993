"""A finished verifiers trace as one training sample, token-in/token-out (issue 14, walkthrough Ch. 6).

verifiers (0.4.0, ``verifiers.v1``) keeps, per root-to-leaf *branch* of a trace's message graph,
exactly the token ids its training client sent to and received from ``/inference/v1/generate``
(the renderer's prompt ids, the engine's completion ids), a ``sampled_mask`` (True on the
tokens the model sampled), the engine's log-probs spread onto the sampled positions and the
routed-experts array ``[tokens, layers, topk]`` (one row per token; the last row is a
placeholder copy, since no forward fed the final sampled token). A branch of a multi-turn trace
is the session's growing context: assistant turns are sampled, everything between them (the
chat template's scaffold, tool results, user follow-ups) is not.

:func:`branch_sample` turns those arrays into a :class:`RolloutSample` without re-tokenising:

* ``tokens`` = the branch's ids up to the end of the last sampled turn (trailing environment
  tokens carry no loss and are dropped, as :class:`~megatron_s2.posttrain.multiturn.SessionBuilder`
  does);
* ``policy_mask`` = ``sampled_mask`` (environment and tool tokens loss-masked), ``spans`` = its
  runs of True (one per assistant turn: the unit of Eq. 30's process weights);
* ``logprobs`` = the behaviour log-probs on sampled tokens, 0.0 elsewhere; ``versions`` = the
  policy version that generated the trace on sampled tokens, -1 elsewhere;
* ``routing`` (R3, report §5.2.1) = rows ``0 .. len - 2`` (every fed position), -1 entries of
  decoder layers the engine skipped (bounded replay) handled as in
  :func:`~megatron_s2.posttrain.rollout.engine_backend.routing_record`.

:func:`trace_sample` applies it to a trace's (last) trainable branch with the rubric's reward
(``trace.reward``: the weighted sum of its ``@vf.reward`` scores). An environment reports
per-turn rewards (``rl.advantage.credit: turn``) as ``@vf.metric`` values named
``turn_reward_<k>`` (k = 1, 2, ...: the k-th assistant turn); they become the sample's
``turn_rewards`` (one per span), not reported metrics.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.rollout.engine_backend import routing_record

__all__ = ["branch_sample", "trace_sample", "sampled_spans", "TURN_REWARD_PREFIX"]

TURN_REWARD_PREFIX = "turn_reward_"
"""A rubric metric ``turn_reward_<k>`` is the reward of the session's k-th assistant turn (1-based)."""


def sampled_spans(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """[start, end) of every run of True in ``mask``."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def branch_sample(sample_id: int, token_ids: Sequence[int], sampled_mask: Sequence[bool], logprobs: Sequence[float],
                  routed: np.ndarray | None, *, version: int, layer_ids: Sequence[int] | None,
                  reward: float | None = None, finish_reason: str = "stop") -> RolloutSample:
    """One branch's arrays (aligned to ``token_ids``) as a sample; ``layer_ids`` None = no routing."""
    ids, mask, lps = [int(t) for t in token_ids], [bool(m) for m in sampled_mask], [float(x) for x in logprobs]
    if not len(ids) == len(mask) == len(lps):
        raise ValueError(f"sample {sample_id}: the trace has {len(ids)} token ids, {len(mask)} mask entries and "
                         f"{len(lps)} log-probs")
    spans = sampled_spans(mask)
    if not spans:
        raise ValueError(f"sample {sample_id}: the trace has no sampled tokens (the harness never called the model)")
    end = spans[-1][1]
    ids, mask, lps = ids[:end], mask[:end], lps[:end]
    for i, (m, lp) in enumerate(zip(mask, lps)):
        if m and not (math.isfinite(lp) and lp <= 0.0):
            raise ValueError(f"sample {sample_id}: sampled token {i} has log-probability {lp}; the engine's "
                             "/inference/v1/generate log-probs did not reach the trace")
    routing = None
    if layer_ids is not None:
        if routed is None:
            raise ValueError(f"sample {sample_id}: the trace carries no routed experts but R3 "
                             "(rollout.engine.routing_replay) needs them; a turn's routing did not reach the trace")
        rows = np.asarray(routed)
        if rows.ndim != 3 or rows.shape[0] < end or rows.shape[1] != len(layer_ids):
            raise ValueError(f"sample {sample_id}: routed experts of shape {tuple(rows.shape)} do not cover {end} "
                             f"tokens x {len(layer_ids)} MoE layers")
        fed = torch.from_numpy(rows[:end - 1].astype(np.int32))
        routing = routing_record(fed, layer_ids, 0, end - 1, torch.full((end - 1,), version, dtype=torch.int32))
    return RolloutSample(sample_id, ids, mask, [lp if m else 0.0 for m, lp in zip(mask, lps)],
                         [version if m else -1 for m in mask], prompt_length=spans[0][0], routing=routing,
                         reward=reward, finish_reason=finish_reason, spans=spans, process_weights=[1.0] * len(spans))


def trace_sample(trace, sample_id: int, *, version: int, layer_ids: Sequence[int] | None) -> RolloutSample:
    """A finished ``vf.Trace`` as a sample carrying the rubric's reward.

    An append-only session is one branch: all its turns are trained, the environment's tokens
    between them masked. When the renderer re-rendered the history so that a later call's prompt
    does not extend the earlier ids (e.g. the ``default`` renderer, which cannot bridge turns: a
    sampled reply re-tokenises differently, or the template closes a reply cut by the length
    limit), verifiers starts a new branch; the sample is then the *last* trainable branch — the
    final call's exact context and completion, the earlier (re-rendered) turns as masked context.
    (prime-rl trains every branch as its own sample; one sample per episode is trained so far.)

    ``correct`` (the accuracy metric) is set when the rubric has a reward named ``correct``
    (score > 0 = correct), as the embedded tasks' rubric does; ``metrics`` are the rubric's
    ``@vf.metric`` values (reported, not trained on)."""
    branches = [b for b in trace.branches if b.trainable]
    if not branches:
        raise ValueError(f"sample {sample_id}: the trace has no trainable branch")
    branch = branches[-1]
    sample = branch_sample(sample_id, branch.token_ids, branch.sampled_mask, branch.logprobs, branch.routed_experts,
                           version=version, layer_ids=layer_ids, reward=float(trace.reward),
                           finish_reason="length" if trace.is_truncated else "stop")
    correct = trace.rewards.get("correct")
    if correct is not None:
        sample.correct = bool(correct.score > 0)
    metrics = {name: float(value) for name, value in trace.metrics.items() if value is not None}
    turns = {int(name[len(TURN_REWARD_PREFIX):]): metrics.pop(name) for name in list(metrics)
             if name.startswith(TURN_REWARD_PREFIX) and name[len(TURN_REWARD_PREFIX):].isdigit()}
    sample.metrics = metrics
    if turns and len(branches) == 1:  # one append-only branch: its spans are the session's turns 1..n
        n = len(sample.spans)
        if not all(k in turns for k in range(1, n + 1)):
            raise ValueError(f"sample {sample_id}: the session has {n} assistant turns but the rubric reports "
                             f"per-turn rewards for turns {sorted(turns)} (metrics {TURN_REWARD_PREFIX}<k>)")
        sample.turn_rewards = [turns[k] for k in range(1, n + 1)]
    return sample
