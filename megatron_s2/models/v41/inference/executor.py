"""The V4.1 backbone in the inference engine: its cache kinds, tiers and one forward (report §3.2).

What the engine caches per request for this family (its *inference state kinds*):

* **global KV** (:class:`~.kv_store.GlobalKVStore`) — main-KV entries and index keys of every
  Full layer, paged, ``page_tokens / m`` entries per page (FP4 / MXFP4 when the model's QAT
  flags say so), the persistent tier with a prefix cache;
* **SWA rings** (:class:`~.kv_store.SWAStore`) — the last ``window_size`` SWA KV vectors of
  every layer, one slot per running request, never persisted (§3.2.1);
* the compressor's partial blocks and the bounded-replay starts (:class:`~.kv_store.SequenceKV`).

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
