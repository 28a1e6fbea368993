"""KV tiers (report §3.2.1) and SWA Bounded Replay (§3.2.2), decided when a request is admitted.

* **Persistent global-KV prefix cache.** A global-KV page that is complete (every Full layer
  has all its entries) is indexed by a hash chained over the token ids of every page up to it,
  so a page stands for the whole prefix it ends. Pages stay cached after their request
  finishes and are evicted least-recently-used only when an allocation needs them
  (:class:`~megatron_s2.models.family.engine.PagePool`). A new request reuses the longest chain
  of cached pages of its prompt: the whole cached prefix (leaving at least one prompt token to
  process). A page an image or a series reaches also hashes its content key
  (:func:`~megatron_s2.models.family.engine.prefix_hashes` over ``Request.content_spans``): the
  span's ids are placeholders.
* **Short-TTL SWA pool.** SWA state (every layer's ring, the compressor's partial blocks and
  the page table that goes with them) is copied at two points — after the prompt's
  last-but-one token (so a regeneration of the same prompt resumes there) and at the end of
  the output (so the next turn resumes there) — into one of ``swa_pool_slots`` slots, which
  expires after ``swa_pool_ttl_s`` seconds or when the least recently used slot is needed.
  A request whose tokens extend a live snapshot resumes from it exactly — and whose images and
  series before the snapshot's end are the snapshot's (same start, same content key).
* **Encoder SWA Bounded Replay** (``encoder_bounded_replay``): a prefix hit without an SWA
  snapshot replays the last ``window_size`` tokens of the cached prefix — SWA KV only, the
  cached global KV is reused, never recomputed or overwritten — together with the uncached
  suffix; windows are truncated to start at the replay start s (a query at i attends to SWA
  keys in [max(s, i-W+1), i]). Without it a hit cannot be used exactly, and the prompt runs
  from the start.
* **Decoder SWA Bounded Replay** (``decoder_bounded_replay``): at every prefill the decoder
  layers run only over the last ``window_size`` prompt tokens (their SWA truncated likewise);
  the decoder's global KV is still projected from H_{L/2} for every prompt token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.family.engine import prefix_hashes
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SWAStore

__all__ = ["KVTiers"]


def _image_keys(images, end: int) -> tuple[tuple[int, bytes], ...]:
    """(start, content key) of the images that begin before position ``end``."""
    return tuple((image.start, image.key) for image in images if image.start < end)


@dataclass
class _Snapshot:
    tokens: tuple[int, ...]
    """The processed tokens the state belongs to."""
    images: tuple[tuple[int, bytes], ...]
    """(start, content key) of the images among them (:func:`_image_keys`)."""
    slot: int
    pages: list[int]
    kv_tokens: dict[int, int]
    partial: dict[int, tuple]
    swa_from: tuple[int, int]
    created: float = field(default_factory=time.monotonic)


class KVTiers:
    def __init__(self, config, model: V41Config, global_kv: GlobalKVStore, swa: SWAStore):
        self.config, self.model = config, model
        self.global_kv, self.swa, self.pool = global_kv, swa, global_kv.pool
        self.page_tokens, self.window = config.page_tokens, model.window_size
        self.snapshots: OrderedDict[tuple, _Snapshot] = OrderedDict()  # (tokens, image keys) -> snapshot
        self.hits = {"prefix_pages": 0, "swa_snapshots": 0, "encoder_replays": 0}

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, req) -> None:
        """Set the request's starting state: exact snapshot resume, prefix hit (+ encoder
        replay), or a fresh prefill; and where the decoder starts (decoder replay)."""
        self.expire()
        seq, tokens = req.kv, req.tokens
        req.num_computed, seq.hashed_pages = 0, 0
        # a numerical forecast reads every prompt position's final hidden state: no cached prefix
        if self.config.prefix_caching and getattr(req, "forecast", None) is None:
            snap = self._snapshot_for(req)
            if snap is not None:
                self._restore(req, snap)
            else:
                self._prefix_hit(req)
        p = len(tokens)
        req.kv.decoder_from = 0
        if self.config.decoder_bounded_replay:
            start = max(req.num_computed, p - self.window)
            if start > req.num_computed:
                req.kv.decoder_from = start
                seq.swa_from = (seq.swa_from[0], max(seq.swa_from[1], start))

    def _prefix_hit(self, req) -> None:
        tokens, t = req.tokens, self.page_tokens
        hashes = prefix_hashes(tokens, t, (len(tokens) - 1) // t, req.content_spans)
        pages = []
        for h in hashes:
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        if not pages or not self.config.encoder_bounded_replay:
            return  # exact SWA would need the whole prompt: run it from the start
        for page in pages:
            self.pool.retain(page)
        hit = len(pages) * t
        seq = req.kv
        seq.pages = pages
        seq.kv_tokens = {layer: hit for layer in self.global_kv.layers}
        start = max(0, hit - self.window)
        seq.swa_from = (start, start)
        req.num_computed = start
        req.kv.hashed_pages = len(pages)
        self.hits["prefix_pages"] += len(pages)
        self.hits["encoder_replays"] += 1

    def limit_chunk(self, req, n: int) -> int:
        """With the SWA pool, the prompt's last token runs in a step of its own, so the state
        after the last-but-one token can be snapshotted for a regeneration."""
        if self.config.swa_pool_slots and req.num_generated == 0:
            last = len(req.prompt) - 1
            if req.num_computed < last:
                return min(n, last - req.num_computed)
        return n

    # ---- after a forward / at the end --------------------------------------------------------------
    def after_forward(self, req) -> None:
        if not self.config.prefix_caching:
            return
        seq, t = req.kv, self.page_tokens
        complete = min(seq.kv_tokens.values(), default=req.num_computed) // t
        done = seq.hashed_pages
        if complete > done:
            for i, h in enumerate(prefix_hashes(req.tokens, t, complete, req.content_spans)[done:], start=done):
                self.pool.register(seq.pages[i], h)
            req.kv.hashed_pages = complete
        if (self.config.swa_pool_slots and req.num_generated == 0
                and req.num_computed == len(req.prompt) - 1):
            self._snapshot(req)

    def on_finish(self, req) -> None:
        if self.config.swa_pool_slots and req.num_computed > 0:
            self._snapshot(req)

    # ---- SWA pool ----------------------------------------------------------------------------
    def _snapshot(self, req) -> None:
        tokens = tuple(req.tokens[:req.num_computed])
        images = _image_keys(req.content_spans, req.num_computed)
        key = (tokens, images)
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        while len(self.snapshots) >= self.config.swa_pool_slots:
            self._drop(next(iter(self.snapshots)))
        seq = req.kv
        slot = self.swa.allocate()
        self.swa.copy_slot(seq.swa_slot, slot)
        for page in seq.pages:
            self.pool.retain(page)
        partial = {k: tuple(None if t is None else t.clone() for t in v) for k, v in seq.partial.items()}
        self.snapshots[key] = _Snapshot(tokens, images, slot, list(seq.pages), dict(seq.kv_tokens), partial,
                                        seq.swa_from)

    def _snapshot_for(self, req) -> _Snapshot | None:
        best, tokens = None, req.tokens
        for snap in self.snapshots.values():
            n = len(snap.tokens)
            if (n < len(tokens) and (best is None or n > len(best.tokens)) and tuple(tokens[:n]) == snap.tokens
                    and _image_keys(req.content_spans, n) == snap.images):
                best = snap
        return best

    def _restore(self, req, snap: _Snapshot) -> None:
        seq, n, t = req.kv, len(snap.tokens), self.page_tokens
        self.swa.copy_slot(snap.slot, seq.swa_slot)
        full = n // t
        for page in snap.pages[:full]:
            self.pool.retain(page)
        seq.pages = list(snap.pages[:full])
        if len(snap.pages) > full:  # the page being filled: copy on write
            page = self.pool.allocate()
            self.global_kv.copy_page(snap.pages[full], page)
            seq.pages.append(page)
        seq.kv_tokens = dict(snap.kv_tokens)
        seq.partial = {k: tuple(None if x is None else x.clone() for x in v) for k, v in snap.partial.items()}
        seq.swa_from = snap.swa_from
        req.num_computed = n
        req.kv.hashed_pages = full
        self.snapshots.move_to_end((snap.tokens, snap.images))
        self.hits["swa_snapshots"] += 1

    def _drop(self, key) -> None:
        snap = self.snapshots.pop(key)
        self.swa.release(snap.slot)
        for page in snap.pages:
            self.pool.release(page)

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self.snapshots.items() if now - s.created > self.config.swa_pool_ttl_s]:
            self._drop(key)

    def reclaim(self) -> bool:
        """Free the oldest snapshot (page pressure); False when there is none."""
        if not self.snapshots:
            return False
        self._drop(next(iter(self.snapshots)))
        return True
