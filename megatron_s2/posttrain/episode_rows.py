"""Episodes -> training rows: multi-branch agentic sessions, every policy segment trained once
(issue 25; walkthrough Ch. 6 "The PrefixTree", Ch. 7 "Session-aware outcome credit").

A harness that keeps its history verbatim (the Agents SDK, the anthropic loop, ``builtin``) leaves
one PrefixTree branch per episode: one row. One that re-renders its history (smolagents writes its
earlier calls back as its own text) leaves one branch per model call: the branches share their
trunk (system prompt and task, stored once) and each ends in the segment that call sampled. The
orchestrator's unit stays the episode (one reward, one group-relative advantage, one staleness);
its :attr:`~megatron_s2.posttrain.orchestrator.RolloutSample.branches` are further rows.
:func:`training_rows` lays them out:

* **Every branch that ends in policy tokens is a row**, its tokens exactly what the engine saw and
  sampled for that call (TITO): the sampled ids with their rollout log-probs, routed experts (R3)
  and versions, everything else masked. Re-rendered history — the harness's own text for earlier
  calls, which the engine never sampled in that position (its log-probs would be wrong) — is a
  context node of the branch it appears on: never trained.
* **Each policy segment counts once.** A response node two branches share (a harness that kept part
  of its history verbatim, then re-rendered) is trainable in the first branch that holds it and
  masked as context in the others (:func:`~megatron_s2.posttrain.agentic.gateway_episode.
  session_samples`, when the trace is read). Masking rather than a 1/k weight: a tree node's prefix
  is unique, so its k copies are k identical computations — keeping one is exact, and every
  aggregation then weighs each sampled token once with no fractional weights: ``token_mean``
  divides by the rows' loss tokens (each sampled token once), ``sequence_mean`` gives an episode's
  rows one sequence id (the mean over the episode's trained tokens, each episode once),
  ``fixed`` is a plain sum.
* **Credit**: the episode's session advantage goes to every one of its rows; each row's spans carry
  their own process weights (Eq. 30: ``w * A`` when A > 0, ``A`` otherwise), the annotator's weights
  dealt out in the trace's segment order (:func:`~megatron_s2.posttrain.rollout.agentic_trace.
  episode_samples`). Per-turn advantages (``credit: turn``) of a multi-branch episode are refused.
* **Fillers**: the number of rows varies with the branches episodes left; it is padded to a multiple
  of ``micro_batch_size`` x data-parallel size (x pp under interleaved 1F1B, which needs a multiple
  of pp micro-batches per rank) with filler rows — copies of a real row whose loss mask, advantage
  and sequence id are empty — so every micro-batch and rank is full and R3 records stay aligned;
  the step's micro-batch count follows the rows. The policy, entropy and KL terms and their
  statistics see nothing of a filler (its loss mask), and neither do the terms that are not
  loss-masked: a micro-batch with a row that bears no loss (a filler, or a real row with every
  label masked) carries ``aux_rows`` (:func:`~megatron_s2.posttrain.train_batch.build_micro_batches`),
  and the routers' balance losses — V4.1's sequence balance loss (a mean over the other rows),
  Intern-S2's load-balancing loss (over the other rows' tokens), the DSpark drafter MoEs' (over the
  other rows' draft blocks) — and the routers' expert loads for the aux-loss-free bias (R3's
  ``counted``) leave it out; the drafter's own loss fits the policy only where it sampled (the loss
  mask) already. What remains: the step averages auxiliary losses over its micro-batches, so a
  micro-batch of fillers only adds nothing to their sum but one to the count they are divided by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from megatron_s2.posttrain.orchestrator.sample import RolloutSample

__all__ = ["TrainingRows", "training_rows", "filler_row"]


@dataclass
class TrainingRows:
    """A global batch's rows (module docstring), aligned lists."""

    rows: list[RolloutSample]
    advantages: list
    """Each row's episode advantage (a float, or a list per span with ``credit: turn``)."""
    episodes: list[int]
    """Each row's episode: index into the samples (its sequence id), -1 for a filler."""
    num_episodes: int

    @property
    def loss_tokens(self) -> float:
        """Loss-bearing labels of every row: each sampled token once."""
        return float(sum(sum(row.policy_mask[1:]) for row in self.rows))

    def episode_tokens(self) -> list[float]:
        """Loss-bearing labels per episode (``sequence_mean``'s per-sequence counts)."""
        counts = [0.0] * self.num_episodes
        for row, episode in zip(self.rows, self.episodes):
            if episode >= 0:
                counts[episode] += sum(row.policy_mask[1:])
        return counts


def filler_row(row: RolloutSample) -> RolloutSample:
    """``row``'s tokens (and R3 record) with nothing trained."""
    n = len(row.tokens)
    return replace(row, policy_mask=[False] * n, logprobs=[0.0] * n, versions=[-1] * n, spans=[],
                   process_weights=[], turn_rewards=[], branches=[])


def training_rows(samples: Sequence[RolloutSample], advantages: Sequence, *, multiple: int = 1) -> TrainingRows:
    """Every row of every episode with its episode's advantage, padded with filler rows to a
    multiple of ``multiple`` (module docstring)."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    rows, row_advantages, episodes = [], [], []
    for k, (sample, advantage) in enumerate(zip(samples, advantages)):
        if sample.branches and isinstance(advantage, (list, tuple)):
            raise ValueError(f"sample {sample.sample_id}: an episode of {len(sample.rows)} trace branches has "
                             "per-turn advantages (rl.advantage.credit: turn); multi-branch episodes are credited "
                             "per session — use credit: session")
        for row in sample.rows:
            rows.append(row)
            row_advantages.append(advantage)
            episodes.append(k)
    real = len(rows)
    for i in range(-real % multiple if real else 0):
        rows.append(filler_row(rows[i % real]))
        row_advantages.append(0.0)
        episodes.append(-1)
    return TrainingRows(rows, row_advantages, episodes, len(samples))
