"""The Intern-S2 family in the inference engine: per-request recurrent state and paged KV.

Per request (:class:`HybridState`): for every Gated DeltaNet layer the convolution state (the
last K-1 inputs of q/k/v, ``[C, K-1]``) and the recurrent state (``[Hv, dk, dv]``, float32) —
fixed size, independent of the length — and for the full-attention layers a page table into
the paged K/V pool (page ``i`` holds positions ``[i*T, (i+1)*T)``).

One engine forward batches request chunks as rows ``[B, S]`` (shorter rows padded at the end):
a :class:`HybridCacheStep` (``ctx.cache``) hands each Gated DeltaNet layer its rows' states and
which tokens are real (padding neither writes nor decays the memory, and the convolution state
is taken at each row's last real token), and each attention layer every key and value up to
its rows' last tokens. Chunked prefill followed by one-token decode therefore computes exactly
the full forward (tests/models/intern_s2).

A request's series (Intern-S2 §2.2.1) overwrite their spans' embeddings in every chunk that
reaches them (:mod:`megatron_s2.models.timeseries.serving`), as ``embed(ids, series=)`` does.

Recurrent states are not page-aligned snapshots of a prefix, so prefix caching does not apply;
a request's state can be exported and restored exactly (a rollout resumed after a restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.engine import Chunk, ModelExecutor, PagePool, ResumableState, RowOutput
from megatron_s2.parallel import mappings

__all__ = ["HybridState", "HybridCacheStep", "HybridExecutor", "cache_bytes", "state_bytes_per_request"]


@dataclass
class HybridState:
    pages: list[int] = field(default_factory=list)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    """Gated DeltaNet layer -> [C_local, K-1] last inputs of the convolution."""
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    """Gated DeltaNet layer -> [Hv_local, dk, dv] float32 delta-rule state."""


def _element_size(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def state_bytes_per_request(cfg, tp: int = 1) -> int:
    """Bytes of one request's recurrent + convolution states on one tp rank (length-independent)."""
    conv = (2 * cfg.linear_key_dim + cfg.linear_value_dim) // tp * (cfg.linear_conv_kernel - 1)
    recurrent = cfg.linear_num_value_heads // tp * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return len(cfg.linear_layers) * (conv * _element_size(cfg.compute_dtype) + recurrent * 4)


def kv_bytes_per_token(cfg, tp: int = 1) -> int:
    return len(cfg.full_layers) * 2 * cfg.num_kv_heads // tp * cfg.head_dim * _element_size(cfg.compute_dtype)


def cache_bytes(cfg, config, tp: int = 1) -> int:
    """What :class:`HybridExecutor` allocates: the K/V page pool plus ``max_num_seqs`` states."""
    return (config.num_pages_total * config.page_tokens * kv_bytes_per_token(cfg, tp)
            + config.max_num_seqs * state_bytes_per_request(cfg, tp))


def check_engine_config(config) -> None:
    """Engine settings this executor cannot honour, refused with the field named."""
    if config.prefix_caching:
        raise ConfigError("prefix_caching: the intern_s2 family's Gated DeltaNet states summarise a whole prefix "
                          "and are not kept per page; serve without --prefix-caching")
    if config.decoder_bounded_replay:
        raise ConfigError("decoder_bounded_replay: the intern_s2 family has no sliding window to replay; set it "
                          "to false")


