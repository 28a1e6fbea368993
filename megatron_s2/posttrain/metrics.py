"""Rollout metrics of one post-training step (issue 14's list; issue 26: honest figures).

Two populations, named apart so that a reader cannot take one for the other:

* ``rollout_*`` — **every** episode that completed during the step's rollout and every group that
  closed, before any filtering (:class:`~megatron_s2.posttrain.orchestrator.RolloutOutcomes`,
  recorded by the orchestrator as episodes arrive, before DAPO dynamic sampling judges their
  group): ``rollout_reward_mean`` / ``rollout_reward_std`` / ``rollout_accuracy`` over the
  episodes, ``rollout_episodes``, ``rollout_groups``, ``rollout_filtered_groups`` (dropped as
  uninformative), ``rollout_solved_groups`` (fraction of groups whose episodes all earned the same
  positive reward), ``rollout_metric_<name>`` (the mean of an environment's per-episode metric, e.g.
  the verifiers retry taskset's ``first_try_correct``). This is the policy's own reward: dynamic sampling keeps only groups with mixed
  rewards, which pins a binary reward's trained mean near 0.5 whatever the policy's accuracy.
* ``trained_*`` and the rest — the groups the optimiser step trains on: ``trained_reward_mean`` /
  ``trained_reward_std`` / ``trained_accuracy``, ``samples``, ``groups``, response length,
  truncation rate (responses cut by the length limit), turns per sample, and the staleness
  histogram: for each sample, how many policy versions its oldest generated token lags the learner
  (report §5.2.2), as ``staleness_k`` = fraction of samples k versions behind (``staleness_gt``
  beyond ``max_staleness``).

Loss-side metrics (masked-token fraction, importance weights, train/rollout mismatch) come from
:class:`~megatron_s2.posttrain.train_batch.PosttrainLoss`; throughput and the time split from
the trainer; held-out accuracy from :mod:`~megatron_s2.posttrain.rollout.evaluation` (``eval_*``).
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["rollout_metrics", "unfiltered_metrics", "reward_figures"]


def reward_figures(rewards: Sequence[float], verdicts: Sequence[bool | None], prefix: str) -> dict[str, float]:
    """``<prefix>reward_mean`` / ``_std`` over ``rewards``; ``<prefix>accuracy`` over the episodes
    whose environment gave a verdict (absent when none did; all absent without episodes)."""
    if not rewards:
        return {}  # nothing completed (a batch of groups that were ready earlier): no figure rather than a 0
    mean = sum(rewards) / len(rewards)
    out = {f"{prefix}reward_mean": mean,
           f"{prefix}reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))}
    judged = [v for v in verdicts if v is not None]
    if judged:
        out[f"{prefix}accuracy"] = sum(1.0 for v in judged if v) / len(judged)
    return out


def unfiltered_metrics(outcomes) -> dict[str, float]:
    """``rollout_*`` of a :class:`~megatron_s2.posttrain.orchestrator.RolloutOutcomes`: every
    episode completed and every group closed, kept or filtered (module docstring)."""
    out = reward_figures(outcomes.rewards, outcomes.correct, "rollout_")
    out["rollout_episodes"] = float(len(outcomes.rewards))
    out["rollout_groups"] = float(outcomes.groups)
    out["rollout_filtered_groups"] = float(outcomes.filtered)
    out["rollout_solved_groups"] = outcomes.solved / max(outcomes.groups, 1)
    for name, values in sorted(outcomes.metrics.items()):
        if values:
            out[f"rollout_metric_{name}"] = sum(values) / len(values)
    return out


def rollout_metrics(groups: Sequence, outcomes, *, current_version: int, max_staleness: int) -> dict[str, float]:
    """``groups``: the step's trained :class:`~megatron_s2.posttrain.orchestrator.PromptGroup` s;
    ``outcomes``: what completed since the previous step (``Orchestrator.take_outcomes()``)."""
    samples = [s for g in groups for s in g.accepted]
    n = max(len(samples), 1)
    out = unfiltered_metrics(outcomes)
    out.update(reward_figures([float(s.reward) for s in samples], [s.correct for s in samples], "trained_"))
    out["samples"], out["groups"] = float(len(samples)), float(len(groups))
    lengths = [s.num_generated for s in samples]
    out["response_length"] = sum(lengths) / n
    out["response_length_max"] = float(max(lengths, default=0))
    out["truncation_rate"] = sum(1.0 for s in samples if s.finish_reason == "length") / n
    out["turns"] = sum(max(sum(len(row.spans) for row in s.rows), 1) for s in samples) / n
    out["rows_per_sample"] = sum(len(s.rows) for s in samples) / n  # > 1: multi-branch episodes (episode_rows)
    buckets = max(max_staleness, 0)
    hist = [0] * (buckets + 2)
    for s in samples:
        k = s.staleness(current_version)
        hist[min(k, buckets + 1)] += 1
    for k in range(buckets + 1):
        out[f"staleness_{k}"] = hist[k] / n
    out["staleness_gt"] = hist[-1] / n
    versions = [len(set(s.policy_versions)) for s in samples]
    out["versions_per_sample"] = sum(versions) / n
    return out
