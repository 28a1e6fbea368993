"""Analytic communication volume and per-rank parameter/optimiser memory of one training step.

Pure functions of the model config, the parallel layout and the batch geometry (no process,
no tensor); ``bench/comm_volume.py`` prints them next to what the real collectives moved.
Scope: ``pp = 1`` and ``cp = 1`` (the runtime-I layouts), fp32 activations and parameters.

Units and conventions
---------------------
Bytes are **per rank per optimiser step**, counted as the *logical payload* of each call:

* all-reduce, broadcast, send: the tensor (``N``);
* all-gather: the gathered output (``g x`` the input);
* reduce-scatter: the full input (``g x`` the output);
* all-to-all: everything this rank hands to the call (its own slice included).

(The ring-algorithm bytes that actually leave a rank are ``2(g-1)/g N`` for an all-reduce,
``(g-1)/g N`` for all-gather / reduce-scatter / broadcast, and the off-rank slices for an
all-to-all; ``comm_volume.py`` prints those as "wire".)

Geometry: ``b`` micro-batch size, ``s`` sequence length, ``m = global_batch / (b dp)``
micro-batches per rank, ``T = b s`` tokens per micro-batch, ``d`` hidden, ``L`` layers,
``t`` tp, ``f = 4`` bytes (fp32). ``N_r = T / t`` tokens routed per rank (the MoE layer splits
each sequence over tp, with or without SP), ``R = N_r K`` dispatched rows (top-``K``).

Formulas (per rank, per step)
-----------------------------
**tp** (tensor / sequence parallel), every micro-batch:

* without SP — one all-reduce of ``T d f`` at each region boundary: embedding exit,
  attention entry (backward) and exit (``linear_out_b``), shared-expert entry (backward) and
  exit, LM-head entry (backward); the routed MoE region splits tokens over tp: all-gather
  ``T d f`` on exit (forward) and on entry (backward of the split);
  ``2 + 4L`` all-reduces and ``2L`` all-gathers of ``T d f``;
* with SP — the same boundaries become all-gather (forward) / reduce-scatter (backward) pairs
  of ``T d f`` (embedding, attention exit, shared-expert entry and exit, head: ``2 + 3L``
  boundaries; the routed region is already split), plus the per-token latents gathered over the sequence inside attention:
  ``q_lora`` (query latent), ``head_dim`` (window KV), ``head_dim`` (x2 for m > 1: gate) for
  Full layers' compressor and ``H_I`` (indexer head weights), each ``T x width x f`` forward
  and again backward;
* indexer scores, all-reduced over tp: ``b s n f`` per indexer layer (``n = s/m`` entries, or
  the candidate pool for a Reindex layer searching it), and ``2 b s k f`` for the alignment
  loss (scores + attention mass on the ``k`` selected entries);
* cross-entropy: three all-reduces of ``b s f`` (max, sum-exp, target logit);
* MoE sequence balance loss: two all-reduces of ``b E f`` per layer.

once per step: the gradients of replicated parameters fed by tp-split inputs (latent
projections, router; with SP also norms, mHC, Engram) all-reduced over tp; Muon's
all-gather of tp-cut matrices (``linear_out_b``, shared expert) at full size; Sinkhorn's
column statistics of the vocabulary-parallel tables (``16 + floor(K/2) d f`` bytes in
``3 + floor(K/2)`` all-reduces per table, K = 11 Sinkhorn iterations).

**ep** (expert parallel), every micro-batch and layer: counts ``E x 8``; rows ``R d f``
dispatched and combined, forward and backward (4 all-to-all); combine weights ``R f``
forward and backward (2) -> ``4 R d f + 2 R f + 8 E``. Expected received rows equal sent rows.

**etp** (expert tensor parallel), every micro-batch and layer: the ``R`` rows of the local
experts all-gathered and the partial outputs reduce-scattered, forward and backward:
``4 etp R d f + 2 etp R f + 8 etp E/ep`` (the implementation pads every rank's rows to the
largest count, so measured >= this); once per step Muon all-gathers each local expert's
matrices at full width: ``3 (E/ep) d F f`` per layer.

**dp_cp** (data parallel): the gradient of every dense parameter held by the rank,
all-reduced in ``grad_bucket_mb`` buckets; with ZeRO-1 instead reduce-scattered to the owners
and the updated parameters all-gathered back, each bucket ``g x`` its largest owner chunk
(whole parameters, owners and chunks by ``DistributedOptimizer``'s own rule; chunk boundaries
follow this table's order, exact when a group fits one bucket); plus scalars (token count,
loss, 3 metrics). **expert_dp** and **engram_replica**: the same for expert weights and for
Engram table partitions, over the ranks holding identical copies.

**engram** (engram parallel, g ranks), once per step for all Engram layers (prefetch,
§3.1.3): ``U`` unique row ids of the step's local batch (upper bound ``U <= m x tokens x
tables x layers``, no duplicates assumed): counts ``8 g x layers``, ids ``8 U``, rows ``U w f``
before the first micro-batch and row gradients ``U w f`` after the last backward (``w`` =
Engram head dim); plus Sinkhorn column statistics of the partitioned tables ``16 + 5 w f``
per table.

**stage** (tp x cp x dp): the per-step router load counts, ``L x modalities x E x 8``.
**world**: the gradient-norm all-reduce (4 bytes).

Memory estimate per rank
------------------------
``params = grads = f x sum(local shard numel)`` with shards: tp-split tensors ``/t``, routed
experts ``/(ep etp)``, Engram tables ``/engram``; optimiser state: Muon and Sinkhorn one
momentum buffer (``1x``), AdamW two moments (``2x``) plus a 4-byte step counter per tensor;
ZeRO-1 divides each reduction group's state — and the gradients kept after the
reduce-scatter — by the group size (ideal; the implementation assigns whole parameters, so
ranks are only approximately balanced).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from megatron_s2.models.v41.layer_plan import CSA2Mode
from megatron_s2.models.v41.config import V41Config
from megatron_s2.config.optimizer import OptimizerConfig, ParamGroupRule
from megatron_s2.models.v41.accounting import count_parameters, engram_rows
from megatron_s2.optim.param_groups import match_rule
from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["Geometry", "ParamEntry", "Term", "analytic_volume", "estimate_memory", "group_sizes", "param_table"]

F32 = 4
I64 = 8


@dataclass(frozen=True)
class ParamEntry:
    """One parameter tensor of the full model and how the layout treats it."""

    name: str
    numel: int              # full (unsharded) size
    ndim: int
    shard: str | None       # "tp" | "expert" | "engram" | None (replicated)
    tp_partial: str | None  # replicated but fed tp-split inputs: "always" (tp > 1) | "sp" (with SP) | None
    optimizer: str          # "muon" | "muon_headwise" | "sinkhorn" | "adamw"
    tp_muon_gather: bool = False  # Muon all-gathers the tp-cut matrix before Newton-Schulz

    def local_numel(self, layout: ParallelLayout) -> int:
        if self.shard == "tp":
            return self.numel // layout.tp
        if self.shard == "expert":
            return self.numel // (layout.ep * layout.etp)
        if self.shard == "engram":
            return self.numel // layout.engram
        return self.numel

    def reduction(self) -> str:
        """The group its gradient is summed over across replicas (grad_finalize)."""
        return {"engram": "engram_replica", "expert": "expert_dp"}.get(self.shard, "dp_cp")

    def partial_over_tp(self, layout: ParallelLayout) -> bool:
        if layout.tp == 1:
            return False
        return self.tp_partial == "always" or (self.tp_partial == "sp" and layout.sequence_parallel)


def param_table(c: V41Config, rules: tuple[ParamGroupRule, ...] | None = None) -> list[ParamEntry]:
    """Every trainable tensor of the model (pp = 1) under its ``named_parameters()`` name, derived
    from the config and the layer plan; the update rule comes from the optimiser's rule table
    (``rules``, default table if None). The total is checked against ``accounting.count_parameters``."""
    rules = rules or OptimizerConfig().rules
    d, h, hd, q, n = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.hc_mult
    hi, ihd, E, ffn = c.index_num_heads, c.index_head_dim, c.num_routed_experts, c.moe_ffn_hidden_size
    rows: list[tuple] = [("embedding.word_embeddings.weight", c.vocab_size * d, 2, "tp", None)]
    for s in c.plan:
        i = f"layers.{s.index}"
        if s.has_engram:
            w = c.engram_head_dim
            rows += [(f"{i}.engram.q_weight", n * d, 2, None, "sp"),
                     (f"{i}.engram.k_weight", n * d, 2, None, "sp"),
                     (f"{i}.engram.table.weight", engram_rows(c, s.index) * w, 2, "engram", "sp"),
                     (f"{i}.engram.linear_kv.weight", c.engram_num_tables * w * (n + 1) * d, 2, None, "sp")]
        for hc in ("attn_hc", "mlp_hc"):
            rows += [(f"{i}.{hc}.fn", c.mhc_mix_dim * n * d, 2, None, "sp"),
                     (f"{i}.{hc}.base", c.mhc_mix_dim, 1, None, "sp"),
                     (f"{i}.{hc}.scale", 3, 1, None, "sp")]
        rows += [(f"{i}.attn_norm.weight", d, 1, None, "sp"), (f"{i}.mlp_norm.weight", d, 1, None, "sp")]
        a = f"{i}.attention"
        rows += [(f"{a}.linear_q_down.weight", d * q, 2, None, "always"),
                 (f"{a}.q_norm.weight", q, 1, None, "always"),
                 (f"{a}.linear_q_up.weight", q * h * hd, 2, "tp", None),
                 (f"{a}.linear_kv.weight", d * hd, 2, None, "always"),
                 (f"{a}.kv_norm.weight", hd, 1, None, "always"),
                 (f"{a}.linear_out_a", c.o_lora_rank * h * hd, 2, "tp", None),
                 (f"{a}.linear_out_b.weight", c.o_groups * c.o_lora_rank * d, 2, "tp", None, True)]
        if c.attn_sink:
            rows.append((f"{a}.attn_sink", h, 1, "tp", None))
        if s.mode is CSA2Mode.FULL:
            rows += [(f"{a}.compressor.linear_kv.weight", d * hd, 2, None, "always"),
                     (f"{a}.compressor.norm.weight", hd, 1, None, "always"),
                     (f"{a}.index_key.linear.weight", hd * ihd, 2, None, "always"),
                     (f"{a}.index_key.norm.weight", ihd, 1, None, "always")]
            if s.compress_ratio > 1:
                rows.append((f"{a}.compressor.linear_gate.weight", d * hd, 2, None, "always"))
        if s.runs_indexer:
            rows += [(f"{a}.indexer.linear_q.weight", q * hi * ihd, 2, "tp", None),
                     (f"{a}.indexer.linear_weights.weight", d * hi, 2, None, "always")]
        rows.append((f"{i}.mlp.router.weight", E * d, 2, None, "always"))
        rows += [(f"{i}.mlp.experts.{w}", E * ffn * d, 3, "expert", None) for w in ("w1", "w3", "w2")]
        if c.num_shared_experts:
            rows += [(f"{i}.mlp.shared_expert.{w}", c.num_shared_experts * ffn * d, 2, "tp", None, True)
                     for w in ("w1", "w3", "w2")]
    rows += [("final_norm.weight", d, 1, None, "sp"), ("output_layer.weight", c.vocab_size * d, 2, "tp", None)]
    out = []
    for name, numel, ndim, shard, partial, *gather in rows:
        index = match_rule(name, ndim, rules)
        if index is None:
            raise ValueError(f"param_table: '{name}' matches no optimiser rule")
        out.append(ParamEntry(name, numel, ndim, shard, partial, rules[index].kind, bool(gather and gather[0])))
    total, expected = sum(e.numel for e in out), count_parameters(c).total
    if total != expected:
        raise ValueError(f"param_table: {total} parameters, accounting counts {expected}; the table is out of date")
    return out


@dataclass(frozen=True)
class Geometry:
    micro_batch: int
    seq: int
    global_batch: int

    def micro_batches(self, layout: ParallelLayout) -> int:
        return self.global_batch // (self.micro_batch * layout.dp)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq


@dataclass(frozen=True)
class Term:
    group: str   # ParallelGroups field ("tp", "ep", "dp_cp", ...) or "world"
    what: str
    bytes: float
    calls: float


def group_sizes(layout: ParallelLayout) -> dict[str, int]:
    """Size of each ParallelGroups field's group (every rank has the same sizes when pp = cp = 1)."""
    return {"tp": layout.tp, "dp_cp": layout.dp * layout.cp, "ep": layout.ep, "etp": layout.etp,
            "expert_dp": layout.edp, "engram": layout.engram,
            "engram_replica": layout.dp * layout.cp // layout.engram, "stage": layout.tp * layout.cp * layout.dp,
            "world": layout.world_size}


