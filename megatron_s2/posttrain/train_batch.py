"""One post-training step's micro-batches and the objective the step functions call.

Every rank holds the whole global batch of samples (the replicated orchestrator hands the same
groups to every rank) and lays them out as rows — one per sample, or one per trace branch of a
multi-branch agentic episode, padded with filler rows (:mod:`~megatron_s2.posttrain.episode_rows`);
each data-parallel rank collates its contiguous share of the rows into micro-batches
(:func:`~megatron_s2.posttrain.batch.collate`: exact token ids, loss mask, behaviour log-probs,
versions, advantages, R3 records). Aggregation weights (token mean, sequence mean, fixed) are
computed here from the *global* counts, before any context-parallel split, so the sum of the
micro-batch objectives over micro-batches, data- and context-parallel ranks is the global
objective whatever the layout (the contract of :mod:`megatron_s2.pipeline.losses`).

:class:`PosttrainLoss` is the ``loss_fn`` of :class:`~megatron_s2.pipeline.step.StepInputs`: on
the last pipeline stage it turns the logits shard into the walkthrough's objective (Eq. 29 / 36,
or the full-vocabulary KL of report §5.2.4) through
:class:`~megatron_s2.posttrain.losses.PosttrainObjective`, and keeps (sum, count) statistics for
the metrics (masked-token fractions, importance weights, train/rollout mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.context_parallel import local_chunk_positions
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.posttrain.batch import collate
from megatron_s2.posttrain.episode_rows import training_rows
from megatron_s2.posttrain.losses.aggregation import aggregation_weights
from megatron_s2.posttrain.losses.objective import PosttrainObjective
from megatron_s2.posttrain.losses.terms import LossInputs
from megatron_s2.posttrain.opd.sampled_token import opd_advantages
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.vocab_parallel import token_log_probs
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

__all__ = ["build_micro_batches", "split_routing_for_cp", "PosttrainLoss", "TERM_STATS"]

TERM_STATS = {"policy_gradient": ["importance_weight"], "reference_kl": ["reference_kl"],
              "full_vocab_kl": ["teacher_kl"], "entropy": ["entropy"]}
"""Diagnostics each loss term reports (see :mod:`~megatron_s2.posttrain.losses.terms`)."""


def build_micro_batches(samples: Sequence[RolloutSample], advantages: Sequence, *, seq_length: int,
                        micro_batch_size: int, dp_rank: int, dp_size: int, pad_id: int, loss_config,
                        dataset_weights: dict[str, float] | None = None, train_aware_replay: bool = False,
                        micro_batch_multiple: int = 1) -> list[dict]:
    """This data-parallel rank's micro-batches (dicts of [b, s] tensors + ``routing``) of the
    samples' rows (:func:`~megatron_s2.posttrain.episode_rows.training_rows`); every rank gets
    the same number of them, a multiple of ``micro_batch_multiple`` (interleaved 1F1B: pp)."""
    if len(samples) % (micro_batch_size * dp_size):
        raise ValueError(f"{len(samples)} samples do not split into micro-batches of {micro_batch_size} on {dp_size} "
                         "data-parallel ranks")
    layout = training_rows(samples, advantages, multiple=micro_batch_size * dp_size * micro_batch_multiple)
    rows, total = layout.rows, len(layout.rows)
    global_tokens = layout.loss_tokens
    sequence_tokens = torch.tensor(layout.episode_tokens(), dtype=torch.float64)
    per_rank = total // dp_size
    first = dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, micro_batch_size):
        part = rows[start:start + micro_batch_size]
        batch = collate(part, layout.advantages[start:start + micro_batch_size], seq_length, pad_id=pad_id,
                        sequence_ids=layout.episodes[start:start + micro_batch_size], dataset_weights=dataset_weights)
        weights = aggregation_weights(batch.loss_mask, loss_config.aggregation, global_tokens=max(global_tokens, 1.0),
                                      sequence_ids=batch.sequence_ids, global_sequences=float(layout.num_episodes),
                                      sequence_tokens=sequence_tokens, constant=loss_config.aggregation_constant or None,
                                      sample_weights=batch.sample_weights)
        mb = {"tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.loss_mask.float(),
              "position_ids": batch.position_ids, "behaviour_logprobs": batch.behaviour_logprobs,
              "versions": batch.versions, "advantages": batch.advantages, "weights": weights.float(),
              "routing": batch.routing, "domains": [s.dataset for s in part]}
        bearing = batch.loss_mask.any(dim=1)
        if not bool(bearing.all()):  # a filler row (episode_rows), or a row with every label masked
            mb["aux_rows"] = bearing  # the balance losses (router, drafter MoEs) see only the others
            if batch.routing is not None and batch.routing.counted is not None:
                batch.routing.counted[~bearing] = False  # nor do the routers' expert loads (aux-free bias)
        if train_aware_replay:
            mb["swa_from"] = torch.tensor([s.replay_start for s in part], dtype=torch.int64)
        out.append(mb)
    return out


def split_routing_for_cp(routing: RoutingReplay | None, seq_length: int, cp: Group) -> RoutingReplay | None:
    """A micro-batch's R3 replay restricted to this context-parallel rank's two chunks."""
    if routing is None or not cp.active:
        return routing
    idx = local_chunk_positions(seq_length, cp)
    counted = None if routing.counted is None else routing.counted.index_select(1, idx.to(routing.counted.device))
    return RoutingReplay(RoutingMode.REPLAY, {layer: [e.index_select(1, idx.to(e.device)) for e in entries]
                                               for layer, entries in routing.records().items()}, counted=counted)


@dataclass
class PosttrainLoss:
    """The ``loss_fn`` of a post-training step (module docstring)."""

    objective: PosttrainObjective
    groups: ParallelGroups
    current_version: int
    global_tokens: float
    mode: str = "rl"
    """'rl' (advantages from the batch), 'opd_sampled' (Eq. 33 advantages), 'opd_full' (full-vocab KL)."""
    proximal: str = "snapshot"
    stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)

    def stat_keys(self) -> list[str]:
        cfg = self.objective.config
        keys = ["masked_any", *(f"masked_{m}" for m in cfg.masks), "mismatch_abs_logprob", "mismatch_k3",
                "policy_logprob", "behaviour_logprob"]
        for term in cfg.terms:
            keys += [f"loss_{term.kind}", *TERM_STATS.get(term.kind, [])]
        if self.mode == "opd_sampled":
            keys += ["opd_advantage", "teacher_logprob"]
        return keys

    def _add(self, key: str, total: torch.Tensor, count: torch.Tensor) -> None:
        s = self.stats.setdefault(key, [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])
        s[0] += total.detach().double().cpu()
        s[1] += count.detach().double().cpu()

    def __call__(self, model, logits: torch.Tensor, mb: dict, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, tp = self.objective.config, self.groups.tp
        lp = token_log_probs(logits, mb["labels"], tp, cfg.temperature)
        mask = mb["loss_mask"].bool()
        behaviour = mb["behaviour_logprobs"].to(lp.dtype)
        advantages = mb["advantages"].to(lp.dtype)
        if self.mode == "opd_sampled":
            prox = lp.detach() if self.proximal == "snapshot" else behaviour
            advantages = opd_advantages(mb["teacher_logprobs"].to(lp.dtype), prox, mask)
            n = mask.sum()
            self._add("opd_advantage", (advantages * mask).sum(), n)
            self._add("teacher_logprob", (mb["teacher_logprobs"] * mask).sum(), n)
        inputs = LossInputs(logprobs=lp, loss_mask=mask, weights=mb["weights"].to(lp.dtype),
                            behaviour_logprobs=behaviour, advantages=advantages, versions=mb["versions"],
                            current_version=self.current_version, reference_logprobs=mb.get("reference_logprobs"),
                            logits=logits, teacher_logits=mb.get("teacher_logits"), tp=tp)
        res = self.objective(inputs)
        for key, (total, count) in res.stats.items():
            if key == "importance_weight_max":
                prev = self.maxima.get(key)
                value = total.detach().double().cpu()
                self.maxima[key] = value if prev is None else torch.maximum(prev, value)
            else:
                self._add(key, total, count)
        with torch.no_grad():  # train / rollout mismatch on tokens of the learner's own version (§5.2.2)
            same = mask & (mb["versions"] == self.current_version)
            d = (lp.detach() - behaviour)
            self._add("mismatch_abs_logprob", (d.abs() * same).sum(), same.sum())
            self._add("mismatch_k3", ((torch.exp(-d) + d - 1.0) * same).sum(), same.sum())
            self._add("policy_logprob", (lp.detach() * mask).sum(), mask.sum())
            self._add("behaviour_logprob", (behaviour * mask).sum(), mask.sum())
        return res.objective, res.objective.detach() * self.global_tokens

    def reduce(self) -> dict[str, float]:
        """Global means (sum / count) over data-, context- and pipeline-parallel ranks; collective."""
        keys = self.stat_keys()
        local = torch.zeros(2 * len(keys) + 1, dtype=torch.float64)
        for i, k in enumerate(keys):
            if k in self.stats:
                local[2 * i], local[2 * i + 1] = self.stats[k][0], self.stats[k][1]
        local[-1] = self.maxima.get("importance_weight_max", torch.zeros((), dtype=torch.float64))
        g = self.groups
        dev = g_device(g)
        sums = mappings.all_reduce_sum(mappings.all_reduce_sum(local[:-1].to(dev), g.dp_cp), g.pp).cpu()
        peak = mappings.all_reduce_max(mappings.all_reduce_max(local[-1:].to(dev), g.dp_cp), g.pp).cpu()
        out = {}
        for i, k in enumerate(keys):
            if k.startswith("loss_"):
                out[k] = float(sums[2 * i])  # already a share of the global objective
            elif sums[2 * i + 1] > 0:
                out[k] = float(sums[2 * i] / sums[2 * i + 1])
        if "importance_weight" in out:
            out["importance_weight_max"] = float(peak[0])
        return out


def g_device(groups: ParallelGroups) -> str:
    """Collectives of a CPU (gloo) run take CPU tensors; NCCL needs the rank's GPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
