"""One incremental forward's view of the cache: the ``ctx.kv_cache`` of the attention layers.

The attention forward (:class:`~megatron_s2.models.v41.attention.csa2.CSA2Attention`) is the
training code path; with ``ctx.kv_cache`` set, the only two places where keys come from
earlier tokens call this object instead of looking at the sequence:

* :meth:`KVCacheStep.window` — the request's cached ring (positions start-W .. start-1)
  followed by this chunk's SWA KV, and each query's window indices into them (the very
  :func:`window_indices` rule of training, with positions below the bounded-replay start
  ``swa_from`` missing, §3.2.2); then the newest W vectors of the chunk go into the ring.
  A decode step (one token per row) reads the ring as stored and writes one slot, with
  indices built once per step (:meth:`KVCacheStep._decode_window`): no re-gather into
  position order, no host sync.
* :meth:`KVCacheStep.compress` — this chunk's compressor projections joined to the carried
  partial block; every block of m that completes is pooled, RoPE'd and projected to index
  keys by the layer's own pieces (entry j at position j*m), stored packed, and the partial
  rest carried; then every entry's index key is read back (dequantised): the indexers of
  Full and Reindex layers score them all. The main KV is read back whole for a prefill chunk;
  a decode step leaves it packed in its pages (:class:`PagedEntries`) and
  :meth:`KVCacheStep.attended_entries` unpacks only the top-k entries the query attends to
  (§2.3: a query reads the window and its top-k blocks, never the whole compressed cache), so
  the step's main-KV work is proportional to top-k, not to the context. Tokens below the
  request's ``kv_tokens`` (bounded replay of a cached prefix) regenerate SWA KV only: their
  global KV is reused, never recomputed or overwritten (§3.2.2).

Rows are requests, padded on the right to a common length: padded tokens continue the
positions past the real ones, so no real query can see them (keys are causal) and they are
never stored.
"""

from __future__ import annotations

import torch

from megatron_s2.kernels.precision import cast
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.models.v41.attention.visibility import window_indices

__all__ = ["KVCacheStep", "PagedEntries"]

_MISSING = 1 << 40  # shifts positions of missing window keys out of reach (keeps them ascending)


