"""The dense family in the inference engine: a paged KV cache of every layer's keys and values.

Per request the state is a page table (:class:`DenseKV`); page ``i`` holds positions
``[i*T, (i+1)*T)`` of every layer's keys and values, in the model's compute dtype. One engine
forward builds a :class:`PagedKVStep` (``ctx.kv_cache``): each attention layer hands it the
chunk's roped keys and values, which are stored at their positions, and gets back every key
and value of each row up to its last token — so incremental decode computes exactly the full
forward's attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_s2.models.family.engine import Chunk, ModelExecutor, PagePool, RowOutput
from megatron_s2.parallel import mappings

__all__ = ["DenseKV", "PagedKVStep", "DenseExecutor", "cache_bytes"]


@dataclass
class DenseKV:
    pages: list[int] = field(default_factory=list)


def cache_bytes(cfg, config) -> int:
    """Bytes of the K and V pages the executor allocates (one rank's heads: the full model here)."""
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=getattr(
        torch, cfg.compute_dtype)).element_size()
    return config.num_pages_total * config.page_tokens * per_token


class PagedKVStep:
    """``ctx.kv_cache`` of one forward over rows ``[B, S]`` of request chunks."""

    def __init__(self, keys: dict, values: dict, page_tokens: int, tables: torch.Tensor, positions: torch.Tensor,
                 valid: torch.Tensor):
        self.keys, self.values, self.page_tokens = keys, values, page_tokens
        self.tables, self.positions, self.valid = tables, positions, valid
        self.end = (positions + 1).masked_fill(~valid, 0).amax(dim=1)  # [B]: one past each row's last token
        self.span = int(self.end.max())

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the chunk's keys / values, return every row's keys / values [B, L, KV, hd], their
        positions [B, L] and which are real [B, L]."""
        t = self.page_tokens
        rows, cols = self.valid.nonzero(as_tuple=True)
        pos = self.positions[rows, cols]
        pages = self.tables[rows, pos // t]
        self.keys[layer][pages, pos % t] = k[rows, cols].to(self.keys[layer].dtype)
        self.values[layer][pages, pos % t] = v[rows, cols].to(self.values[layer].dtype)
        n = -(-self.span // t)
        table = self.tables[:, :n]
        keys = self.keys[layer][table].flatten(1, 2)[:, :self.span]
        values = self.values[layer][table].flatten(1, 2)[:, :self.span]
        key_pos = torch.arange(self.span, device=k.device).expand(k.size(0), -1)
        return keys, values, key_pos, key_pos < self.end.unsqueeze(1)


class DenseExecutor(ModelExecutor):
    def __init__(self, model, config, device: torch.device):
        cfg = model.config
        self.model, self.config, self.device = model, config, device
        self.page_tokens = config.page_tokens
        heads = cfg.num_kv_heads // model.groups.tp.size
        shape = (config.num_pages_total, config.page_tokens, heads, cfg.head_dim)
        dtype = getattr(torch, cfg.compute_dtype)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in model.layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in model.layer_ids}
        self.pool = PagePool(config.num_pages_total)

    def can_admit(self) -> bool:
        return True  # pages are checked per step by the scheduler

    def admit(self, request) -> None:
        request.kv = DenseKV()

    def release(self, request, *, snapshot: bool = True) -> None:
        if request.kv is None:
            return
        for page in request.kv.pages:
            self.pool.release(page)
        request.kv = None

    def pages_needed(self, request, tokens: int) -> int:
        return max(0, -(-(request.num_computed + tokens) // self.page_tokens) - len(request.kv.pages))

    def free_pages(self) -> int:
        return self.pool.num_free

    @torch.no_grad()
    def forward(self, chunks: list[Chunk], *, record_routing: bool = False, record_topk: bool = False
                ) -> list[RowOutput]:
        for c in chunks:  # pages for every token of the chunk
            while len(c.request.kv.pages) * self.page_tokens < c.start + c.length:
                c.request.kv.pages.append(self.pool.allocate())
        s, dev = max(c.length for c in chunks), self.device
        ids = torch.tensor([c.request.tokens[c.start:c.start + c.length] + [0] * (s - c.length) for c in chunks],
                           dtype=torch.long, device=dev)
        start = torch.tensor([c.start for c in chunks], device=dev)
        positions = start.unsqueeze(1) + torch.arange(s, device=dev)
        valid = torch.arange(s, device=dev).unsqueeze(0) < torch.tensor([c.length for c in chunks], device=dev).unsqueeze(1)
        width = max(len(c.request.kv.pages) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.long, device=dev)
        for r, c in enumerate(chunks):
            tables[r, :len(c.request.kv.pages)] = torch.tensor(c.request.kv.pages, device=dev)
        ctx = self.model.make_context({"tokens": ids, "position_ids": positions})
        ctx.kv_cache = PagedKVStep(self.keys, self.values, self.page_tokens, tables, positions, valid)
        (x,) = self.model.run_layers(self.model.embed(ids), ctx)
        out = [RowOutput() for _ in chunks]
        picks = [(r, list(range(c.length)) if c.logits == "all" else [c.length - 1])
                 for r, c in enumerate(chunks) if c.logits != "none"]
        if picks:
            rows = torch.tensor([r for r, idx in picks for _ in idx], device=dev)
            cols = torch.tensor([i for _, idx in picks for i in idx], device=dev)
            logits = self.model.head(x[rows, cols].unsqueeze(0))[0]
            logits = mappings.gather_from_group(logits, self.model.groups.tp, dim=-1)
            at = 0
            for r, idx in picks:
                part = logits[at:at + len(idx)]
                out[r].logits = part if chunks[r].logits == "all" else part[0]
                at += len(idx)
        return out

    def stats(self) -> dict:
        return {"free_pages": self.pool.num_free}
