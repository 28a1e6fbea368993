"""The layers of the Intern-S2 hybrid backbone, one device's code cut by the parallel plan.

Semantics are those of the Hugging Face ``qwen3_5_moe`` implementation (``Qwen3_5MoeGatedDeltaNet``,
``Qwen3_5MoeAttention``, ``Qwen3_5MoeSparseMoeBlock``, ``Qwen3_5MoeRMSNorm``), so a converted
checkpoint computes the reference's logits; the precision map is the walkthrough's (Ch. 1):
RMSNorms, RoPE, the router and the recurrent states in float32, matrix products in the
model's compute dtype.

Tensor parallelism (:data:`PLAN`): Gated DeltaNet key heads and their value-head groups, and
attention query / key-value heads, are column-split (each rank keeps whole heads, so the
delta rule and attention run locally); output projections are row-parallel; the shared expert
is split by width; routed experts go over ep (whole experts) and etp (width), the MoE layer
routing a disjoint 1/tp of the tokens on each tp rank (:class:`~megatron_s2.parallel.token_dispatch.AllToAllTokenDispatcher`).
Under sequence parallelism the residual stream is split over the sequence between the
tensor-parallel regions.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.init import constant_init, normal_init
from megatron_s2.models.intern_s2.config import InternS2Config
from megatron_s2.models.intern_s2.context_parallel import cp_attention_keys, cp_causal_conv1d, cp_gated_delta_rule
from megatron_s2.models.intern_s2.gated_delta import causal_conv1d, delta_rule
from megatron_s2.models.intern_s2.recompute import recomputed
from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron_s2.parallel.placement import Style, mark_param
from megatron_s2.parallel.plan import TP, Rule, apply_plan
from megatron_s2.parallel.token_dispatch import AllToAllTokenDispatcher

__all__ = ["PLAN", "RMSNorm", "GatedDeltaNet", "GatedAttention", "MoE", "Block"]

R, COL, ROW, SP, ALL = Style.REPLICATED, Style.COLUMN, Style.ROW, TP.UNDER_SP, TP.ALWAYS

PLAN = {
    "model": {"embedding.word_embeddings.weight": Rule(COL), "final_norm.weight": Rule(R, SP),
              "output_layer.weight": Rule(COL)},
    "block": {"input_norm.weight": Rule(R, SP), "post_mixer_norm.weight": Rule(R, SP)},
    "linear_attn": {
        "q_proj.weight": Rule(COL), "k_proj.weight": Rule(COL), "v_proj.weight": Rule(COL),
        "z_proj.weight": Rule(COL), "b_proj.weight": Rule(COL), "a_proj.weight": Rule(COL),
        "conv_q": Rule(COL), "conv_k": Rule(COL), "conv_v": Rule(COL),   # channels follow their heads
        "A_log": Rule(COL), "dt_bias": Rule(COL),                          # one per value head
        "norm.weight": Rule(R, ALL),                                       # shared by the local heads
        "out_proj.weight": Rule(ROW),
    },
    "attention": {
        "q_proj.weight": Rule(COL), "k_proj.weight": Rule(COL), "v_proj.weight": Rule(COL),
        "q_norm.weight": Rule(R, ALL), "k_norm.weight": Rule(R, ALL), "o_proj.weight": Rule(ROW),
    },
    "moe": {
        "router.weight": Rule(R, ALL),                                     # routes tp-split tokens
        "experts.w1": Rule(Style.EXPERTS), "experts.w3": Rule(Style.EXPERTS),
        "experts.w2": Rule(Style.EXPERTS, width_dim=2),
        "shared_expert.gate_proj.weight": Rule(COL), "shared_expert.up_proj.weight": Rule(COL),
        "shared_expert.down_proj.weight": Rule(ROW),
        "shared_expert_gate.weight": Rule(R, SP),                          # reads the stream
    },
}
"""Where tensor / expert parallelism is applied — the whole answer (:mod:`megatron_s2.parallel.plan`)."""

SOURCE = "megatron_s2/models/intern_s2/layers.py"


def _dtype(cfg: InternS2Config, which: str = "params_dtype") -> torch.dtype:
    return getattr(torch, getattr(cfg, which))


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``norm(x) * (1 + w)`` in float32, weight initialised to 0 (the
    reference's ``Qwen3_5MoeRMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_param(nn.Parameter(torch.zeros(dim)), (dim,), init=constant_init(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, times ``silu(z)`` (weight initialised to 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_param(nn.Parameter(torch.ones(dim)), (dim,), init=constant_init(1.0))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # recomputed in backward: keeps x and gate, not the float32 copies and products between
        return recomputed(functools.partial(_gated_rms_norm, eps=self.eps), x, gate, self.weight)


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def _column_param(shape_full: tuple[int, ...], tp, init, dtype=torch.float32) -> nn.Parameter:
    local = (shape_full[0] // tp.size, *shape_full[1:])
    return mark_param(nn.Parameter(torch.empty(local, dtype=dtype)), shape_full, [(0, tp.rank, tp.size)], init=init)


def _a_log_init(full: torch.Tensor, gen: torch.Generator) -> None:
    full.uniform_(1.0, 16.0, generator=gen).log_()  # A in [1, 16]: decays exp(-A softplus(.)) spread out


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (module docstring of :mod:`.gated_delta` for the rule).

    ``x -> q, k, v`` (linear, then causal depthwise conv + SiLU), ``beta = sigmoid(x W_b)``,
    ``g = -exp(A_log) softplus(x W_a + dt_bias)``, delta rule over value heads, gated RMSNorm
    with ``z = x W_z``, output projection. With ``ctx.cache`` set (engine) the conv and
    recurrent states come from, and go back to, the request's cache."""

    PLAN_SECTION = "linear_attn"

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups, layer: int):
        super().__init__()
        tp, sp = groups.tp, groups.sequence.sp
        d, dtype = cfg.hidden_size, _dtype(cfg)
        self.cfg, self.layer, self.seq, self.cp = cfg, layer, groups.sequence, groups.cp
        self.k_heads, self.v_heads = cfg.linear_num_key_heads // tp.size, cfg.linear_num_value_heads // tp.size
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        col = dict(tp=tp, sequence_parallel=sp, dtype=dtype, region_entry=False)
        self.q_proj = ColumnParallelLinear(d, cfg.linear_key_dim, **col)
        self.k_proj = ColumnParallelLinear(d, cfg.linear_key_dim, **col)
        self.v_proj = ColumnParallelLinear(d, cfg.linear_value_dim, **col)
        self.z_proj = ColumnParallelLinear(d, cfg.linear_value_dim, **col)
        self.b_proj = ColumnParallelLinear(d, cfg.linear_num_value_heads, **col)
        self.a_proj = ColumnParallelLinear(d, cfg.linear_num_value_heads, **col)
        taps, conv_init = cfg.linear_conv_kernel, normal_init(1.0 / math.sqrt(cfg.linear_conv_kernel))
        self.conv_q = _column_param((cfg.linear_key_dim, taps), tp, conv_init, dtype)
        self.conv_k = _column_param((cfg.linear_key_dim, taps), tp, conv_init, dtype)
        self.conv_v = _column_param((cfg.linear_value_dim, taps), tp, conv_init, dtype)
        self.A_log = _column_param((cfg.linear_num_value_heads,), tp, _a_log_init)
        self.dt_bias = _column_param((cfg.linear_num_value_heads,), tp, constant_init(1.0))
        self.norm = GatedRMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = RowParallelLinear(cfg.linear_value_dim, d, tp, sequence_parallel=sp, dtype=dtype)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = self.seq.enter_tp_region(x)                 # the whole context chunk, local heads
        b, s, _ = x.shape
        cache = ctx.cache.linear(self.layer) if ctx.cache is not None else None
        conv_state = cache.conv if cache is not None else None
        # one causal convolution over [q | k | v] channels: weights of the three parts concatenated
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        weight = torch.cat([self.conv_q, self.conv_k, self.conv_v], dim=0)
        lengths = cache.lengths if cache is not None else None
        if self.cp.active:  # this rank's two chunks; the K-1 inputs before each come from the neighbour
            mixed, new_conv = cp_causal_conv1d(mixed, weight, ctx.positions, self.cp, ctx.full_doc_ids), None
        else:
            # recomputed in backward: keeps the convolution's input, not its padded copy and pre-activation
            conv = functools.partial(causal_conv1d, state=conv_state, doc_ids=ctx.doc_ids, lengths=lengths)
            mixed, new_conv = recomputed(conv, mixed, weight)
        kd = self.k_heads * self.dk
        q = mixed[..., :kd].unflatten(-1, (self.k_heads, self.dk))
        k = mixed[..., kd:2 * kd].unflatten(-1, (self.k_heads, self.dk))
        v = mixed[..., 2 * kd:].unflatten(-1, (self.v_heads, self.dv))
        beta = torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        if cache is not None:  # a padded engine row: no write and no decay past its last token
            beta, g = beta * cache.valid.unsqueeze(-1), g * cache.valid.unsqueeze(-1)
        state = cache.recurrent if cache is not None else None
        if cache is not None and s == 1:   # decode: one step of the recurrence
            out, new_state = delta_rule(q, k, v, g, beta, initial_state=state, recurrent=True)
        elif self.cp.active:              # state passing between the ranks' chunks
            out, new_state = cp_gated_delta_rule(q, k, v, g, beta, chunk_size=self.cfg.gdn_chunk_size, cp=self.cp,
                                                 doc_ids=ctx.doc_ids, full_doc_ids=ctx.full_doc_ids), None
        else:  # training keeps only the rule's inputs: its chunk states are recomputed in backward
            out, new_state = delta_rule(q, k, v, g, beta, chunk_size=self.cfg.gdn_chunk_size, initial_state=state,
                                        doc_ids=ctx.doc_ids)
        if cache is not None:
            cache.store(new_conv, new_state)
        z = self.z_proj(x).unflatten(-1, (self.v_heads, self.dv))
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.flatten(-2))


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rotary`` channels of ``x`` [b, s, H, hd] (float32 tables)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float32, device=x.device) / rotary))
    angles = positions.float().unsqueeze(-1) * inv
    cos, sin = (t.repeat(1, 1, 2).unsqueeze(2) for t in (angles.cos(), angles.sin()))
    rot, rest = x[..., :rotary].float(), x[..., rotary:]
    half = rotary // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([(rot * cos + turned * sin).to(x.dtype), rest], dim=-1)


