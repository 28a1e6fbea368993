"""The dense GQA transformer (Llama semantics), written for one device and cut by its parallel plan.

Stage pieces as the family contract asks (:class:`megatron_s2.models.family.base.FamilyModel`):
``embed`` -> ``run_layers`` -> ``head``; the hidden state is a one-tensor tuple. Tensor
parallelism: query / key-value heads and the MLP width over tp (column / row linears of
:mod:`megatron_s2.parallel.linear`), vocabulary-parallel embedding and head; under sequence
parallelism the residual stream is split over the sequence between them. With
``ctx.kv_cache`` set (the engine's paged cache, :mod:`.executor`) attention reads earlier
tokens' keys and values from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_s2.models.init import constant_init, initialize_parameters
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megatron_s2.parallel.placement import mark_param
from megatron_s2.parallel.plan import TP, Rule, apply_plan
from megatron_s2.parallel.placement import Style
from megatron_s2.parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_parallel_cross_entropy
from tests.families.dense_gqa.config import DenseGQAConfig

__all__ = ["DenseGQAModel", "DenseContext", "PLAN"]

R, COL, ROW, SP = Style.REPLICATED, Style.COLUMN, Style.ROW, TP.UNDER_SP

PLAN = {
    "model": {"embedding.word_embeddings.weight": Rule(COL), "final_norm.weight": Rule(R, SP),
              "output_layer.weight": Rule(COL)},
    "block": {"attn_norm.weight": Rule(R, SP), "mlp_norm.weight": Rule(R, SP)},
    "attention": {"q.weight": Rule(COL, head_rows="head_dim"), "k.weight": Rule(COL, head_rows="head_dim"),
                  "v.weight": Rule(COL), "o.weight": Rule(ROW)},
    "mlp": {"gate.weight": Rule(COL), "up.weight": Rule(COL), "down.weight": Rule(ROW)},
}
"""Where tensor parallelism is applied — the whole answer (see :mod:`megatron_s2.parallel.plan`)."""

SOURCE = "tests/families/dense_gqa/model.py"


@dataclass
class DenseContext:
    """The forward context of one micro-batch (or one engine step)."""

    positions: torch.Tensor
    """[b, s] position of every token."""
    doc_ids: torch.Tensor | None = None
    """[b, s] packed-document id of every token: attention stays inside a document."""
    kv_cache: object | None = None
    """The engine's cache view for incremental decode (:class:`~.executor.PagedKVStep`)."""
    routing: object | None = None
    aux_losses: dict = field(default_factory=dict)
    aux_metrics: dict = field(default_factory=dict)

    def total_aux_loss(self):
        return None  # a dense model has no auxiliary losses


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_param(nn.Parameter(torch.ones(dim)), (dim,), init=constant_init(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the norm runs in float32 whatever the activation dtype (as Llama)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[b, s, 1, head_dim]`` of the rotate-half convention at ``positions`` ``[b, s]``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([angles, angles], dim=-1).unsqueeze(2)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    PLAN_SECTION = "attention"

    def __init__(self, cfg: DenseGQAConfig, groups: ParallelGroups, layer: int):
        super().__init__()
        tp, sp = groups.tp, groups.sequence.sp
        d, hd = cfg.hidden_size, cfg.head_dim
        self.layer, self.cfg, self.head_dim = layer, cfg, hd
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_kv_heads // tp.size
        self.q = ColumnParallelLinear(d, cfg.num_attention_heads * hd, tp, sequence_parallel=sp)
        self.k = ColumnParallelLinear(d, cfg.num_kv_heads * hd, tp, sequence_parallel=sp)
        self.v = ColumnParallelLinear(d, cfg.num_kv_heads * hd, tp, sequence_parallel=sp)
        self.o = RowParallelLinear(cfg.num_attention_heads * hd, d, tp, sequence_parallel=sp)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
        hd = self.head_dim
        q = self.q(x).unflatten(-1, (self.heads, hd))       # [b, s, H, hd]: the tensor-parallel region
        k = self.k(x).unflatten(-1, (self.kv_heads, hd))
        v = self.v(x).unflatten(-1, (self.kv_heads, hd))
        cos, sin = rope_tables(hd, self.cfg.rope_theta, ctx.positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.kv_cache is not None:  # incremental decode: earlier tokens' keys come from the cache
            k, v, key_pos, key_ok = ctx.kv_cache.attend(self.layer, k, v)
            allowed = key_ok.unsqueeze(1) & (key_pos.unsqueeze(1) <= ctx.positions.unsqueeze(2))
        else:
            allowed = ctx.positions.unsqueeze(1) <= ctx.positions.unsqueeze(2)      # causal, [b, s, s]
            if ctx.doc_ids is not None:
                allowed = allowed & (ctx.doc_ids.unsqueeze(1) == ctx.doc_ids.unsqueeze(2))
        group = self.heads // self.kv_heads  # query heads per key/value head (GQA)
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * hd ** -0.5
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # float32 softmax
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(x.dtype)
        return self.o(out.flatten(-2))


class MLP(nn.Module):
    PLAN_SECTION = "mlp"

    def __init__(self, cfg: DenseGQAConfig, groups: ParallelGroups):
        super().__init__()
        tp, sp = groups.tp, groups.sequence.sp
        self.gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp, sequence_parallel=sp)
        self.up = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp, sequence_parallel=sp)
        self.down = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp, sequence_parallel=sp)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    PLAN_SECTION = "block"

    def __init__(self, cfg: DenseGQAConfig, groups: ParallelGroups, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, groups, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg, groups)
        apply_plan(PLAN, self, groups, cfg, source=SOURCE)

    def forward(self, x: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))


