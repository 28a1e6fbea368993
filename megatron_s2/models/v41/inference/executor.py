"""The V4.1 backbone in the inference engine: its cache kinds, tiers and one forward (report §3.2).

What the engine caches per request for this family (its *inference state kinds*):

* **global KV** (:class:`~.kv_store.GlobalKVStore`) — main-KV entries and index keys of every
  Full layer, paged, ``page_tokens / m`` entries per page (FP4 / MXFP4 when the model's QAT
  flags say so), the persistent tier with a prefix cache;
* **SWA rings** (:class:`~.kv_store.SWAStore`) — the last ``window_size`` SWA KV vectors of
  every layer, one slot per running request, never persisted (§3.2.1);
* the compressor's partial blocks and the bounded-replay starts (:class:`~.kv_store.SequenceKV`).

A request's state can be exported to host tensors and imported by another engine of the same
configuration (:meth:`V41Executor.export_state` / :meth:`V41Executor.import_state`), so that a
rollout resumed after a restart continues every in-flight sample bit for bit (report §5.2.3).

:class:`~.tiers.KVTiers` decides at admission what a request resumes from (prefix pages, an SWA
snapshot, encoder / decoder SWA Bounded Replay, §3.2.2); :class:`~.runner.ModelRunner` runs one
incremental forward of the training modules over a batch of chunks.

**Images** (report §2.1.1): :meth:`V41Executor.prepare_images` expands each ``image_token_id``
placeholder of a prompt into its image's span (the reference's ``prepare_vl_inputs``) and keys
the image by its patches; the vision encoder runs once per image, the first time a chunk reaches
its span, and every chunk that covers span positions (a span may cross chunk boundaries) takes
its rows from that result (:meth:`V41Executor._image_rows`).

**Series** (Intern-S2 §2.2.1, walkthrough §2.2.2): a request's series spans take the time-series
encoder's tokens the same way (:mod:`megatron_s2.models.timeseries.serving`), without the image
mask — the whole-sequence ``embed(ids, series=)`` forward sets none either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.engine import Chunk, ImageSpan, ResumableState, RowOutput, SpeculativeExecutor, image_key
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.models.v41.inference.runner import ForwardRow, ModelRunner
from megatron_s2.models.v41.inference.tiers import KVTiers

__all__ = ["V41Executor", "check_engine_config"]


def check_engine_config(config: EngineConfig, model: V41Config) -> None:
    """Errors for engine settings this model cannot honour (one line naming the setting)."""
    ratios = sorted({s.compress_ratio for s in model.plan if s.computes_main_kv})
    bad = [m for m in ratios if config.page_tokens % m]
    if bad:
        raise ConfigError(f"page_tokens: {config.page_tokens} is not a multiple of the compression ratio(s) {bad}; "
                          f"choose a multiple of {ratios[-1] if ratios else 1}")
    if config.decoder_bounded_replay:
        if not model.has_decoder:
            raise ConfigError("decoder_bounded_replay: the model has no CED decoder (num_encoder_layers = num_layers)")
        for s in model.plan:
            if s.computes_main_kv and not s.is_encoder and not s.uses_encoder_output:
                raise ConfigError(f"decoder_bounded_replay: decoder layer {s.index} compresses its own hidden "
                                  "state, so its global KV needs the decoder over every prompt token; set "
                                  "decoder_bounded_replay: false")


@dataclass
class _Speculation:
    start: int
    length: int
    ring_idx: torch.Tensor
    rings: dict
    entries: dict
    partial: dict
    kv_tokens: dict
    pages: int
    rows: dict = field(default_factory=dict)  # layer -> (compressor kv, gate, position of row 0), from KVCacheStep


class V41Executor(SpeculativeExecutor, ResumableState):
    def __init__(self, model, config: EngineConfig, device: torch.device):
        cfg: V41Config = model.config
        check_engine_config(config, cfg)
        self.config, self.model_config = config, cfg
        self.global_kv = GlobalKVStore(cfg, config.num_pages_total, config.page_tokens, device)
        self.swa = SWAStore(cfg, config.max_num_seqs + config.swa_pool_slots, device)
        self.runner = ModelRunner(model, self.global_kv, self.swa)
        self.tiers = KVTiers(config, cfg, self.global_kv, self.swa)
        self.image_token_id = cfg.image_token_id if getattr(model, "vision", None) is not None else None
        self.drafter = None
        if config.speculative:
            if getattr(model, "dspark", None) is None:
                raise ConfigError("speculative: the model has no DSpark drafter (model.dspark_layers: 0); train one "
                                  "with phase.kind: dspark or drop --speculative")
            from megatron_s2.models.v41.dspark.engine import DSparkEngineDrafter

            self.drafter = DSparkEngineDrafter(model, config.max_num_seqs + config.swa_pool_slots, device)
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}  # request id -> (start, target rows) to push

    # ---- per-request state ----------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self.swa.free)

    def admit(self, request) -> None:
        request.kv = SequenceKV(self.swa.allocate())
        if self.drafter is not None:
            self.drafter.reset(request.kv.swa_slot)
        self.tiers.admit(request)  # prefix-cache / SWA-pool reuse and the bounded-replay starts

    def release(self, request, *, snapshot: bool = True) -> None:
        self._pending.pop(id(request), None)
        if request.kv is None:
            return
        if request.kv.speculation is not None:  # released mid-verification: restore what it overwrote first
            self.rollback(request, 0)
        if snapshot:
            self.tiers.on_finish(request)
        for page in request.kv.pages:
            self.global_kv.pool.release(page)
        self.swa.release(request.kv.swa_slot)
        request.kv = None

    def pages_needed(self, request, tokens: int) -> int:
        return max(0, -(-(request.num_computed + tokens) // self.config.page_tokens) - len(request.kv.pages))

    def free_pages(self) -> int:
        return self.global_kv.pool.num_free

    def limit_chunk(self, request, tokens: int) -> int:
        return self.tiers.limit_chunk(request, tokens)

    def after_forward(self, request) -> None:
        pending = self._pending.pop(id(request), None)
        if pending is not None:
            self.drafter.push(request.kv.swa_slot, *pending)
        self.tiers.after_forward(request)

    # ---- speculative verification (DSpark, §2.4.3) -----------------------------------------
    def begin_speculation(self, request, length: int) -> None:
        """Record what a forward of ``length`` tokens from ``num_computed`` will overwrite: the SWA
        ring slots of those positions, the global-KV entries their complete blocks would take,
        the compressor's carried partial blocks and counters, and the page count."""
        seq, start = request.kv, request.num_computed
        self.runner._ensure_pages(seq, start + length)
        w = self.swa.window
        ring_idx = torch.arange(start, start + length, device=self.global_kv.device) % w
        rings = {layer: tuple(buf[seq.swa_slot, ring_idx].clone() for buf in bufs)
                 for layer, bufs in self.swa.rings.items()}
        entries = {}
        for layer, geo in self.global_kv.layers.items():
            ids = torch.arange(start // geo.ratio, (start + length) // geo.ratio, device=self.global_kv.device)
            if ids.numel():
                page = torch.tensor(seq.pages, device=ids.device)[ids // geo.entries_per_page]
                slot = ids % geo.entries_per_page
                entries[layer] = (ids, page, slot,
                                  tuple(buf[page, slot].clone() for buf in (*self.global_kv.main[layer],
                                                                             *self.global_kv.index[layer])))
        seq.speculation = _Speculation(start, length, ring_idx, rings, entries, dict(seq.partial),
                                       dict(seq.kv_tokens), len(seq.pages))

    def rollback(self, request, keep: int) -> None:
        seq = request.kv
        spec, seq.speculation = seq.speculation, None
        if spec is None:
            raise RuntimeError("rollback without begin_speculation")
        end = spec.start + keep
        for layer, saved in spec.rings.items():  # ring slots of the dropped positions
            for buf, old in zip(self.swa.rings[layer], saved):
                buf[seq.swa_slot, spec.ring_idx[keep:]] = old[keep:]
        for layer, (ids, page, slot, saved) in spec.entries.items():  # entries whose block is not kept whole
            geo = self.global_kv.layers[layer]
            drop = (ids + 1) * geo.ratio > end
            bufs = (*self.global_kv.main[layer], *self.global_kv.index[layer])
            for buf, old in zip(bufs, saved):
                buf[page[drop], slot[drop]] = old[drop]
        for layer in self.global_kv.layers:
            m = self.global_kv.layers[layer].ratio
            rows = spec.rows.get(layer)
            if rows is None:
                seq.partial[layer] = spec.partial.get(layer, (None, None))
                if layer in spec.kv_tokens:
                    seq.kv_tokens[layer] = spec.kv_tokens[layer]
                else:
                    seq.kv_tokens.pop(layer, None)
                continue
            kv, gate, base = rows
            lo, hi = end // m * m - base, end - base  # the incomplete block of the kept tokens
            seq.partial[layer] = ((kv[lo:hi].clone(), gate[lo:hi].clone() if gate is not None else None)
                                  if hi > lo else (None, None))
            seq.kv_tokens[layer] = end
        need = max(spec.pages, -(-end // self.config.page_tokens))
        for page in seq.pages[need:]:
            self.global_kv.pool.release(page)
        del seq.pages[need:]
        pending = self._pending.get(id(request))
        if pending is not None:  # the drafter sees only the kept tokens
            start, rows = pending
            self._pending[id(request)] = (start, rows[:max(0, end - start)])

    def reclaim(self) -> bool:
        return self.tiers.reclaim()

    # ---- exact resume after a restart (report §5.2.3) --------------------------------------
    def _buffers(self):
        """(key, buffer, "pages" | "slot") of every cache buffer: rows are page ids or SWA slots."""
        for layer in self.global_kv.layers:
            for i, buf in enumerate((*self.global_kv.main[layer], *self.global_kv.index[layer])):
                yield f"kv.{layer}.{i}", buf, "pages"
        for layer, ring in self.swa.rings.items():
            for i, buf in enumerate(ring):
                yield f"swa.{layer}.{i}", buf, "slot"

    def export_state(self, request) -> dict[str, torch.Tensor]:
        """The request's pages and SWA ring (stale slots included: they are masked), the
        compressor's partial blocks and how far each part reaches."""
        seq = request.kv
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.global_kv.device)
        # copies (a slot is a view of the live ring, which the engine overwrites when it continues)
        out = {key: (buf[pages] if rows == "pages" else buf[seq.swa_slot]).to("cpu", copy=True)
               for key, buf, rows in self._buffers()}
        out.update({f"kv_tokens.{layer}": torch.tensor(n) for layer, n in seq.kv_tokens.items()})
        for layer, (kv, gate) in seq.partial.items():
            for name, t in (("kv", kv), ("gate", gate)):
                if t is not None:
                    out[f"partial.{layer}.{name}"] = t.to("cpu", copy=True)
        out["meta"] = torch.tensor([request.num_computed, len(seq.pages), seq.decoder_from, seq.hashed_pages,
                                    *seq.swa_from])
        return out

    def check_state(self, state: dict[str, torch.Tensor]) -> int:
        if "meta" not in state:
            raise ValueError("the saved cache state has no 'meta' entry; it was not saved by this engine")
        for key, buf, rows in self._buffers():
            got = state.get(key)
            shape = None if got is None else tuple(got.shape[1:] if rows == "pages" else got.shape)
            if shape != tuple(buf.shape[1:]) or got.dtype != buf.dtype:
                raise ValueError(f"the saved cache state's '{key}' ({shape}) does not fit this engine's buffers "
                                 f"({tuple(buf.shape[1:])}): the model or engine.page_tokens changed")
        return int(state["meta"][0])

    def import_state(self, request, state: dict[str, torch.Tensor]) -> None:
        num_computed, num_pages, decoder_from, hashed_pages, swa_enc, swa_dec = state["meta"].tolist()
        if self.global_kv.pool.num_free < num_pages:  # a smaller page pool than the saving engine's
            self.admit(request)  # the request re-runs its tokens instead: correct, not bit for bit
            return
        seq = SequenceKV(self.swa.allocate())
        if self.drafter is not None:  # the state carries no drafter rows: mask the slot's previous ones
            self.drafter.reset(seq.swa_slot)
        seq.pages = [self.global_kv.pool.allocate() for _ in range(num_pages)]
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.global_kv.device)
        for key, buf, rows in self._buffers():
            if rows == "pages":
                buf[pages] = state[key].to(buf.device)
            else:
                buf[seq.swa_slot].copy_(state[key])
        device = self.global_kv.device
        for key, t in state.items():
            kind, _, rest = key.partition(".")
            if kind == "kv_tokens":
                seq.kv_tokens[int(rest)] = int(t)
            elif kind == "partial":
                layer, name = rest.split(".")
                kv, gate = seq.partial.get(int(layer), (None, None))
                seq.partial[int(layer)] = (t.to(device), gate) if name == "kv" else (kv, t.to(device))
        seq.decoder_from, seq.hashed_pages, seq.swa_from = decoder_from, hashed_pages, (swa_enc, swa_dec)
        request.kv, request.num_computed = seq, num_computed

    # ---- images (report §2.1.1) -----------------------------------------------------------
    def prepare_images(self, prompt: list[int], images: list) -> tuple[list[int], list[ImageSpan]]:
        """Decoded images (Pillow): each placeholder of ``prompt`` becomes its image's span.
        Prepared ``ImageInput``s (``prepare_vl_inputs``): ``prompt`` already holds their spans."""
        from megatron_s2.models.v41.vision.processor import ImageInput, prepare_vl_inputs

        cfg = self.model_config
        if self.image_token_id is None:
            raise ValueError("images given, but this model has no vision tower (model.vision_n_layers: 0)")
        prepared = {isinstance(image, ImageInput) for image in images}
        if len(prepared) > 1:
            raise ValueError("images: give decoded images or prepared ImageInputs, not a mix of both")
        if prepared == {True}:
            inputs = list(images)
            for image in inputs:
                end = image.start + image.types.numel()
                if end > len(prompt) or any(t != cfg.image_token_id for t in prompt[image.start:end]):
                    raise ValueError(f"image at position {image.start}: the prompt does not hold its span of "
                                     f"{image.types.numel()} image tokens ({cfg.image_token_id}) there")
        else:
            prompt, _, inputs = prepare_vl_inputs(prompt, images, cfg)
            inputs = inputs or []
        spans = [ImageSpan(image.start, image.types.numel(),
                           image_key(image.patches, image.n_vit_h, image.n_vit_w, image.types), image)
                 for image in inputs]
        return list(prompt), spans

    def _image_rows(self, request, start: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """(offset in the chunk, span rows) of the image positions in ``[start, start + length)``;
        each image's vision forward runs once per request, on first use."""
        out = []
        for image in request.images:
            lo, hi = max(start, image.start), min(start + length, image.end)
            if lo >= hi:
                continue
            if image.embeddings is None:
                dtype = getattr(torch, self.model_config.compute_dtype)  # the dtype embed() merges spans in
                with torch.no_grad():
                    image.embeddings = self.runner.model.vision.span_embeddings(image.data, dtype)
            out.append((lo - start, image.embeddings[lo - image.start:hi - image.start]))
        return out

    def _series_rows(self, request, start: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """(offset in the chunk, span rows) of the series positions in the chunk (Intern-S2 §2.2.1)."""
        if not getattr(request, "series", None):  # engine requests carry it; bare ones may not
            return []
        from megatron_s2.models.timeseries.serving import series_rows

        dtype = getattr(torch, self.model_config.compute_dtype)
        return series_rows(self.runner.model.timeseries, request.series, start, length, dtype)

    def _history(self, request, start: int) -> list[int]:
        """The tokens before ``start`` that Engram's n-grams may reach, -1 at image positions."""
        lo = max(0, start - self.runner.history)
        history = request.tokens[lo:start]
        for image in request.images:
            a, b = max(lo, image.start), min(start, image.end)
            if a < b:
                history = history[:a - lo] + [-1] * (b - a) + history[b - lo:]
        return history

    # ---- one forward ----------------------------------------------------------------------
    def forward(self, chunks: list[Chunk], *, record_routing: bool = False, record_topk: bool = False
                ) -> list[RowOutput]:
        rows = []
        for c in chunks:
            req = c.request
            rows.append(ForwardRow(req.kv, req.tokens[c.start:c.start + c.length], c.start,
                                   self._history(req, c.start), logits=c.logits, decoder_from=req.kv.decoder_from,
                                   images=self._image_rows(req, c.start, c.length), hidden=c.hidden,
                                   series=self._series_rows(req, c.start, c.length)))
        capture = self.drafter.targets if self.drafter is not None else ()
        out = self.runner.forward(rows, record_routing=record_routing, record_topk=record_topk, capture=capture)
        if capture:  # the drafter's input of every computed token, pushed once the step keeps it
            targets = self.drafter.target_rows(self.runner.captured)
            for r, c in enumerate(chunks):
                self._pending[id(c.request)] = (c.start, targets[r, :c.length])
        return out

    def stats(self) -> dict:
        return {"free_pages": self.global_kv.pool.num_free, "free_swa_slots": len(self.swa.free),
                "kv_bytes_per_token": self.global_kv.bytes_per_token(),
                "swa_bytes_per_request": self.swa.bytes_per_slot()}
