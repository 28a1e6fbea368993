"""Rollout metrics of one post-training step (issue 14's list), from the groups it trains on.

Reward mean / std, verifiable accuracy, response length, truncation rate (responses cut by the
length limit), turns per sample, and the staleness histogram: for each sample, how many policy
versions its oldest generated token lags the learner (report §5.2.2), as ``staleness_k`` =
fraction of samples k versions behind (``staleness_gt`` beyond ``max_staleness``).
Loss-side metrics (masked-token fraction, importance weights, train/rollout mismatch) come from
:class:`~megatron_s2.posttrain.train_batch.PosttrainLoss`; throughput and the time split from
the trainer.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["rollout_metrics"]


def rollout_metrics(groups: Sequence, *, current_version: int, max_staleness: int) -> dict[str, float]:
    samples = [s for g in groups for s in g.accepted]
    n = max(len(samples), 1)
    rewards = [float(s.reward) for s in samples]
    mean = sum(rewards) / n
    out = {"reward_mean": mean, "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
           "samples": float(len(samples)), "groups": float(len(groups))}
    verdicts = [s.correct for s in samples if s.correct is not None]
    if verdicts:
        out["accuracy"] = sum(1.0 for v in verdicts if v) / len(verdicts)
    lengths = [s.num_generated for s in samples]
    out["response_length"] = sum(lengths) / n
    out["response_length_max"] = float(max(lengths, default=0))
    out["truncation_rate"] = sum(1.0 for s in samples if s.finish_reason == "length") / n
    out["turns"] = sum(max(len(s.spans), 1) for s in samples) / n
    out["solved_groups"] = sum(1.0 for g in groups if all(x.reward == g.accepted[0].reward for x in g.accepted)
                               and g.accepted[0].reward > 0) / max(len(groups), 1)
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