class GatedAttention(nn.Module):
    """GQA full attention with q/k RMSNorm per head, partial RoPE and an output gate:
    ``q_proj`` yields, per head, ``[query | gate]``; the attention output is multiplied by
    ``sigmoid(gate)`` before ``o_proj``."""

    PLAN_SECTION = "attention"

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups, layer: int):
        super().__init__()
        tp, sp = groups.tp, groups.sequence.sp
        d, hd, dtype = cfg.hidden_size, cfg.head_dim, _dtype(cfg)
        self.cfg, self.layer, self.seq, self.head_dim, self.cp = cfg, layer, groups.sequence, hd, groups.cp
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_kv_heads // tp.size
        col = dict(tp=tp, sequence_parallel=sp, dtype=dtype, region_entry=False)
        self.q_proj = ColumnParallelLinear(d, cfg.num_attention_heads * hd * 2, **col)
        self.k_proj = ColumnParallelLinear(d, cfg.num_kv_heads * hd, **col)
        self.v_proj = ColumnParallelLinear(d, cfg.num_kv_heads * hd, **col)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)
        self.k_norm = RMSNorm(hd, cfg.norm_eps)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, tp, sequence_parallel=sp, dtype=dtype)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x = self.seq.enter_tp_region(x)
        hd, cfg = self.head_dim, self.cfg
        q, gate = self.q_proj(x).unflatten(-1, (self.heads, 2 * hd)).split(hd, dim=-1)
        q = _rope(self.q_norm(q), ctx.positions, cfg.rotary_dim, cfg.rope_theta)
        k = _rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, hd))), ctx.positions, cfg.rotary_dim,
                  cfg.rope_theta)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, hd))
        group = self.heads // self.kv_heads
        if ctx.cache is not None:  # engine: earlier tokens' keys and values come from the paged cache
            k, v, key_pos, key_ok = ctx.cache.attend(self.layer, k, v)
            allowed = key_ok.unsqueeze(1) & (key_pos.unsqueeze(1) <= ctx.positions.unsqueeze(2))
        elif self.cp.active:       # every key of the sequence, masked by global positions
            k, v, allowed = cp_attention_keys(k, v, ctx.positions, self.cp, ctx.doc_ids, ctx.full_doc_ids)
        elif ctx.doc_ids is not None:
            allowed = ctx.positions.unsqueeze(1) <= ctx.positions.unsqueeze(2)     # causal [b, s, s]
            allowed = allowed & (ctx.doc_ids.unsqueeze(1) == ctx.doc_ids.unsqueeze(2))
        else:
            allowed = None  # plain causal training: the fused kernel, memory linear in the length
        qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))             # [b, H, s, hd] float32
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        out = self.attend(qh, kh, vh, allowed).transpose(1, 2) * torch.sigmoid(gate.float())
        return self.o_proj(out.flatten(-2).to(x.dtype))

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention of [b, H, s, hd] heads; ``allowed`` [b, s, t] or None
        (causal: PyTorch's fused kernel, no s x s matrix kept for backward)."""
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))