class _LinearView:
    """One Gated DeltaNet layer's states for the rows of a step (``ctx.cache.linear(layer)``)."""

    def __init__(self, step: "HybridCacheStep", layer: int):
        self.step, self.layer = step, layer
        self.conv = torch.stack([r.kv.conv[layer] for r in step.requests])
        self.recurrent = torch.stack([r.kv.recurrent[layer] for r in step.requests])
        self.valid, self.lengths = step.valid, step.lengths

    def store(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        for i, r in enumerate(self.step.requests):
            r.kv.conv[self.layer] = conv[i].to(r.kv.conv[self.layer].dtype)
            r.kv.recurrent[self.layer] = recurrent[i].float()


class HybridCacheStep:
    """``ctx.cache`` of one engine forward over rows ``[B, S]`` of request chunks."""

    def __init__(self, requests: list, keys: dict, values: dict, page_tokens: int, tables: torch.Tensor,
                 positions: torch.Tensor, valid: torch.Tensor):
        self.requests, self.keys, self.values, self.page_tokens = requests, keys, values, page_tokens
        self.tables, self.positions, self.valid = tables, positions, valid
        self.lengths = valid.sum(1)
        self.end = (positions + 1).masked_fill(~valid, 0).amax(dim=1)  # one past each row's last token
        self.span = int(self.end.max())

    def linear(self, layer: int) -> _LinearView:
        return _LinearView(self, layer)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the chunk's keys / values; return every row's keys / values [B, L, KV, hd], their
        positions [B, L] and which are real [B, L]."""
        t = self.page_tokens
        rows, cols = self.valid.nonzero(as_tuple=True)
        pos = self.positions[rows, cols]
        pages = self.tables[rows, pos // t]
        self.keys[layer][pages, pos % t] = k[rows, cols].to(self.keys[layer].dtype)
        self.values[layer][pages, pos % t] = v[rows, cols].to(self.values[layer].dtype)
        table = self.tables[:, :-(-self.span // t)]
        keys = self.keys[layer][table].flatten(1, 2)[:, :self.span]
        values = self.values[layer][table].flatten(1, 2)[:, :self.span]
        key_pos = torch.arange(self.span, device=k.device).expand(k.size(0), -1)
        return keys, values, key_pos, key_pos < self.end.unsqueeze(1)


class HybridExecutor(ModelExecutor, ResumableState):
    def __init__(self, model, config, device: torch.device):
        check_engine_config(config)
        cfg, tp = model.config, model.groups.tp.size
        self.model, self.config, self.device, self.cfg = model, config, device, cfg
        self.page_tokens = config.page_tokens
        self.dtype = getattr(torch, cfg.compute_dtype)
        full = [i for i in model.layer_ids if i in set(cfg.full_layers)]
        self.linear = [i for i in model.layer_ids if i in set(cfg.linear_layers)]
        shape = (config.num_pages_total, config.page_tokens, cfg.num_kv_heads // tp, cfg.head_dim)
        self.keys = {i: torch.zeros(shape, dtype=self.dtype, device=device) for i in full}
        self.values = {i: torch.zeros(shape, dtype=self.dtype, device=device) for i in full}
        self.pool = PagePool(config.num_pages_total)
        self.conv_shape = ((2 * cfg.linear_key_dim + cfg.linear_value_dim) // tp, cfg.linear_conv_kernel - 1)
        self.state_shape = (cfg.linear_num_value_heads // tp, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.admitted = 0
        self.uses_pages = bool(full)

    # ---- per-request state -----------------------------------------------------------------
    def can_admit(self) -> bool:
        return self.admitted < self.config.max_num_seqs

    def admit(self, request) -> None:
        request.kv = HybridState(
            conv={i: torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device) for i in self.linear},
            recurrent={i: torch.zeros(self.state_shape, dtype=torch.float32, device=self.device) for i in self.linear})
        self.admitted += 1

    def release(self, request, *, snapshot: bool = True) -> None:
        if request.kv is None:
            return
        for page in request.kv.pages:
            self.pool.release(page)
        request.kv = None
        self.admitted -= 1

    def pages_needed(self, request, tokens: int) -> int:
        if not self.uses_pages:
            return 0
        return max(0, -(-(request.num_computed + tokens) // self.page_tokens) - len(request.kv.pages))

    def free_pages(self) -> int:
        return self.pool.num_free

    def export_state(self, request) -> dict[str, torch.Tensor] | None:
        kv, out = request.kv, {"num_computed": torch.tensor([request.num_computed])}
        for i in self.linear:
            out[f"conv.{i}"], out[f"recurrent.{i}"] = kv.conv[i].cpu().clone(), kv.recurrent[i].cpu().clone()
        for i in self.keys:  # the cached keys / values of the request's positions, in order
            n = request.num_computed
            pages = torch.tensor(kv.pages, dtype=torch.long, device=self.device)
            out[f"keys.{i}"] = self.keys[i][pages].flatten(0, 1)[:n].cpu().clone() if n else \
                torch.zeros(0, *self.keys[i].shape[2:], dtype=self.dtype)
            out[f"values.{i}"] = self.values[i][pages].flatten(0, 1)[:n].cpu().clone() if n else \
                torch.zeros(0, *self.values[i].shape[2:], dtype=self.dtype)
        return out

    def check_state(self, state: dict[str, torch.Tensor]) -> int:
        want = {"num_computed", *(f"conv.{i}" for i in self.linear), *(f"recurrent.{i}" for i in self.linear),
                *(f"keys.{i}" for i in self.keys), *(f"values.{i}" for i in self.values)}
        if set(state) != want:
            raise ValueError(f"cache state has {sorted(set(state) ^ want)[:4]} not matching this model's layers")
        n = int(state["num_computed"][0])
        for i in self.linear:
            if tuple(state[f"conv.{i}"].shape) != self.conv_shape or tuple(state[f"recurrent.{i}"].shape) != self.state_shape:
                raise ValueError(f"cache state of layer {i} has another shape than this engine's")
        for i in self.keys:
            if state[f"keys.{i}"].size(0) != n or state[f"values.{i}"].size(0) != n:
                raise ValueError(f"cache state of layer {i} covers another number of tokens than {n}")
        return n

    def import_state(self, request, state: dict[str, torch.Tensor]) -> None:
        n = self.check_state(state)
        self.admit(request)
        kv = request.kv
        for i in self.linear:
            kv.conv[i] = state[f"conv.{i}"].to(self.device, self.dtype)
            kv.recurrent[i] = state[f"recurrent.{i}"].to(self.device, torch.float32)
        if self.uses_pages:
            while len(kv.pages) * self.page_tokens < n:
                kv.pages.append(self.pool.allocate())
            t, pos = self.page_tokens, torch.arange(n, device=self.device)
            pages = torch.tensor(kv.pages, dtype=torch.long, device=self.device)[pos // t] if n else pos
            for i in self.keys:
                self.keys[i][pages, pos % t] = state[f"keys.{i}"].to(self.device, self.dtype)
                self.values[i][pages, pos % t] = state[f"values.{i}"].to(self.device, self.dtype)
        request.num_computed = n

    # ---- one forward -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, chunks: list[Chunk], *, record_routing: bool = False, record_topk: bool = False
                ) -> list[RowOutput]:
        if self.uses_pages:
            for c in chunks:
                while len(c.request.kv.pages) * self.page_tokens < c.start + c.length:
                    c.request.kv.pages.append(self.pool.allocate())
        s, dev = max(c.length for c in chunks), self.device
        ids = torch.tensor([c.request.tokens[c.start:c.start + c.length] + [0] * (s - c.length) for c in chunks],
                           dtype=torch.long, device=dev)
        positions = torch.tensor([c.start for c in chunks], device=dev).unsqueeze(1) + torch.arange(s, device=dev)
        valid = torch.arange(s, device=dev).unsqueeze(0) < torch.tensor([c.length for c in chunks], device=dev).unsqueeze(1)
        width = max([len(c.request.kv.pages) for c in chunks] + [1])
        tables = torch.zeros(len(chunks), width, dtype=torch.long, device=dev)
        for r, c in enumerate(chunks):
            if c.request.kv.pages:
                tables[r, :len(c.request.kv.pages)] = torch.tensor(c.request.kv.pages, device=dev)
        ctx = self.model.make_context({"tokens": ids, "position_ids": positions})
        ctx.cache = HybridCacheStep([c.request for c in chunks], self.keys, self.values, self.page_tokens, tables,
                                    positions, valid)
        ctx.record = {} if record_routing else None
        (x,) = self.model.run_layers(self._embed(chunks, ids), ctx)
        out = [RowOutput() for _ in chunks]
        picks = [(r, list(range(c.length)) if c.logits == "all" else [c.length - 1])
                 for r, c in enumerate(chunks) if c.logits != "none"]
        if picks:
            rows = torch.tensor([r for r, idx in picks for _ in idx], device=dev)
            cols = torch.tensor([i for _, idx in picks for i in idx], device=dev)
            logits = self.model.head(x[rows, cols].unsqueeze(0))[0]
            logits = mappings.gather_from_group(logits, self.model.groups.tp, dim=-1)
            hidden = self.model.final_hidden(x[rows, cols].unsqueeze(0))[0] if any(c.hidden for c in chunks) else None
            at = 0
            for r, idx in picks:
                part = logits[at:at + len(idx)]
                out[r].logits = part if chunks[r].logits == "all" else part[0]
                if hidden is not None and chunks[r].hidden:
                    h = hidden[at:at + len(idx)].float()
                    out[r].hidden = h if chunks[r].logits == "all" else h[0]
                at += len(idx)
        if record_routing:
            layers, k = self.model.layer_ids, self.cfg.moe_topk
            for r, c in enumerate(chunks):
                out[r].routing = torch.full((c.length, len(layers), k), -1, dtype=torch.int32, device=dev)
                for li, layer in enumerate(layers):
                    if layer in ctx.record:
                        out[r].routing[:, li] = ctx.record[layer][r, :c.length].to(torch.int32)
        return out

    def _embed(self, chunks: list[Chunk], ids: torch.Tensor) -> tuple[torch.Tensor]:
        """The word embeddings of the rows, each series span overwritten by the time-series
        encoder's tokens (as ``embed(ids, series=)`` does in the whole-sequence forward)."""
        (h,) = self.model.embed(ids)
        for r, c in enumerate(chunks):
            if not getattr(c.request, "series", None):  # engine requests carry it; bare ones may not
                continue
            from megatron_s2.models.timeseries.serving import series_rows

            for offset, rows in series_rows(self.model.timeseries, c.request.series, c.start, c.length, h.dtype):
                h[r, offset:offset + rows.size(0)] = rows
        return (h,)

    def stats(self) -> dict:
        return {"free_pages": self.pool.num_free, "admitted": self.admitted}
