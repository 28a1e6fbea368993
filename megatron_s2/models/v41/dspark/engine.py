"""DSpark in the inference engine: the drafter's per-request window and its proposals (§2.4.3).

Each request (by its SWA slot) owns, for every drafter block, a ring of the last
``window_size`` main-KV vectors — ``rope(kv_norm(wkv(main_x)))`` of the positions the backbone
has computed, position p at ring index p mod W, as the reference's ``DSparkAttention`` keeps
its ``kv_cache``. The executor pushes the target layers' outputs of every computed token
(prompt chunks, plain decodes, and the *kept* prefix of a verification); the rows of rejected
drafts are never pushed, so the drafter never sees a token the backbone did not keep.

Pushed rows wait in a per-slot backlog and enter the rings in one batched projection —
``main_kv(main_input(rows))`` for every slot at once — when the drafter next proposes, or when a
slot's backlog spans ``W`` positions: while the engine's schedule decodes
plainly (drafting would not pay, :mod:`megatron_s2.inference.speculation_schedule`), keeping the
drafter current costs a few tensor views per step instead of two small projections per request.

:meth:`DSparkEngineDrafter.propose` runs the drafter over every decoding request at once:
block ``[seed, noise, ...]`` at positions ``P .. P+K-1`` (``P`` = ``num_computed``, the seed is
the request's last, not yet computed token) against its ring (positions ``P-W .. P-1``;
positions before the first one pushed — a resumed prefix — are masked). The Markov bias and the
confidence head are applied by the engine's sampling loop, position by position.
"""

from __future__ import annotations

import torch

from megatron_s2.models.family.engine import Drafter

__all__ = ["DSparkEngineDrafter"]

_NONE = 1 << 62  # "no row pushed yet"


class DSparkEngineDrafter(Drafter):
    def __init__(self, model, num_slots: int, device: torch.device):
        self.model, self.drafter = model, model.dspark
        cfg = model.config
        self.block_size, self.window = cfg.dspark_block_size, cfg.window_size
        self.targets = tuple(cfg.dspark_target_layer_ids)
        self.rings = [torch.zeros(num_slots, self.window, cfg.head_dim, device=device)
                      for _ in range(cfg.dspark_layers)]
        self.first = [_NONE] * num_slots   # first position pushed into the slot's rings
        self.backlog: dict[int, list[tuple[int, torch.Tensor]]] = {}  # slot -> [(start, target rows)] not in its rings yet
        self.device = device

    # ---- state ---------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """A new request takes ``slot``: nothing of the previous one stays visible."""
        self.first[slot] = _NONE
        self.backlog.pop(slot, None)

    def target_rows(self, capture: dict[int, torch.Tensor]) -> torch.Tensor:
        """The forward's recorded target-layer outputs, concatenated: [B, S, d * targets]."""
        return torch.cat([capture[i] for i in self.targets], dim=-1)

    def push(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Target rows [n, d * targets] of positions ``start .. start+n-1``, for the slot's rings."""
        if not rows.size(0):
            return
        if self.first[slot] == _NONE:
            self.first[slot] = start
        queue = self.backlog.setdefault(slot, [])
        queue.append((start, rows))
        if start + rows.size(0) - queue[0][0] >= self.window:  # bound what a long plain stretch keeps alive:
            self.flush(list(self.backlog))                      # every slot's backlog at once (they move together)

    @torch.no_grad()
    def flush(self, slots) -> None:
        """The backlog of ``slots`` into their rings: one projection for all of them."""
        rows, positions, owners = [], [], []
        for slot in slots:
            queue = self.backlog.pop(slot, None)
            if not queue:
                continue
            slot_rows = torch.cat([r for _, r in queue])
            slot_pos = torch.cat([torch.arange(s, s + r.size(0), device=self.device) for s, r in queue])
            keep = min(slot_rows.size(0), self.window)  # only the newest W positions stay in a ring
            rows.append(slot_rows[-keep:])
            positions.append(slot_pos[-keep:])
            owners.append(torch.full((keep,), slot, dtype=torch.long, device=self.device))
        if not rows:
            return
        main_x = self.drafter.main_input(torch.cat(rows).float()).unsqueeze(0)
        pos, owner = torch.cat(positions), torch.cat(owners)
        for stage, ring in enumerate(self.rings):
            kv = self.drafter.main_kv(stage, main_x, pos.unsqueeze(0))[0]
            ring[owner, pos % self.window] = kv.to(ring.dtype)

    # ---- Drafter ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, requests: list) -> tuple[torch.Tensor, torch.Tensor]:
        dev, w, k = self.device, self.window, self.block_size
        self.flush([r.kv.swa_slot for r in requests])
        slots = torch.tensor([r.kv.swa_slot for r in requests], dtype=torch.long, device=dev)
        seeds = torch.tensor([r.tokens[r.num_computed] for r in requests], dtype=torch.long, device=dev)
        start = torch.tensor([r.num_computed for r in requests], dtype=torch.long, device=dev)
        first = torch.tensor([self.first[r.kv.swa_slot] for r in requests], dtype=torch.long, device=dev)
        # ring index j holds position P-1 - ((P-1-j) mod W): valid from the first pushed position on
        j = torch.arange(w, device=dev)
        held = start.unsqueeze(1) - 1 - (start.unsqueeze(1) - 1 - j) % w
        valid = (held >= first.clamp_max(_NONE).unsqueeze(1)) & (held >= 0)
        block_pos = start.unsqueeze(1) + torch.arange(k, device=dev)
        out = self.drafter.forward_blocks(self.drafter.block_inputs(seeds), block_pos,
                                          [ring[slots] for ring in self.rings], valid,
                                          self.model.dspark_embed, self.model.dspark_head)
        return out.base_logits, out.hidden

    @torch.no_grad()
    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.markov(previous)

    @torch.no_grad()
    def confidence(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.drafter.confidence_logits(hidden, embeds))
