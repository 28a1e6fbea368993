"""The Intern-S2 hybrid model of one rank (the family-model contract of
:class:`megatron_s2.models.family.base.FamilyModel`): ``embed`` -> ``run_layers`` -> ``head``,
the hidden state a one-tensor tuple; vocabulary-parallel embedding and head over tp.

Precision (walkthrough Ch. 1 map): matrices stored in ``params_dtype`` and multiplied in
``compute_dtype``; norms, RoPE, the router, the delta-rule state and the LM head in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.intern_s2.config import InternS2Config
from megatron_s2.models.intern_s2.layers import PLAN, SOURCE, Block, RMSNorm
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.plan import apply_plan
from megatron_s2.parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_parallel_cross_entropy

__all__ = ["InternS2Model", "InternContext"]


@dataclass
class InternContext:
    """The forward context of one micro-batch (or one engine step)."""

    positions: torch.Tensor
    """[b, s] position of every token (RoPE, causal mask)."""
    doc_ids: torch.Tensor | None = None
    """[b, s] packed-document id: attention and the recurrent memory stay inside a document."""
    cache: object | None = None
    """The engine's per-request state of this step (:class:`~.executor.HybridCacheStep`)."""
    routing: object | None = None
    """A :class:`~megatron_s2.models.family.routing_replay.RoutingReplay` (record / replay)."""
    record: dict | None = None
    """Engine routing record: layer -> [b, s, top_k] selected experts of this step."""
    full_doc_ids: torch.Tensor | None = None
    """[b, S] document ids of the whole sequence when this rank holds context-parallel chunks."""
    aux_rows: torch.Tensor | None = None
    """[b] bool: the rows whose routing the load-balancing loss sees (post-training: rows with a
    loss-bearing label — not a filler row, :mod:`megatron_s2.posttrain.episode_rows`); None: all."""
    aux_losses: dict = field(default_factory=dict)
    aux_metrics: dict = field(default_factory=dict)

    def add_aux_loss(self, name: str, value: torch.Tensor) -> None:
        self.aux_losses[name] = self.aux_losses[name] + value if name in self.aux_losses else value

    def total_aux_loss(self) -> torch.Tensor | None:
        return sum(self.aux_losses.values()) if self.aux_losses else None


class _Recomputable:
    """A block under full activation recomputation. Its forward runs again in backward, where it
    must replay the routing of the first pass (rewind the replay to this layer's first call)
    and leave the context's auxiliary losses alone (the first pass added them; adding them
    again would double the logged values)."""

    def __init__(self, block: Block, layer: int):
        self.block, self.layer, self.calls = block, layer, 0

    def __call__(self, x: torch.Tensor, ctx: InternContext) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return self.block(x, ctx)
        if ctx.routing is not None:
            ctx.routing.rewind(self.layer)
        kept = ctx.aux_losses, ctx.aux_metrics
        ctx.aux_losses, ctx.aux_metrics = {}, {}
        try:
            return self.block(x, ctx)
        finally:
            ctx.aux_losses, ctx.aux_metrics = kept


class InternS2Model(nn.Module):
    PLAN_SECTION = "model"

    def __init__(self, config: InternS2Config, groups: ParallelGroups | None = None, *,
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
        self.timeseries = None
        if pre_process and config.timeseries is not None:  # the series lane beside the embedding (§2.2.1)
            from megatron_s2.models.timeseries.attach import build_series_encoder

            self.timeseries = build_series_encoder(config)

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers.keys()]

    def make_context(self, micro_batch: dict, *, routing=None, step_state=None, positions=None,
                     doc_ids=None) -> InternContext:
        tokens = micro_batch["tokens"]
        if positions is None:
            positions = micro_batch.get("position_ids")
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        if routing is None:
            routing = micro_batch.get("routing")  # post-training R3: the rollout's own routing
        return InternContext(positions, micro_batch.get("doc_ids") if doc_ids is None else doc_ids,
                             routing=routing, full_doc_ids=micro_batch.get("full_doc_ids"),
                             aux_rows=micro_batch.get("aux_rows"))

    def embed(self, input_ids: torch.Tensor, series=None) -> tuple[torch.Tensor]:
        """Token ids -> the residual stream; ``series``: per sequence, the series placements whose
        spans take the time-series encoder's tokens (or their ``EncodedSeries``, §2.2.1)."""
        h = self.embedding["word_embeddings"](input_ids).to(getattr(torch, self.config.compute_dtype))
        if series is not None:
            from megatron_s2.models.timeseries.attach import merge_series

            # under SP ``h`` is this tp rank's slice of the sequence: only its span rows are written
            h = merge_series(h, series, self.timeseries, self.groups.tp if self.groups.sequence.sp else None)
        return (h,)

    def embed_vectors(self, vectors: torch.Tensor) -> tuple[torch.Tensor]:
        """Vectors [b, s, d] in place of token embeddings (visual next-patch pre-training,
        walkthrough Ch. 3 Eq. 6: the projected visual latents enter the backbone here)."""
        return (vectors.to(getattr(torch, self.config.compute_dtype)),)

    def run_layers(self, hidden: tuple[torch.Tensor], ctx: InternContext, layer_ids=None) -> tuple[torch.Tensor]:
        (x,) = hidden
        for i in (self.layer_ids if layer_ids is None else layer_ids):
            block = self.layers[str(i)]
            if self.recompute == "full" and self.training and torch.is_grad_enabled():
                x = checkpoint(_Recomputable(block, i), x, ctx, use_reentrant=False)
            else:
                x = block(x, ctx)
        return (x,)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised last hidden state [b, s, d] the output layer projects (float32)."""
        return self.final_norm(x).float()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.final_hidden(x))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.groups.tp)

    def forward(self, input_ids: torch.Tensor, ctx: InternContext | None = None, labels=None,
                series=None) -> torch.Tensor:
        ctx = ctx or self.make_context({"tokens": input_ids})
        logits = self.head(*self.run_layers(self.embed(input_ids, series), ctx))
        return logits if labels is None else self.loss(logits, labels)

    def routers(self) -> list[nn.Module]:
        return [block.moe.router for block in self.layers.values()]

    # ---- the family-model hooks the trainer calls ----------------------------------------------
    def prepare_step(self, micro_batches, make_context):
        return None

    def after_optimizer_step(self, skipped: bool) -> None:
        pass  # balancing is by the auxiliary loss: no per-step router state

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode

    def set_token_map(self, token_map) -> None:
        pass

    def init_weights(self, seed: int) -> "InternS2Model":
        initialize_parameters(self, seed, self.config.init_std)
        self.apply_precision_map()
        return self

    def apply_precision_map(self) -> None:
        """Matrices in ``params_dtype``; vectors (norms, A_log, dt_bias), the router and the head
        stay float32 (walkthrough Ch. 1). The series encoder (``timeseries.``) stays float32 as a
        whole: its plain ``nn`` convolutions and linears carry biases and must see one dtype, it is
        small beside the backbone, and it casts its output to the backbone's compute dtype."""
        dtype = getattr(torch, self.config.params_dtype)
        for name, p in self.named_parameters():
            if name.startswith("timeseries."):
                continue
            if p.dim() >= 2 and not (name.startswith("output_layer") or name.endswith("router.weight")):
                p.data = p.data.to(dtype)
