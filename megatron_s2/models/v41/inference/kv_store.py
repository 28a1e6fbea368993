"""Where the KV cache lives: paged global KV and per-request SWA rings (report §2.4.4, §3.2.1).

**Global KV** (the main-KV entries and index keys of every Full layer, the persistent tier)
is paged like vLLM's block tables: a *page* covers ``page_tokens`` consecutive tokens of one
request, i.e. ``page_tokens / m`` entries of every Full layer of ratio m, stored in that
layer's buffers at the same page id. One page table per request therefore addresses all
layers, and a page of a shared prompt prefix can be shared by many requests (the prefix
cache, :mod:`.tiers`). Page 0 is reserved, all zeros, and pads short page tables.

**SWA state** (§3.2.1: never persisted with the global KV) is one *slot* per running
request: a ring of the last ``window_size`` SWA KV vectors of every layer, position p at ring
index p mod W. The short-TTL SWA pool (:mod:`.swa_pool`) keeps copies of slots.

Bytes are those of the allocated buffers (:meth:`GlobalKVStore.bytes_per_token`,
:meth:`SWAStore.bytes_per_slot`), which the tests compare with the accountant
(:func:`megatron_s2.models.v41.accounting.kv_bytes`). Every buffer lives on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.kv_formats import VectorFormat, vector_format
from megatron_s2.models.family.engine import OutOfPages, PagePool

__all__ = ["OutOfPages", "PagePool", "GlobalKVStore", "SWAStore", "SequenceKV"]


@dataclass(frozen=True)
class _LayerGeometry:
    layer: int
    ratio: int
    entries_per_page: int


class GlobalKVStore:
    """Main-KV and index-K pages of every Full layer (formats from the model's QAT flags)."""

    def __init__(self, config: V41Config, num_pages: int, page_tokens: int, device: torch.device):
        self.page_tokens, self.num_pages, self.device = page_tokens, num_pages, device
        self.main_format = vector_format(config.fp4_main_kv, "fp4_e4m3", config.head_dim)
        self.index_format = vector_format(config.fp4_indexer, "mxfp4", config.index_head_dim)
        self.layers: dict[int, _LayerGeometry] = {}
        self.main: dict[int, tuple[torch.Tensor, ...]] = {}
        self.index: dict[int, tuple[torch.Tensor, ...]] = {}
        for spec in config.plan:
            if spec.computes_main_kv:
                e = page_tokens // spec.compress_ratio
                self.layers[spec.index] = _LayerGeometry(spec.index, spec.compress_ratio, e)
                self.main[spec.index] = self.main_format.allocate((num_pages, e), device)
                self.index[spec.index] = self.index_format.allocate((num_pages, e), device)
        self.pool = PagePool(num_pages)

    def write(self, layer: int, pages: torch.Tensor, slots: torch.Tensor, main: torch.Tensor,
              index: torch.Tensor) -> None:
        """Store entries (raw values, packed here) at (page, slot) pairs, ``[N]`` each."""
        for buf, part in zip(self.main[layer], self.main_format.pack(main)):
            buf[pages, slots] = part
        for buf, part in zip(self.index[layer], self.index_format.pack(index)):
            buf[pages, slots] = part

    def read(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page table ``[B, P]`` -> (main KV ``[B, P*E, hd]``, index K ``[B, P*E, dI]``), float32."""
        return self.read_main(layer, page_table), self.read_index(layer, page_table)

    def read_main(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """Page table ``[B, P]`` -> main KV ``[B, P*E, hd]`` (float32)."""
        return self.main_format.unpack(tuple(buf[page_table].flatten(1, 2) for buf in self.main[layer]))

    def read_index(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """Page table ``[B, P]`` -> index K ``[B, P*E, dI]`` (float32)."""
        return self.index_format.unpack(tuple(buf[page_table].flatten(1, 2) for buf in self.index[layer]))

    def gather_main(self, layer: int, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Main KV of the entries at (page, slot) pairs (any equal shapes ``[...]``) -> ``[..., hd]``
        (float32). Unpacking is per vector, so these are the values :meth:`read_main` hands back
        for the same entries, bit for bit."""
        return self.main_format.unpack(tuple(buf[pages, slots] for buf in self.main[layer]))

    def copy_page(self, src: int, dst: int) -> None:
        for layer in self.layers:
            for buf in (*self.main[layer], *self.index[layer]):
                buf[dst].copy_(buf[src])

    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in (*self.main.values(), *self.index.values()) for t in bufs)

    def bytes_per_token(self) -> float:
        """Bytes of allocated global KV per token of context (all Full layers)."""
        return self.buffer_bytes() / (self.num_pages * self.page_tokens)


class SWAStore:
    """Ring buffers of the last ``window_size`` SWA KV vectors of every layer, one slot per request."""

    def __init__(self, config: V41Config, num_slots: int, device: torch.device):
        self.window, self.num_slots = config.window_size, num_slots
        self.format: VectorFormat = vector_format(config.fp8_swa_kv, "fp8", config.head_dim)
        self.rings = {spec.index: self.format.allocate((num_slots, config.window_size), device)
                      for spec in config.plan}
        self.free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        if not self.free:
            raise OutOfPages("no free SWA slot")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[B]`` slots -> their rings ``[B, W, hd]`` (float32, ring order)."""
        return self.format.unpack(self.read_packed(layer, slots))

    def read_packed(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[B]`` slots -> the stored parts of their rings ``[B, W, ...]`` (ring order)."""
        return tuple(buf[slots] for buf in self.rings[layer])

    def write(self, layer: int, slots: torch.Tensor, ring_index: torch.Tensor, values: torch.Tensor) -> None:
        self.write_packed(layer, slots, ring_index, self.format.pack(values))

    def write_packed(self, layer: int, slots: torch.Tensor, ring_index: torch.Tensor,
                     parts: tuple[torch.Tensor, ...]) -> None:
        """Store already packed vectors (:meth:`VectorFormat.pack`) at (slot, ring index) pairs."""
        for buf, part in zip(self.rings[layer], parts):
            buf[slots, ring_index] = part

    def copy_slot(self, src: int, dst: int) -> None:
        for bufs in self.rings.values():
            for buf in bufs:
                buf[dst].copy_(buf[src])

    def bytes_per_slot(self) -> int:
        """SWA state bytes of one request (all layers), from the allocated buffers."""
        return sum(t[0].numel() * t.element_size() for bufs in self.rings.values() for t in bufs)


@dataclass
class SequenceKV:
    """What the cache holds for one request, and how far each part reaches."""

    swa_slot: int
    """This request's SWA ring slot."""
    pages: list[int] = field(default_factory=list)
    """Global-KV page table: page i holds tokens [i*T, (i+1)*T)."""
    kv_tokens: dict[int, int] = field(default_factory=dict)
    """Full layer -> tokens its compressor has consumed (entries = kv_tokens // m)."""
    partial: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    """Full layer -> compressor projections (kv, gate) [p, hd] of the incomplete block (p < m)."""
    decoder_from: int = 0
    """Decoder layers run on positions >= this (decoder bounded replay of the prompt, §3.2.2)."""
    hashed_pages: int = 0
    """Leading complete pages already indexed in the prefix cache."""
    speculation: "object | None" = None
    """While a verification forward runs (:meth:`V41Executor.begin_speculation`): what it overwrites,
    and the compressor projections of its tokens, so that :meth:`V41Executor.rollback` restores
    the cache of the rejected drafts exactly."""
    swa_from: tuple[int, int] = (0, 0)
    """First position whose SWA KV exists, for encoder and decoder layers (§3.2.2 bounded replay:
    a query at i attends to SWA keys in [max(s, i-W+1), i]); 0 = exact state."""
