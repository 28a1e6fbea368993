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
"""

from __future__ import annotations

import torch

from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.engine import Chunk, ModelExecutor, RowOutput
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


class V41Executor(ModelExecutor):
    def __init__(self, model, config: EngineConfig, device: torch.device):
        cfg: V41Config = model.config
        check_engine_config(config, cfg)
        self.config, self.model_config = config, cfg
        self.global_kv = GlobalKVStore(cfg, config.num_pages_total, config.page_tokens, device)
        self.swa = SWAStore(cfg, config.max_num_seqs + config.swa_pool_slots, device)
        self.runner = ModelRunner(model, self.global_kv, self.swa)
        self.tiers = KVTiers(config, cfg, self.global_kv, self.swa)

    # ---- per-request state ----------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self.swa.free)

    def admit(self, request) -> None:
        request.kv = SequenceKV(self.swa.allocate())
        self.tiers.admit(request)  # prefix-cache / SWA-pool reuse and the bounded-replay starts

    def release(self, request, *, snapshot: bool = True) -> None:
        if request.kv is None:
            return
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
        self.tiers.after_forward(request)

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

    # ---- one forward ----------------------------------------------------------------------
    def forward(self, chunks: list[Chunk], *, record_routing: bool = False, record_topk: bool = False
                ) -> list[RowOutput]:
        rows = []
        for c in chunks:
            req, h = c.request, self.runner.history
            rows.append(ForwardRow(req.kv, req.tokens[c.start:c.start + c.length], c.start,
                                   req.tokens[max(0, c.start - h):c.start], logits=c.logits,
                                   decoder_from=req.kv.decoder_from))
        return self.runner.forward(rows, record_routing=record_routing, record_topk=record_topk)

    def stats(self) -> dict:
        return {"free_pages": self.global_kv.pool.num_free, "free_swa_slots": len(self.swa.free),
                "kv_bytes_per_token": self.global_kv.bytes_per_token(),
                "swa_bytes_per_request": self.swa.bytes_per_slot()}