def analytic_volume(c: V41Config, layout: ParallelLayout, geo: Geometry, *, sinkhorn_iters: int = 11,
                    grad_bucket_mb: float = 25.0, rules: tuple[ParamGroupRule, ...] | None = None) -> list[Term]:
    """Per-rank per-step payload bytes of every collective, by group (module docstring)."""
    if layout.pp > 1 or layout.cp > 1:
        raise ValueError("analytic_volume covers pp = 1 and cp = 1 layouts")
    if c.compute_dtype != "float32" or c.params_dtype != "float32":
        raise ValueError("analytic_volume assumes float32 parameters and activations")
    sizes = group_sizes(layout)
    t, sp = layout.tp, layout.sequence_parallel
    b, s, T, m = geo.micro_batch, geo.seq, geo.tokens, geo.micro_batches(layout)
    d, E, K = c.hidden_size, c.num_routed_experts, c.moe_topk
    plan, L = c.plan, c.num_layers
    terms: list[Term] = []

    def add(group: str, what: str, nbytes: float, calls: float, per_micro: bool = True) -> None:
        k = m if per_micro else 1
        terms.append(Term(group, what, nbytes * k, calls * k))

    table = param_table(c, rules)
    indexers = [spec for spec in plan if spec.runs_indexer]
    aux_indexer = bool(indexers) and c.indexer_loss_coeff > 0
    # ---- tensor / sequence parallel ------------------------------------------------------------
    if t > 1:
        act = T * d * F32
        if sp:
            boundaries = 2 + L + (2 * L if c.num_shared_experts else 0)  # embedding, head, attn exit, shared expert in/out
            add("tp", "SP boundaries: all-gather + reduce-scatter of T*d (fwd+bwd)", 2 * boundaries * act,
                2 * boundaries)
            widths = L * (c.q_lora_rank + c.head_dim)
            widths += sum(c.head_dim * (2 if spec.compress_ratio > 1 else 1) for spec in plan
                          if spec.mode is CSA2Mode.FULL)
            widths += len(indexers) * c.index_num_heads
            calls = 2 * (2 * L + sum(2 if spec.compress_ratio > 1 else 1 for spec in plan
                                     if spec.mode is CSA2Mode.FULL) + len(indexers))
            add("tp", "SP attention latents gathered over the sequence (fwd+bwd)", 2 * T * widths * F32, calls)
        else:
            boundaries = 2 + 2 * L + (2 * L if c.num_shared_experts else 0)
            add("tp", "region boundaries: all-reduce of T*d", boundaries * act, boundaries)
            add("tp", "routed MoE token split: all-gather of T*d (fwd exit, bwd entry)", 2 * L * act, 2 * L)
        for spec in indexers:
            n = s // spec.compress_ratio
            scored = c.candidate_pool_size if (spec.candidate_source is not None
                                               and not spec.is_candidate_source) else n
            add("tp", f"indexer scores (layer {spec.index})", b * s * scored * F32, 1)
            if aux_indexer:
                add("tp", f"indexer alignment loss (layer {spec.index})", 2 * b * s * min(c.index_topk, n) * F32, 2)
        add("tp", "vocab-parallel cross-entropy", 3 * b * s * F32, 3)
        if c.moe_seq_aux_loss_coeff > 0:
            add("tp", "MoE sequence balance loss", L * 2 * b * E * F32, 2 * L)
        partial = sum(e.local_numel(layout) for e in table if e.partial_over_tp(layout)) * F32
        add("tp", "gradients of tp-partial replicated params", partial,
            math.ceil(partial / (grad_bucket_mb * 2 ** 20)), per_micro=False)
        gathers = [e for e in table if e.tp_muon_gather]
        add("tp", "Muon all-gather of tp-cut matrices", sum(e.numel for e in gathers) * F32, len(gathers),
            per_micro=False)
        add("tp", "Sinkhorn statistics (embedding, head)", 2 * (16 + (sinkhorn_iters // 2) * d * F32),
            2 * (3 + sinkhorn_iters // 2), per_micro=False)
    # ---- expert parallel / expert tensor parallel ------------------------------------------------
    rows = T // t * K
    if layout.ep > 1:
        add("ep", "token counts", L * E * I64, L)
        add("ep", "dispatch + combine rows (fwd+bwd)", L * 4 * rows * d * F32, 4 * L)
        add("ep", "combine weights (fwd+bwd)", L * 2 * rows * F32, 2 * L)
    if layout.etp > 1:
        e = layout.etp
        add("etp", "token counts", L * e * (E // layout.ep) * I64, L)
        add("etp", "rows all-gather / partial-output reduce-scatter (fwd+bwd)", L * 4 * e * rows * d * F32, 4 * L)
        add("etp", "combine weights (fwd+bwd)", L * 2 * e * rows * F32, 2 * L)
        experts = [x for x in table if x.shard == "expert"]
        add("etp", "Muon all-gather of expert matrices", sum(x.numel // layout.ep for x in experts) * F32,
            len(experts), per_micro=False)
    # ---- engram parallel --------------------------------------------------------------------------
    if layout.engram > 1:
        g, w = layout.engram, c.engram_head_dim
        tokens = T // t if sp else T
        layers = len(c.engram_layers)
        ids = m * tokens * c.engram_num_tables * layers  # upper bound on the step's unique ids
        add("engram", "prefetch: counts + ids + rows of the step, U <= m*tokens*tables*layers",
            g * layers * I64 + ids * I64 + ids * w * F32, 3, per_micro=False)
        add("engram", "row gradients returned to the owners after the backward", ids * w * F32, 1, per_micro=False)
        add("engram", "Sinkhorn statistics (Engram tables)", len(c.engram_layers) * (16 + (sinkhorn_iters // 2) * w * F32),
            len(c.engram_layers) * (3 + sinkhorn_iters // 2), per_micro=False)
    # ---- replicas: gradients (+ ZeRO-1 parameter broadcast) ------------------------------------------
    by_group: dict[str, list[ParamEntry]] = defaultdict(list)
    for e in table:
        by_group[e.reduction()].append(e)
    for group, entries in sorted(by_group.items()):
        if sizes[group] < 2:
            continue
        nbytes = sum(e.local_numel(layout) for e in entries) * F32
        if layout.distributed_optimizer:
            padded, buckets = _zero1_buckets(entries, layout, sizes[group], grad_bucket_mb)
            add(group, "ZeRO-1 gradient reduce-scatter to owners", padded, buckets, per_micro=False)
            add(group, "ZeRO-1 parameter all-gather from owners", padded, buckets, per_micro=False)
        else:
            add(group, "gradient all-reduce", nbytes, math.ceil(nbytes / (grad_bucket_mb * 2 ** 20)), per_micro=False)
    if sizes["dp_cp"] > 1:
        metrics = (1 if c.moe_seq_aux_loss_coeff > 0 else 0) + (2 if aux_indexer else 0)
        add("dp_cp", "scalars: token count, loss, metrics", (2 + metrics) * F32, 2 + metrics, per_micro=False)
    if sizes["stage"] > 1:
        modalities = 2 if c.moe_modality_biases else 1
        add("stage", "router load counts", L * modalities * E * I64, 1, per_micro=False)
    if sizes["world"] > 1:
        add("world", "gradient norm", F32, 1, per_micro=False)
    return terms


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def _zero1_buckets(entries: list[ParamEntry], layout: ParallelLayout, g: int, grad_bucket_mb: float
                   ) -> tuple[float, int]:
    """(padded bytes of one pass over all buckets, number of buckets) of ZeRO-1 in a group of g."""
    from megatron_s2.optim.distributed_optimizer import assign_owners, owner_buckets

    owners = assign_owners([(e.name, _Sized(e.local_numel(layout))) for e in entries], g)
    per_owner = [[e.local_numel(layout) for e in entries if owners[e.name] == r] for r in range(g)]
    buckets = owner_buckets(per_owner, int(grad_bucket_mb * 2 ** 20) // F32)
    widths = [max(sum(per_owner[r][i] for i in idx) for r, idx in enumerate(b)) for b in buckets]
    return g * sum(widths) * F32, len(buckets)


def estimate_memory(c: V41Config, layout: ParallelLayout, rules: tuple[ParamGroupRule, ...] | None = None
                    ) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimiser state (module docstring)."""
    sizes = group_sizes(layout)
    params = grads = opt = 0.0
    for e in param_table(c, rules):
        n = e.local_numel(layout)
        params += n * F32
        state = (2 * n * F32 + F32) if e.optimizer == "adamw" else n * F32
        grad = n * F32
        if layout.distributed_optimizer:  # only owners keep state and, after the reduce-scatter, gradients
            state /= sizes[e.reduction()]
            grad /= sizes[e.reduction()]
        opt += state
        grads += grad
    return {"params": params, "grads": grads, "optimizer": opt}