class KVCacheStep:
    def __init__(self, global_kv: GlobalKVStore, swa: SWAStore, seqs: list[SequenceKV],
                 positions: torch.Tensor, valid: torch.Tensor):
        """``positions`` / ``valid``: ``[B, S]`` positions of the row's tokens and which are real."""
        self.global_kv, self.swa, self.seqs = global_kv, swa, seqs
        self.positions, self.valid = positions, valid
        self.device = positions.device
        self.lengths = valid.sum(1)
        self.start = positions[:, 0]
        self._start_host, self._length_host = self.start.tolist(), self.lengths.tolist()  # one sync
        self.slots = torch.tensor([s.swa_slot for s in seqs], dtype=torch.long, device=self.device)
        # a decode step (one token per row, no padding): every layer takes the fast window path,
        # whose indices depend only on the layer group (encoder / decoder) and are built once
        self.decode = positions.size(1) == 1
        self._decode_indices: dict[int, torch.Tensor] = {}

    # ---- sliding window ------------------------------------------------------------------------
    def window(self, attn, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decode:
            return self._decode_window(attn, kv)
        layer, w = attn.spec.index, self.swa.window
        b, s, hd = kv.shape
        ar = torch.arange(w, device=self.device)
        ring = self.swa.read(layer, self.slots)                          # [B, W, hd] ring order
        order = (self.start.unsqueeze(1) + ar) % w                      # position start-W+j at (start+j) % W
        cached = ring.gather(1, order.unsqueeze(-1).expand(-1, -1, hd))
        cached_pos = self.start.unsqueeze(1) - w + ar
        group = 0 if attn.spec.is_encoder else 1
        swa_from = torch.tensor([seq.swa_from[group] for seq in self.seqs], device=self.device)
        cached_pos = torch.where(cached_pos < swa_from.unsqueeze(1), cached_pos - _MISSING, cached_pos)
        keys = torch.cat([cast(cached, kv.dtype), self._stored(kv)], dim=1)
        indices = window_indices(positions, torch.cat([cached_pos, positions], dim=1), w)
        # the newest W real tokens of the chunk go into the ring
        end = self.start + self.lengths
        write = self.valid & (positions >= (end - w).unsqueeze(1))
        rows, cols = write.nonzero(as_tuple=True)
        if rows.numel():
            self.swa.write(layer, self.slots[rows], positions[rows, cols] % w, kv[rows, cols])
        return keys, indices

    def _decode_window(self, attn, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row at position p: the keys are the ring as stored (slot j holds
        position p-W+((j-p) mod W); nothing is re-gathered into position order) followed by the
        new token; its window lists key W (itself), then ring slot (p-j) mod W for j = 1..W-1 —
        the order :func:`window_indices` gives, so the attention sums in the same order — with
        -1 below position 0 and below the bounded-replay start. Then one ring slot is written.

        The new vectors are packed once, for the keys and for the ring write, and the ring and
        them are unpacked together: unpacking is per vector, so unpack(cat) = cat(unpack) bit for
        bit, in half the operators of reading, round-tripping and writing separately."""
        layer, fmt = attn.spec.index, self.swa.format
        new = fmt.pack(kv)                                 # [B, 1, ...] parts
        ring = self.swa.read_packed(layer, self.slots)     # [B, W, ...], a copy: the write cannot reach it
        keys = cast(fmt.unpack(tuple(torch.cat(pair, dim=1) for pair in zip(ring, new))), kv.dtype)
        group = 0 if attn.spec.is_encoder else 1
        indices = self._decode_indices.get(group)
        if indices is None:
            indices = self._decode_indices[group] = self._decode_window_indices(group)
        self.swa.write_packed(layer, self.slots, self.start % self.swa.window, tuple(p[:, 0] for p in new))
        return keys, indices

    def _decode_window_indices(self, group: int) -> torch.Tensor:
        w = self.swa.window
        offsets = torch.arange(w, device=self.device)
        target = self.start.unsqueeze(1) - offsets                       # [B, W] positions p - j
        lowest = torch.tensor([max(0, seq.swa_from[group]) for seq in self.seqs], device=self.device)
        slot = torch.where(offsets == 0, w, target % w)
        return torch.where(target >= lowest.unsqueeze(1), slot, -1).unsqueeze(1)  # [B, 1, W]

    def _stored(self, kv: torch.Tensor) -> torch.Tensor:
        """The values the cache will hand back for these vectors (packing round trip)."""
        fmt = self.swa.format
        return cast(fmt.unpack(fmt.pack(kv)), kv.dtype)

    # ---- compressed main KV ----------------------------------------------------------------------
    def compress(self, attn, kv: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        layer, m = attn.spec.index, attn.spec.compress_ratio
        geo = self.global_kv.layers[layer]
        groups_kv, groups_gate, entry_ids, owners = [], [], [], []
        for r, seq in enumerate(self.seqs):
            start, length = self._start_host[r], self._length_host[r]
            done = seq.kv_tokens.get(layer, 0)
            if done >= start + length:
                continue  # replayed tokens: their global KV is cached already
            if done < start:
                raise RuntimeError(f"layer {layer}: request's compressor stopped at token {done}, "
                                   f"but this chunk starts at {start}")
            new_kv = kv[r, done - start:length]
            new_gate = gate[r, done - start:length] if gate is not None else None
            held_kv, held_gate = seq.partial.get(layer, (None, None))
            if held_kv is not None:
                new_kv = torch.cat([held_kv, new_kv])
                new_gate = torch.cat([held_gate, new_gate]) if gate is not None else None
            if seq.speculation is not None:  # a verification: rollback rebuilds the partial block from these
                seq.speculation.rows[layer] = (new_kv, new_gate, done - (new_kv.size(0) - (length - (done - start))))
            complete = new_kv.size(0) // m
            first_entry = done // m
            if complete:
                groups_kv.append(new_kv[:complete * m])
                if gate is not None:
                    groups_gate.append(new_gate[:complete * m])
                entry_ids.append(torch.arange(first_entry, first_entry + complete, device=self.device))
                owners.append(torch.full((complete,), r, device=self.device))
            rest = complete * m
            seq.partial[layer] = ((new_kv[rest:].clone(), new_gate[rest:].clone() if gate is not None else None)
                                  if rest < new_kv.size(0) else (None, None))
            seq.kv_tokens[layer] = start + length
        if groups_kv:
            self._append(attn, geo, torch.cat(groups_kv), torch.cat(groups_gate) if groups_gate else None,
                         torch.cat(entry_ids), torch.cat(owners))
        table = self._read_table(layer)
        index = self.global_kv.read_index(layer, table)
        if self.decode:  # one query per row: only its top-k entries are unpacked (attended_entries)
            return PagedEntries(self.global_kv, layer, table), index
        return self.global_kv.read_main(layer, table), index

    def attended_entries(self, main_kv: "torch.Tensor | PagedEntries",
                         topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The main-KV entries a CSA2 layer's queries attend to, and their top-k ids into them.

        A prefill chunk's ``main_kv`` is every entry (returned as is, ``topk`` unchanged); a
        decode step's is :class:`PagedEntries`, whose top-k entries are gathered from the pages
        and unpacked: ``[B, k, hd]`` with ids ``0..k-1`` (-1 kept). The attention gathers the
        same key values in the same order either way, so its output is bit for bit the same."""
        if isinstance(main_kv, PagedEntries):
            return main_kv.select(topk)
        return main_kv, topk

    def _append(self, attn, geo, kv: torch.Tensor, gate: torch.Tensor | None, entry_ids: torch.Tensor,
                owners: torch.Tensor) -> None:
        """Pool complete blocks of all requests at once ([1, G*m] -> [1, G]) and store them."""
        latent = attn.compressor.pool(kv.unsqueeze(0), None if gate is None else gate.unsqueeze(0))
        main, index = attn.compressed_entries(latent, (entry_ids * geo.ratio).unsqueeze(0), quantise=False)
        table = self._page_table([len(seq.pages) for seq in self.seqs])
        page_of = table[owners, entry_ids // geo.entries_per_page]
        self.global_kv.write(geo.layer, page_of, entry_ids % geo.entries_per_page, main[0], index[0])

    def _page_table(self, counts: list[int]) -> torch.Tensor:
        """``[B, max(counts)]`` the first ``counts[r]`` pages of each request, padded with page 0."""
        table = torch.zeros(len(self.seqs), max(1, max(counts)), dtype=torch.long, device=self.device)
        for r, (seq, n) in enumerate(zip(self.seqs, counts)):
            if n:
                table[r, :n] = torch.tensor(seq.pages[:n], dtype=torch.long, device=self.device)
        return table

    def _read_table(self, layer: int) -> torch.Tensor:
        """The page table ``[B, P]`` covering every stored entry of ``layer`` of each row."""
        geo = self.global_kv.layers[layer]
        counts = [-(-(seq.kv_tokens.get(layer, 0) // geo.ratio) // geo.entries_per_page) for seq in self.seqs]
        return self._page_table(counts)


class PagedEntries:
    """A Full layer's compressed main KV in one decode step, still packed in its pages.

    It stands where the dequantised ``[B, P*E, hd]`` entries stand in a prefill chunk (it is
    published as the layer's MAIN_KV and consumed by its Reindex / Reuse layers): ``size(1)`` is
    the same entry count, and :meth:`select` unpacks only the entries a top-k selection names.
    Reuse layers attend to the very top-k tensor of the layer they reuse, so the last selection
    is kept and handed to them without a second gather.
    """

    def __init__(self, store: GlobalKVStore, layer: int, page_table: torch.Tensor):
        self.store, self.layer, self.page_table = store, layer, page_table
        self.entries_per_page = store.layers[layer].entries_per_page
        self._last: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def size(self, dim: int) -> int:
        """``size(1)``: the entry count of the dequantised view (``P*E``, pages padded)."""
        if dim != 1:
            raise ValueError(f"PagedEntries.size: only the entry dimension (1) is defined, got {dim}")
        return self.page_table.size(1) * self.entries_per_page

    @property
    def nbytes(self) -> int:
        """What it holds besides the pages: the page table (the shared-state registry's count)."""
        return self.page_table.nbytes

    def select(self, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk [B, 1, k]`` entry ids (-1: none) -> (their main KV ``[B, k, hd]`` float32, the ids
        ``0..k-1`` into it ``[B, 1, k]``, -1 kept)."""
        if self._last is not None and self._last[0] is topk:
            return self._last[1]
        if topk.size(1) != 1:
            raise ValueError(f"PagedEntries.select: one query per row in a decode step, got {topk.size(1)}")
        ids = topk[:, 0].clamp_min(0)                                   # -1 reads entry 0, masked below
        e = self.entries_per_page
        pages = self.page_table.gather(1, torch.div(ids, e, rounding_mode="floor"))
        keys = self.store.gather_main(self.layer, pages, ids.remainder(e))
        local = torch.arange(topk.size(-1), device=topk.device).expand_as(topk)
        picked = (keys, torch.where(topk >= 0, local, -1))
        self._last = (topk, picked)
        return picked
