"""The V4.1-Flash-style backbone (report §2): embedding -> n-stream mHC blocks -> head.

The model holds any contiguous or interleaved subset of the layers, so a pipeline stage is
the same class with ``layers=`` and ``pre_process`` / ``post_process`` flags (megatron-core
convention). Layers are stored under their *global* index (``layers.<i>``), so parameter
names — and therefore initialisation and checkpoints — do not depend on the parallel
layout. The forward pass of one stage is ``embed`` (first stage) -> ``run_layers`` ->
``head`` (last stage); ``forward`` chains them for the single-stage case.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.mhc import collapse, expand_embedding, one_hot_pre
from megatron_s2.models.v41.precision import set_gemm_dtype
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.parallel_plan import SELECTIVE_RECOMPUTE, apply_plan
from megatron_s2.models.v41.recompute import run_block_recomputed
from megatron_s2.models.v41.spec import LocalProvider, block_spec, build_module, get_provider
from megatron_s2.parallel import mappings
from megatron_s2.parallel.context_parallel import local_chunk_positions, rows_after_chunks, window_keys_with_halo
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_parallel_cross_entropy

__all__ = ["V41Model", "build_model"]


class V41Model(nn.Module):
    PLAN_SECTION = "model"

    def __init__(self, config: V41Config, groups: ParallelGroups | None = None, *,
                 layers: Iterable[int] | None = None, pre_process: bool = True, post_process: bool = True,
                 provider: LocalProvider | None = None):
        super().__init__()
        self.config = config
        self.groups = groups = groups or ParallelGroups.single()
        self.plan = config.plan
        self.pre_process, self.post_process = pre_process, post_process
        self.recompute = "none"  # none | full | selective (set by the builder from parallel.recompute)
        sp = groups.sequence.sp
        d = config.hidden_size
        if pre_process:
            self.embedding = nn.ModuleDict(
                {"word_embeddings": VocabParallelEmbedding(config.vocab_size, d, groups.tp, sequence_parallel=sp)})
        spec = block_spec(provider or get_provider(config.transformer_impl, config.fp8))
        ids = range(config.num_layers) if layers is None else list(layers)
        self.layers = nn.ModuleDict({str(i): build_module(spec, config, self.plan[i], groups) for i in ids})
        if post_process:
            self.final_norm = RMSNorm(d, config.norm_eps)
            self.output_layer = VocabParallelHead(config.vocab_size, d, groups.tp, sequence_parallel=sp)
        self.dspark = None
        self.capture_dspark = False
        """Record the drafter's target layers in every training forward (set by phases that
        train the drafter: the DSpark stage and co-training)."""
        if post_process and config.dspark_layers:  # the drafter lives with the head (§2.4.3)
            from megatron_s2.models.v41.dspark.drafter import DSparkDrafter

            # its draft blocks are short [N, K] batches, never sequence-sharded: no sequence or context
            # parallelism inside (under cp each rank drafts from its own chunks' anchors)
            self.dspark = DSparkDrafter(config, dataclasses.replace(groups, sequence_parallel=False, cp=Group.single()),
                                        provider or get_provider(config.transformer_impl, config.fp8))
        self._dspark_embedding: list[VocabParallelEmbedding] = []
        """Under pipeline parallelism the last stage holds the drafter but not the embedding: a frozen
        replica of this tp rank's embedding shard, filled from the first stage by
        :meth:`sync_dspark_embedding` (after a load and after every optimiser step). Kept in a list
        so it is no module of the model: no parameter, no checkpoint entry, no optimiser state; built
        on the first sync, where the model has its storage (it is constructed on the meta device)."""
        self.vision = None
        if pre_process and config.vision_n_layers:  # beside the embedding, outside the layers (§2.1.1, §3.1.1)
            from megatron_s2.models.v41.vision.tower import VisionEncoder

            self.vision = VisionEncoder(config, groups)
        apply_plan(self, groups, config)
        set_gemm_dtype(self, getattr(torch, config.compute_dtype))  # precision map (models/v41/precision.py)
        self.timeseries = None
        if pre_process and config.timeseries is not None:  # the series lane beside the embedding (Intern-S2 §2.2.1)
            from megatron_s2.models.timeseries.attach import build_series_encoder

            self.timeseries = build_series_encoder(config)

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers.keys()]

    # ---- stage pieces --------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, images=None, series=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids -> (streams [b, s, n, d], initial one-hot input mix [b, s, n]).

        ``images``: per sequence, the :class:`~megatron_s2.models.v41.vision.processor.ImageInput`
        list whose spans take the vision encoder's embeddings (§2.1.1); under context parallelism a
        :class:`~megatron_s2.parallel.image_sharding.ShardedImages` (each rank encodes its own images);
        in a training step the :class:`~.vision.phase.EncodedImages` of :meth:`encode_images`.
        ``series``: per sequence, the series placements whose spans take the time-series encoder's
        tokens (or their :class:`~megatron_s2.models.timeseries.attach.EncodedSeries`)."""
        h = self.embedding["word_embeddings"](input_ids).to(getattr(torch, self.config.compute_dtype))
        if images is not None:
            if self.vision is None:
                raise ValueError("images given, but this model has no vision tower (model.vision_n_layers: 0)")
            from megatron_s2.models.v41.vision.phase import merge_images

            tp = self.groups.tp
            # under SP ``h`` is this tp rank's contiguous slice of the (CP-local) sequence: only the
            # span rows that land there are written (the encoder's gradients are tp-partial then)
            sp_slice = (tp.rank, tp.size) if self.groups.sequence.sp and tp.size > 1 else None
            h = merge_images(h, images, self.vision, sp_slice=sp_slice)
        if series is not None:
            from megatron_s2.models.timeseries.attach import merge_series

            h = merge_series(h, series, self.timeseries, self.groups.tp if self.groups.sequence.sp else None)
        x = expand_embedding(h, self.config.hc_mult)
        return x, one_hot_pre(x)

    def encode_images(self, images):
        """Phase 1 of the disaggregated encoder step (§3.1.1, :mod:`.vision.phase`): one
        micro-batch's images -> :class:`~megatron_s2.models.v41.vision.phase.EncodedImages` for
        ``embed`` (call its ``backward()`` after the LLM backward); None without images or without
        the encoder on this rank (a later pipeline stage)."""
        if images is None or self.vision is None:
            return None
        from megatron_s2.models.v41.vision.phase import encode_images

        return encode_images(images, self.vision, getattr(torch, self.config.compute_dtype))

    def run_layers(self, hidden: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                   layer_ids: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, input mix) through this rank's layers ``layer_ids`` (default: all it holds)."""
        x, pre = hidden
        for i in (self.layer_ids if layer_ids is None else layer_ids):
            block = self.layers[str(i)]
            if self.recompute == "full" and self.training and torch.is_grad_enabled():
                x, pre = run_block_recomputed(block, x, pre, ctx)
            else:
                x, pre = block(x, pre, ctx)
            if ctx.capture is not None and i in ctx.capture:
                ctx.capture[i] = x.mean(dim=2)  # DSpark's main input: the streams' mean (§2.4.3)
        return x, pre

    def set_token_map(self, token_map: list[int] | None) -> None:
        """Give every Engram module the tokenizer's compressed-token map (§2.4.2); None = identity."""
        for module in self.modules():
            if hasattr(module, "set_compressed_token_map"):
                module.set_compressed_token_map(token_map)

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation: none, full (whole blocks, shared-state aware) or selective
        (the regions of the parallel plan's ``SELECTIVE_RECOMPUTE``: attention core, routed experts)."""
        self.recompute = mode
        for block in self.layers.values():
            for path in SELECTIVE_RECOMPUTE:
                block.get_submodule(path).selective_recompute = mode == "selective"

    def final_hidden(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Streams -> the normalised last hidden state [b, s, d] the output layer projects."""
        return self.final_norm(collapse(x, pre))

    def head(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Streams -> this rank's vocabulary shard of the logits (float32)."""
        return self.output_layer(self.final_hidden(x, pre))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [b, s] (vocabulary-parallel)."""
        return vocab_parallel_cross_entropy(logits, labels, self.groups.tp)

    # ---- the DSpark drafter (§2.4.3) ---------------------------------------------------------
    def dspark_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The backbone's embedding for the drafter, its weight detached: the drafter objective
        never trains the backbone (§2.4.3)."""
        if not self.pre_process:  # a later pipeline stage: the first stage's embedding, replicated
            if not self._dspark_embedding:
                raise RuntimeError("DSpark: this pipeline stage has no replica of the embedding yet; the "
                                   "pipeline runtime's refresh() fills it from the first stage")
            return self._dspark_embedding[0](ids)
        emb = self.embedding["word_embeddings"]
        if emb.seq.sp:  # draft blocks are not sequence-sharded: the lookup's tp sum, not its reduce-scatter
            local = ids - emb.start
            outside = (local < 0) | (local >= emb.part)
            y = F.embedding(local.masked_fill(outside, 0), emb.weight.detach())
            return mappings.reduce_from_group(y.masked_fill(outside.unsqueeze(-1), 0.0), self.groups.tp)
        return torch.func.functional_call(emb, {"weight": emb.weight.detach()}, (ids,))

    @torch.no_grad()
    def sync_dspark_embedding(self, pp, first_pp: int, last_pp: int) -> None:
        """Copy this tp rank's embedding shard from the first pipeline stage (``first_pp``) to the
        drafter's replica on the last (``last_pp``); other stages take no part. ``pp``: this rank's
        pipeline group."""
        import torch.distributed as dist

        if pp.rank == first_pp:
            w = self.embedding["word_embeddings"].weight.detach()
            dist.send(w.float().contiguous(), dst=pp.ranks[last_pp])
        elif pp.rank == last_pp and self.dspark is not None:
            if not self._dspark_embedding:
                with torch.device(self.output_layer.weight.device):
                    built = VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size, self.groups.tp)
                self._dspark_embedding.append(built.requires_grad_(False))
            replica = self._dspark_embedding[0].weight
            buf = torch.empty(replica.shape, dtype=torch.float32, device=replica.device)
            dist.recv(buf, src=pp.ranks[first_pp])
            replica.copy_(buf)

    def dspark_head(self, h: torch.Tensor) -> torch.Tensor:
        """The backbone's head for the drafter (weight detached) -> full-vocabulary float32 logits."""
        tp = self.groups.tp  # the head's tp entry without its sequence gather (draft blocks are whole)
        logits = F.linear(mappings.copy_to_group(h, tp).float(), self.output_layer.weight.detach().float())
        return mappings.gather_from_group(logits, tp, dim=-1)

    def dspark_targets(self, ctx: ForwardContext) -> torch.Tensor:
        """The drafter's main input recorded by the forward: the target layers' outputs
        concatenated [b, s, d * targets], detached (the backbone is never trained through it)."""
        missing = [i for i in self.config.dspark_target_layer_ids if ctx.capture is None or ctx.capture.get(i) is None]
        if missing:
            raise RuntimeError(f"DSpark: the forward did not record target layer(s) {missing}; build the context "
                               "with capture_dspark=True")
        targets = torch.cat([ctx.capture[i] for i in self.config.dspark_target_layer_ids], dim=-1).detach()
        if self.groups.sequence.sp and self.groups.tp.active:  # each tp rank recorded its slice of the sequence
            targets = mappings.gather_sequence(targets, self.groups.tp, dim=1)
        return targets

    def dspark_teacher_forced(self, logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx: ForwardContext):
        """Everything the drafter's objective needs from one micro-batch whose forward recorded the
        target layers: (:class:`~megatron_s2.models.v41.dspark.drafter.TeacherForced`, the
        backbone's detached full-vocabulary logits at each draft position's target row [B, A, K, V]).
        Under context parallelism only the anchors of this rank's chunks
        (:meth:`_dspark_context_parallel`)."""
        if self.dspark is None:
            raise RuntimeError("this model has no DSpark drafter (model.dspark_layers: 0)")
        full = mappings.gather_from_group(logits.detach().float(), self.groups.tp, dim=-1)
        if self.groups.cp.active:
            return self._dspark_context_parallel(full, mb, ctx)
        tf = self.dspark.teacher_forced(mb["tokens"], self.dspark_targets(ctx), ctx.positions, ctx.doc_ids,
                                        self.dspark_embed, self.dspark_head, aux_rows=ctx.aux_rows)
        return tf, full[:, tf.target_rows]

    def _dspark_context_parallel(self, full_logits: torch.Tensor, mb: dict[str, torch.Tensor], ctx: ForwardContext):
        """The teacher-forced view of the anchors in this CP rank's two chunks: the drafter reads
        the whole sequence's ids / positions / documents (carried by the micro-batch), the target
        layers' rows of its chunks plus the window before each (the attention's halo), and the
        backbone's distributions at its rows plus the ``K`` rows after each chunk."""
        cp, seq = self.groups.cp, mb["full_seq"]
        mine = local_chunk_positions(seq, cp, full_logits.device)
        targets, main_rows = window_keys_with_halo(self.dspark_targets(ctx), mine.unsqueeze(0), self.dspark.window, cp)
        tf = self.dspark.teacher_forced(mb["full_tokens"], targets, mb["full_position_ids"], mb.get("full_doc_ids"),
                                        self.dspark_embed, self.dspark_head, anchors=mine[mine < seq - 1],
                                        main_rows=main_rows[0], aux_rows=ctx.aux_rows)
        rows, held = rows_after_chunks(full_logits, self.dspark.block_size, cp)
        slot_of = torch.zeros(seq, dtype=torch.long, device=held.device)
        inside = held < seq  # the last chunk's "next chunk" lies past the sequence end
        slot_of[held[inside]] = torch.arange(held.numel(), device=held.device)[inside]
        return tf, rows[:, slot_of[tf.target_rows]]

    # ---- single-stage convenience -----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None,
                labels: torch.Tensor | None = None, images=None, series=None) -> torch.Tensor:
        """Logits shard [b, s, V/tp], or the per-token loss [b, s] when ``labels`` is given
        (``images``, ``series``: as :meth:`embed`)."""
        if ctx is None:
            ctx = ForwardContext.create(input_ids, self.plan)
        logits = self.head(*self.run_layers(self.embed(input_ids, images, series), ctx))
        return logits if labels is None else self.loss(logits, labels)

    # ---- training hooks ---------------------------------------------------------------------
    def make_context(self, micro_batch: dict[str, torch.Tensor], *, routing=None, step_state=None) -> ForwardContext:
        """The forward context of one micro-batch: positions, packed-document ids, image mask,
        routing replay (R3: the batch's own ``routing`` entry unless given), the step's Engram
        rows and, under context parallelism, the whole sequence's ``full_*`` views."""
        mb = micro_batch
        if routing is None:
            routing = mb.get("routing")  # per-micro-batch replay (post-training R3)
        ctx = ForwardContext.create(mb["tokens"], self.plan, positions=mb.get("position_ids"),
                                    doc_ids=mb.get("doc_ids"), image_mask=mb.get("image_mask"), routing=routing)
        ctx.engram_rows = step_state
        ctx.swa_from = mb.get("swa_from")
        ctx.aux_rows = mb.get("aux_rows")  # post-training: filler rows stay out of the balance losses
        if self.dspark is not None and self.capture_dspark:  # the drafter's objective reads them
            ctx.capture = {i: None for i in self.config.dspark_target_layer_ids}
        if "full_tokens" in mb:  # context-parallel chunk of a longer sequence
            ctx.full_input_ids = mb["full_tokens"]
            ctx.full_doc_ids = mb.get("full_doc_ids")
            ctx.full_image_mask = mb.get("full_image_mask")
        return ctx

    def prepare_step(self, micro_batches: list[dict], make_context):
        """Engram rows of every Engram layer on this rank for the step's whole local batch
        (§3.1.3: one exchange per step); None without Engram layers here."""
        from megatron_s2.models.v41.engram import EngramPrefetch

        return EngramPrefetch.for_step(self, micro_batches, make_context)

    def routers(self) -> list:
        from megatron_s2.models.v41.moe.router import TopKRouter

        return [m for m in self.modules() if isinstance(m, TopKRouter)]

    def after_optimizer_step(self, skipped: bool) -> None:
        """Aux-loss-free balancing: one correction-bias update per optimiser step (§2.1.1), text
        and image biases from their own loads, one collective for all routers; a skipped step
        (non-finite loss) drops its loads so that they cannot move the biases."""
        # a frozen router (phase.freeze, e.g. the backbone in the DSpark stage) keeps its biases
        frozen = [r for r in self.routers() if not r.weight.requires_grad]
        for router in frozen if not skipped else self.routers():
            router.tokens_per_expert.zero_()
        if skipped:
            return
        from megatron_s2.models.v41.moe import update_expert_biases

        by_shape: dict[tuple, list] = {}  # the drafter's routers have their own expert count: one collective each
        for r in self.routers():
            if r.weight.requires_grad:
                by_shape.setdefault(tuple(r.tokens_per_expert.shape), []).append(r)
        for routers in by_shape.values():
            update_expert_biases(routers, self.config.moe_bias_update_rate)

    def init_weights(self, seed: int) -> "V41Model":
        initialize_parameters(self, seed, self.config.init_std)
        self.apply_precision_map()
        return self

    # Parameters that stay float32 whatever params_dtype says (precision map: router, LM head,
    # mHC coefficients, norms, sinks and other vectors).
    FP32_PARAMS = ("*.router.weight", "output_layer.weight", "*_hc.*", "*norm*", "*attn_sink",
                   # the drafter's hc_head, Markov output and confidence head (float32 in the reference)
                   "dspark.head_hc_*", "dspark.markov_w2", "dspark.confidence",
                   # the series encoder as a whole: its nn convolutions / linears carry biases and must
                   # see one dtype; small beside the backbone, it casts its output to the compute dtype
                   "timeseries.*")

    def apply_precision_map(self) -> None:
        """Store matrices in ``params_dtype`` except the float32 islands (the precision map and
        the master-weight decision: :mod:`megatron_s2.models.v41.precision`)."""
        from fnmatch import fnmatch

        dtype = getattr(torch, self.config.params_dtype)
        if dtype == torch.float32:
            return
        for name, p in self.named_parameters():
            if p.dim() >= 2 and not any(fnmatch(name, pat) for pat in self.FP32_PARAMS):
                p.data = p.data.to(dtype)


def build_model(config: V41Config, groups: ParallelGroups | None = None, *, seed: int = 0, **kwargs) -> V41Model:
    return V41Model(config, groups, **kwargs).init_weights(seed)
