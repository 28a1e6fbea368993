"""A harness episode's PrefixTree trace as training samples (issue 25; walkthrough Ch. 6-7).

:func:`episode_samples` turns a :class:`~megatron_s2.posttrain.agentic.gateway_episode.HarnessEpisode`
into the orchestrator's :class:`~megatron_s2.posttrain.orchestrator.RolloutSample` form without
re-tokenising anything, through the same :func:`~.vf_trace.branch_sample` the verifiers traces
use: ``tokens`` are the branch's stored ids (the engine's own), ``policy_mask`` its loss mask
(policy segments trainable; context, tool observations and skip-marked steps masked),
``logprobs`` the rollout log-probs on sampled tokens, ``spans`` the policy segments (the unit of
Eq. 30) carrying the process annotator's ``process_weights``, ``reward`` / ``correct`` the
grade after the agent stopped, ``routing`` the routed experts (R3) when asked for.

One sample per branch: a harness that keeps its history verbatim (the Agents SDK, the anthropic
loop, ``builtin``) gives one; one that re-renders it (smolagents) gives one per call, each policy
segment trainable in exactly one of them — all of them carry the episode's one reward, so a
group-relative advantage must be computed per *episode* (:func:`~megatron_s2.posttrain.agentic.
gateway_episode.group_token_advantages`), not per sample: :func:`episode_sample` makes the first
the episode's sample and the others its ``branches`` (:mod:`~megatron_s2.posttrain.episode_rows`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.rollout.vf_trace import branch_sample

__all__ = ["episode_samples", "episode_sample"]


def episode_samples(episode, first_id: int, *, version: int, layer_ids: Sequence[int] | None) -> list[RolloutSample]:
    """The trainable branches of ``episode`` as samples ``first_id, first_id + 1, ...`` (module
    docstring); a branch whose responses all train elsewhere is left out."""
    weights, out = list(episode.weights), []
    for branch in episode.samples:
        if not branch.loss_mask.any():
            continue
        logprobs = np.nan_to_num(branch.logprobs, nan=0.0)  # NaN marks context tokens: not sampled
        sample = branch_sample(first_id + len(out), branch.token_ids, branch.loss_mask, logprobs, branch.experts,
                               version=version, layer_ids=layer_ids, reward=episode.reward)
        if len(sample.spans) > len(weights):
            raise ValueError(f"episode {episode.session}: {len(sample.spans)} policy spans in a branch but "
                             f"{len(weights)} process weights left")
        sample.process_weights, weights = weights[:len(sample.spans)], weights[len(sample.spans):]
        sample.correct = episode.reward > 0
        out.append(sample)
    if weights:
        raise ValueError(f"episode {episode.session}: {len(weights)} process weights without a policy span")
    return out


def episode_sample(episode, sample_id: int, *, version: int, layer_ids: Sequence[int] | None) -> RolloutSample | None:
    """The episode as one sample of its group: its first trainable branch, the others in ``branches``
    (module docstring); every row carries ``sample_id`` and the harness's stop reason. None when
    the harness made no trainable model call."""
    rows = episode_samples(episode, sample_id, version=version, layer_ids=layer_ids)
    if not rows:
        return None
    for row in rows:
        row.sample_id, row.finish_reason = sample_id, episode.stop_reason
    sample, sample.branches = rows[0], rows[1:]
    return sample
