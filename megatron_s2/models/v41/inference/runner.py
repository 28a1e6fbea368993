"""One incremental forward of the training model over a batch of request chunks.

The runner builds a :class:`ForwardContext` with positions, Engram's n-gram history
(``prefix_ids``) and the cache view (``kv_cache``), and runs the model's own stage pieces:
``embed`` -> ``run_layers`` -> ``head``. Nothing of the layer math lives here.

**Decoder SWA Bounded Replay** (report §3.2.2, CED §2.2): when a row's ``decoder_from`` lies
inside its chunk, the encoder runs over the whole chunk, every decoder Full layer projects its
global KV from the encoder output H_{L/2} of every token of the chunk (the first decoder block's
normalised attention input, :meth:`V41Block.attention_input`, through the compressor's own input
method :meth:`CSA2Attention.compressor_input`), and the decoder layers run only over
the tokens at or after ``decoder_from`` — their SWA KV truncated to start there. Rows whose
chunk lies entirely before ``decoder_from`` skip the decoder.

**Images** (report §2.1.1): a row's image positions (:attr:`ForwardRow.images`, the span rows
the executor computed once per image) replace the placeholder ids' word embeddings on every
stream, exactly as ``V41Model.embed(ids, images=...)`` merges them in the whole-sequence
forward; the chunk's image mask reaches the MoE routers (the image correction bias) and Engram
(no n-gram through an image token, the history included), as the training context's does.

Tensor parallelism: rows are padded to a multiple of tp tokens (the routed experts split each
sequence over tp), and the vocabulary-parallel logits are gathered for sampling. Sequence and
context parallelism are not used for inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_s2.models.v41.layer_plan import SharedStateKind as K
from megatron_s2.models.v41.inference.kv_step import KVCacheStep
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.family.engine import RowOutput
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay
from megatron_s2.models.v41.shared_state import SharedStateRegistry
from megatron_s2.parallel import mappings

__all__ = ["ForwardRow", "RowOutput", "ModelRunner"]


@dataclass
class ForwardRow:
    """One request's chunk in a forward."""

    seq: SequenceKV
    tokens: list[int]
    """The new tokens (>= 1)."""
    start: int
    """Position of ``tokens[0]``."""
    history: list[int]
    """Tokens before ``start`` (at least the last max_ngram - 1 of them, or all)."""
    logits: str = "last"
    """Logits to return: "last" (of the chunk's last token), "all" or "none". With decoder
    bounded replay, "all" covers only the tokens the decoder ran on (from ``decoder_from``)."""
    decoder_from: int = 0
    """Decoder layers run only on positions >= this (decoder bounded replay)."""
    images: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(offset in ``tokens``, input embeddings [n, hidden]) of each run of image positions in the
    chunk; ``history`` carries -1 at image positions (dead for Engram's n-grams)."""
    hidden: bool = False
    """Also return the normalised last hidden state of the logits rows (``RowOutput.hidden``)."""
    series: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(offset in ``tokens``, the time-series encoder's tokens [n, hidden]) of each run of series
    positions in the chunk (Intern-S2 §2.2.1): they replace the placeholders' word embeddings as
    ``V41Model.embed(ids, series=)`` does; no mask, no Engram change (as in that forward)."""

    def engram_tokens(self) -> list[int]:
        """``tokens`` with -1 at image positions (Engram's history convention)."""
        if not self.images:
            return self.tokens
        out = list(self.tokens)
        for offset, rows in self.images:
            out[offset:offset + rows.size(0)] = [-1] * rows.size(0)
        return out


class _RecordingRegistry(SharedStateRegistry):
    """A shared-state registry that also keeps every published top-k selection."""

    def __init__(self, plan):
        super().__init__(plan)
        self.topk: dict[int, torch.Tensor] = {}

    def publish(self, producer, kind, value):
        if kind is K.TOPK:
            self.topk[producer] = value
        super().publish(producer, kind, value)


class ModelRunner:
    def __init__(self, model, global_kv: GlobalKVStore, swa: SWAStore):
        self.model, self.global_kv, self.swa = model, global_kv, swa
        cfg = model.config
        self.config, self.plan = cfg, cfg.plan
        self.tp = model.groups.tp
        self.history = max(cfg.engram_max_ngram - 1, 0) if cfg.engram_layers else 0
        self.encoder_ids = [i for i in model.layer_ids if i < cfg.num_encoder_layers]
        self.decoder_ids = [i for i in model.layer_ids if i >= cfg.num_encoder_layers]
        self.device = next(model.parameters()).device

    # ---- public -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, rows: list[ForwardRow], *, record_routing: bool = False,
                record_topk: bool = False, capture: tuple[int, ...] = ()) -> list[RowOutput]:
        """``capture``: layers whose outputs (stream mean, [B, S, d]) the forward records in
        :attr:`captured` (the DSpark drafter's main input)."""
        for row in rows:
            self._ensure_pages(row.seq, row.start + len(row.tokens))
        ids, pos, valid, prefix, image_mask = self._batch(rows, [0] * len(rows))
        ctx = self._context(rows, ids, pos, valid, prefix, image_mask, record_routing, record_topk)
        ctx.capture = {i: None for i in capture} if capture else None
        self.captured = ctx.capture
        hidden = self._embed(rows, ids)
        split = [max(0, min(len(r.tokens), r.decoder_from - r.start)) for r in rows]
        if not any(split) or not self.decoder_ids:
            x, pre = self.model.run_layers(hidden, ctx)
            views = [(ctx, list(range(len(rows))), [0] * len(rows), x, pre)]
        else:
            views = self._bounded_decoder(rows, ctx, *hidden, split, record_routing, record_topk)
        return self._outputs(rows, views, record_routing, record_topk)

    def _embed(self, rows: list[ForwardRow], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's embedding of ``ids``, image and series positions overwritten on every stream."""
        x, pre = self.model.embed(ids)
        for r, row in enumerate(rows):
            for offset, emb in row.images:
                # the streams start as copies of the token embedding (expand_embedding): same here
                x[r, offset:offset + emb.size(0)] = emb.to(x.dtype).unsqueeze(-2)
            for offset, emb in row.series:  # likewise: merged before the streams are expanded
                x[r, offset:offset + emb.size(0)] = emb.to(x.dtype).unsqueeze(-2)
        return x, pre

    # ---- batch construction -----------------------------------------------------------------------
    def _ensure_pages(self, seq: SequenceKV, end: int) -> None:
        need = -(-end // self.global_kv.page_tokens)
        while len(seq.pages) < need:
            seq.pages.append(self.global_kv.pool.allocate())

    def _batch(self, rows: list[ForwardRow], offsets: list[int]):
        """ids / positions / valid / image mask ``[B, S]`` (the mask None without images) and
        Engram history ``[B, h]`` of the rows' tokens from ``offsets[r]`` on (S padded to a
        multiple of tp)."""
        lengths = [len(r.tokens) - o for r, o in zip(rows, offsets)]
        s = max(lengths)
        s += -s % self.tp.size
        dev = self.device
        ids = torch.tensor([r.tokens[o:] + [0] * (s - n) for r, o, n in zip(rows, offsets, lengths)],
                           dtype=torch.long, device=dev)
        start = torch.tensor([r.start + o for r, o in zip(rows, offsets)], dtype=torch.long, device=dev)
        pos = start.unsqueeze(1) + torch.arange(s, device=dev)
        valid = torch.arange(s, device=dev).unsqueeze(0) < torch.tensor(lengths, device=dev).unsqueeze(1)
        prefix = None
        if self.history:
            h = self.history
            before = [(r.history + r.engram_tokens()[:o])[-h:] for r, o in zip(rows, offsets)]
            prefix = torch.tensor([[-1] * (h - len(x)) + x for x in before], dtype=torch.long, device=dev)
        image_mask = None
        if any(r.images for r in rows):
            image_mask = torch.zeros(ids.shape, dtype=torch.bool, device=dev)
            for b, (r, o) in enumerate(zip(rows, offsets)):
                for offset, emb in r.images:
                    image_mask[b, max(0, offset - o):max(0, offset + emb.size(0) - o)] = True
        return ids, pos, valid, prefix, image_mask

    def _context(self, rows, ids, pos, valid, prefix, image_mask, record_routing, record_topk) -> ForwardContext:
        registry = _RecordingRegistry(self.plan) if record_topk else SharedStateRegistry(self.plan)
        return ForwardContext(input_ids=ids, positions=pos, shared=registry, prefix_ids=prefix, image_mask=image_mask,
                              kv_cache=KVCacheStep(self.global_kv, self.swa, [r.seq for r in rows], pos, valid),
                              routing=RoutingReplay(RoutingMode.RECORD) if record_routing else None)

    # ---- decoder bounded replay (§3.2.2) ---------------------------------------------------------
    def _bounded_decoder(self, rows, ctx, x, pre, split, record_routing, record_topk):
        x, pre = self.model.run_layers((x, pre), ctx, self.encoder_ids)
        for i in self.decoder_ids:  # global KV of every chunk token (CED: from H_{L/2})
            block = self.model.layers[str(i)]
            if block.attention.spec.computes_main_kv:
                if not block.attention.spec.uses_encoder_output:
                    raise RuntimeError(f"decoder bounded replay: layer {i} compresses decoder states, so its global "
                                       "KV needs the decoder over every prompt token")
                src = block.attention.compressor_input(block.attention_input(x, pre, ctx))
                kv, gate = block.attention.compressor.project(src)
                ctx.kv_cache.compress(block.attention, kv, gate)
        views = [(ctx, list(range(len(rows))), [0] * len(rows), x, pre)]
        keep = [r for r, (row, o) in enumerate(zip(rows, split)) if o < len(row.tokens)]
        if not keep:
            return views
        sub = [rows[r] for r in keep]
        offsets = [split[r] for r in keep]
        ids, pos, valid, prefix, image_mask = self._batch(sub, offsets)
        index = (torch.tensor(offsets, device=self.device).unsqueeze(1)
                 + torch.arange(ids.size(1), device=self.device)).clamp_max(x.size(1) - 1)
        rows_t = torch.tensor(keep, device=self.device).unsqueeze(1)
        dctx = self._context(sub, ids, pos, valid, prefix, image_mask, record_routing, record_topk)
        xd, pred = self.model.run_layers((x[rows_t, index], pre[rows_t, index]), dctx, self.decoder_ids)
        views.append((dctx, keep, offsets, xd, pred))
        return views

    # ---- outputs ----------------------------------------------------------------------------------
    def _outputs(self, rows, views, record_routing, record_topk) -> list[RowOutput]:
        out = [RowOutput() for _ in rows]
        ctx_last, keep, offsets, x, pre = views[-1]
        picks = []  # (row, local row in the last view, token indices)
        for j, (r, o) in enumerate(zip(keep, offsets)):
            n = len(rows[r].tokens)
            if rows[r].logits == "last":
                picks.append((r, j, [n - 1 - o]))
            elif rows[r].logits == "all":
                picks.append((r, j, list(range(n - o))))
        if picks:
            bi = torch.tensor([j for _, j, t in picks for _ in t], device=self.device)
            ti = torch.tensor([i for _, _, t in picks for i in t], device=self.device)
            logits = self.model.head(x[bi, ti].unsqueeze(0), pre[bi, ti].unsqueeze(0))[0]
            logits = mappings.gather_from_group(logits, self.tp, dim=-1)
            hidden = (self.model.final_hidden(x[bi, ti].unsqueeze(0), pre[bi, ti].unsqueeze(0))[0]
                      if any(row.hidden for row in rows) else None)
            at = 0
            for r, _, t in picks:
                chunk = logits[at:at + len(t)]
                out[r].logits = chunk[0] if rows[r].logits == "last" else chunk
                if hidden is not None and rows[r].hidden:
                    h = hidden[at:at + len(t)].float()
                    out[r].hidden = h[0] if rows[r].logits == "last" else h
                at += len(t)
        if record_routing:
            self._routing(rows, views, out)
        if record_topk:
            for ctx, keep, offsets, _, _ in views:
                for layer, sel in ctx.shared.topk.items():
                    for j, (r, o) in enumerate(zip(keep, offsets)):
                        n = len(rows[r].tokens)
                        full = torch.full((n, self.config.index_topk), -1, dtype=sel.dtype, device=sel.device)
                        full[o:, :sel.size(-1)] = sel[j, :n - o]
                        out[r].topk[layer] = full
        return out

    def _routing(self, rows, views, out) -> None:
        k, layers = self.config.moe_topk, self.model.layer_ids
        for r, row in enumerate(rows):
            out[r].routing = torch.full((len(row.tokens), len(layers), k), -1, dtype=torch.int32, device=self.device)
        for ctx, keep, offsets, _, _ in views:
            for li, layer in enumerate(layers):
                entries = ctx.routing.records().get(layer)
                if not entries:
                    continue
                ids = entries[0]
                for j, (r, o) in enumerate(zip(keep, offsets)):
                    n = len(rows[r].tokens)
                    out[r].routing[o:, li] = ids[j, :n - o]