class SharedExpert(nn.Module):
    """The dense SwiGLU every token passes, tensor-parallel by width (column gate/up, row down)."""

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups):
        super().__init__()
        tp, sp, dtype = groups.tp, groups.sequence.sp, _dtype(cfg)
        f, d = cfg.shared_expert_ffn_hidden_size, cfg.hidden_size
        self.seq = groups.sequence
        col = dict(tp=tp, sequence_parallel=sp, dtype=dtype, region_entry=False)
        self.gate_proj = ColumnParallelLinear(d, f, **col)
        self.up_proj = ColumnParallelLinear(d, f, **col)
        self.down_proj = RowParallelLinear(f, d, tp, sequence_parallel=sp, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.seq.enter_tp_region(hidden)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """This rank's routed SwiGLU experts, grouped ``w1, w3: [E_local, F_local, d]``,
    ``w2: [E_local, d, F_local]`` (whole experts over ep, width over etp)."""

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups):
        super().__init__()
        ep, etp = groups.ep, groups.etp
        n, f, d = cfg.num_routed_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
        self.num_local = n // ep.size
        init, dtype = normal_init(cfg.init_std), _dtype(cfg)
        local_f = f // etp.size
        self.w1 = nn.Parameter(torch.empty(self.num_local, local_f, d, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(self.num_local, local_f, d, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(self.num_local, d, local_f, dtype=dtype))
        for p, full, width in ((self.w1, (n, f, d), 1), (self.w3, (n, f, d), 1), (self.w2, (n, d, f), 2)):
            mark_param(p, full, [(0, ep.rank, ep.size), (width, etp.rank, etp.size)], init=init)

    def forward(self, rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` [M, d] grouped by local expert (``counts`` each), ``weights`` [M] -> [M, d]."""
        active = [e for e, c in enumerate(counts) if c]
        if not active and torch.is_grad_enabled():
            active = [0]  # keeps the weights in the graph: their gradient is defined (zero)
        if not active:
            return rows.new_zeros(0, rows.size(-1))
        x = rows.to(self.w1.dtype)
        blocks, wblocks, outs = torch.split(x, counts), torch.split(weights, counts), []
        for e in active:
            h = F.silu(F.linear(blocks[e], self.w1[e])) * F.linear(blocks[e], self.w3[e])
            outs.append(F.linear(h, self.w2[e]) * wblocks[e].unsqueeze(-1).to(h.dtype))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).to(rows.dtype)


class MoE(nn.Module):
    """Softmax top-k routing (float32, renormalised over the selection), dropless dispatch over
    ep / etp, and ``sigmoid(x w_gate) * shared_expert(x)`` added. Routing replay (RL's R3,
    ``ctx.routing``) selects the recorded experts with the current router's weights. In
    training the load-balancing loss ``coef * E * sum_e f_e P_e`` (f_e: selections of expert e
    per token, P_e: its mean router probability, over the micro-batch's tokens — the
    reference's ``load_balancing_loss_func`` term) is added per layer, averaged over layers."""

    PLAN_SECTION = "moe"

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups, layer: int):
        super().__init__()
        self.cfg, self.layer, self.groups, self.seq = cfg, layer, groups, groups.sequence
        self.router = nn.Module()
        self.router.weight = mark_param(nn.Parameter(torch.empty(cfg.num_routed_experts, cfg.hidden_size)),
                                        (cfg.num_routed_experts, cfg.hidden_size), init=normal_init(cfg.init_std))
        self.dispatcher = AllToAllTokenDispatcher(cfg.num_routed_experts, groups.ep, groups.etp)
        self.experts = RoutedExperts(cfg, groups)
        if cfg.shared_expert_ffn_hidden_size:
            self.shared_expert = SharedExpert(cfg, groups)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=_dtype(cfg))
            mark_param(self.shared_expert_gate.weight, (1, cfg.hidden_size), init=normal_init(cfg.init_std))
        else:
            self.shared_expert = None
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        tp = self.groups.tp
        pad = 0
        if tp.active and not self.seq.sp and hidden.size(1) % tp.size and not self.training:
            pad = (-hidden.size(1)) % tp.size  # engine steps of one token: pad so the token split works
            hidden_in = F.pad(hidden, (0, 0, 0, pad))
        else:
            hidden_in = hidden
        tokens = self.seq.enter_routed(hidden_in)
        b, s, d = tokens.shape
        flat = tokens.reshape(b * s, d)
        probs_all = torch.softmax(F.linear(flat.float(), self.router.weight.float()), dim=-1)
        replayed = ctx.routing.stored_indices(self.layer) if ctx.routing is not None else None
        if replayed is not None:
            indices = self.seq.routed_slice(replayed).reshape(-1, self.cfg.moe_topk).to(flat.device)
        else:
            indices = probs_all.topk(self.cfg.moe_topk, dim=-1).indices
        picked = probs_all.gather(-1, indices)
        weights = picked / picked.sum(-1, keepdim=True)
        if ctx.routing is not None or ctx.record is not None:
            with torch.no_grad():  # records cover the tp group's whole chunk (layout-independent)
                ids = mappings.gather_from_group(indices.view(b, s, -1), tp, dim=1)[:, :hidden.size(1)]
            if ctx.routing is not None:
                ctx.routing.commit(self.layer, ids)
            if ctx.record is not None:
                ctx.record[self.layer] = ids
        if self.training and self.cfg.router_aux_loss_coef > 0:
            counted = None
            if getattr(ctx, "aux_rows", None) is not None:  # filler rows stay out (post-training)
                counted = ctx.aux_rows.to(flat.device, torch.bool).unsqueeze(1).expand(b, s).reshape(-1)
            ctx.add_aux_loss("moe_load_balance", self._balance_loss(probs_all, indices, counted))
        dispatched = self.dispatcher.dispatch(flat, weights.to(flat.dtype), indices)
        out = self.experts(dispatched.tokens, dispatched.probs, dispatched.tokens_per_expert)
        routed = self.dispatcher.combine(out, dispatched.state).view(b, s, d)
        routed = self.seq.leave_routed(routed)
        if pad:
            routed = routed[:, :hidden.size(1)]
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden).float())
            routed = routed + gate * self.shared_expert(hidden).float()
        return routed.to(hidden.dtype)

    def _balance_loss(self, probs: torch.Tensor, indices: torch.Tensor,
                      counted: torch.Tensor | None = None) -> torch.Tensor:
        """``coef * E * sum_e f_e P_e`` over the micro-batch's tokens (``counted`` [N] bool: only
        those — the tokens of rows that bear loss, not a filler row's); sums over the ranks that split its
        tokens (tp's routed split) have an identity backward (each rank backpropagates its own
        tokens' share; the finaliser sums the router's tp-partial gradient). Over cp each rank
        keeps its share of the loss: it is linear in ``P``, so the shares add up to the whole
        (the step's metric sum over dp x cp) with the same gradient for this rank's tokens."""
        n_exp, cfg = probs.size(-1), self.cfg
        if counted is not None:
            probs, indices = probs[counted], indices[counted]
        with torch.no_grad():
            counts = torch.bincount(indices.reshape(-1), minlength=n_exp).float()
            tokens = torch.tensor([float(probs.size(0))], device=probs.device)
            for group in (self.groups.tp, self.groups.cp):
                counts, tokens = mappings.all_reduce_sum(counts, group), mappings.all_reduce_sum(tokens, group)
        prob_sum = mappings.reduce_from_group(probs.sum(0), self.groups.tp)
        f = counts / tokens.clamp(min=1)  # selections per token (the reference sums over the k slots)
        p = prob_sum / tokens.clamp(min=1)
        return cfg.router_aux_loss_coef * n_exp * (f * p).sum() / max(len(cfg.mixers), 1)


class Block(nn.Module):
    """Pre-norm decoder layer: ``x + mixer(norm(x))``, then ``x + moe(norm(x))``."""

    PLAN_SECTION = "block"

    def __init__(self, cfg: InternS2Config, groups: ParallelGroups, layer: int):
        super().__init__()
        self.mixer_kind = cfg.mixers[layer]
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if self.mixer_kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, groups, layer)
        else:
            self.attention = GatedAttention(cfg, groups, layer)
        self.post_mixer_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(cfg, groups, layer)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        mixer = self.linear_attn if self.mixer_kind == "linear_attention" else self.attention
        x = x + mixer(self.input_norm(x), ctx)
        return x + self.moe(self.post_mixer_norm(x), ctx)