class DenseGQAModel(nn.Module):
    PLAN_SECTION = "model"

    def __init__(self, config: DenseGQAConfig, groups: ParallelGroups | None = None, *,
                 layers: Iterable[int] | None = None, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.config, self.groups = config, groups or ParallelGroups.single()
        g, d, sp = self.groups, config.hidden_size, self.groups.sequence.sp
        self.pre_process, self.post_process, self.recompute = pre_process, post_process, "none"
        if pre_process:
            self.embedding = nn.ModuleDict(
                {"word_embeddings": VocabParallelEmbedding(config.vocab_size, d, g.tp, sequence_parallel=sp)})
        ids = range(config.num_layers) if layers is None else list(layers)
        self.layers = nn.ModuleDict({str(i): Block(config, g, i) for i in ids})
        if post_process:
            self.final_norm = RMSNorm(d, config.norm_eps)
            self.output_layer = VocabParallelHead(config.vocab_size, d, g.tp, sequence_parallel=sp)
        apply_plan(PLAN, self, g, config, source=SOURCE)

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers.keys()]

    def make_context(self, micro_batch: dict, *, routing=None, step_state=None) -> DenseContext:
        tokens = micro_batch["tokens"]
        positions = micro_batch.get("position_ids")
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        return DenseContext(positions, micro_batch.get("doc_ids"), routing=routing)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.embedding["word_embeddings"](input_ids).to(getattr(torch, self.config.compute_dtype)),)

    def run_layers(self, hidden: tuple[torch.Tensor], ctx: DenseContext, layer_ids=None) -> tuple[torch.Tensor]:
        (x,) = hidden
        for i in (self.layer_ids if layer_ids is None else layer_ids):
            block = self.layers[str(i)]
            if self.recompute == "full" and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, ctx, use_reentrant=False)
            else:
                x = block(x, ctx)
        return (x,)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.final_norm(x))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.groups.tp)

    def forward(self, input_ids: torch.Tensor, ctx: DenseContext | None = None, labels=None) -> torch.Tensor:
        ctx = ctx or self.make_context({"tokens": input_ids})
        logits = self.head(*self.run_layers(self.embed(input_ids), ctx))
        return logits if labels is None else self.loss(logits, labels)

    # ---- the family-model hooks the trainer calls ----------------------------------------------
    def prepare_step(self, micro_batches, make_context):
        return None  # nothing is done once per step for all micro-batches

    def after_optimizer_step(self, skipped: bool) -> None:
        pass  # no per-step statistics (no MoE biases)

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode

    def set_token_map(self, token_map) -> None:
        pass  # the weights do not depend on the tokenizer beyond its ids

    def init_weights(self, seed: int) -> "DenseGQAModel":
        initialize_parameters(self, seed, self.config.init_std)
        self.apply_precision_map()
        return self

    def apply_precision_map(self) -> None:
        dtype = getattr(torch, self.config.params_dtype)
        for name, p in self.named_parameters():  # norms and the head stay float32 (precision map)
            if p.dim() >= 2 and not name.startswith("output_layer"):
                p.data = p.data.to(dtype)
