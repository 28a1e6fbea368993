"""Context parallelism: load-balanced sequence chunks and the gathers CSA2 needs (report §3.1.2).

Each sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so causal attention work is balanced across ranks. Tokens keep their global
positions, and every attention rule (causal window, compressed-entry visibility, documents)
is written in positions, so a chunk computes exactly what the full sequence would:

* compressed main KV and index K are small: the per-token compressor projections are
  all-gathered over the CP group (reduce-scatter in backward) and pooled on every rank, so
  compression groups straddling a chunk boundary are pooled exactly;
* the sliding window needs only the ``n_win`` tokens before each local chunk: a halo of every
  chunk's tail is all-gathered (reduce-scatter in backward);
* per-query work (queries, indexer scores, top-k, candidate pools) stays local;
* the DSpark drafter (§2.4.3) drafts from the anchors of the local chunks: it reads the target
  layers' window before each chunk (the same halo) and the backbone's distributions at the ``K``
  rows after each chunk (the head of the next chunk, :func:`rows_after_chunks`).

The full token ids, document ids, position ids and loss mask travel with the micro-batch (Engram hashes n-grams that
cross chunk boundaries; documents decide visibility of gathered keys). Image inputs (per row:
the images this rank owns, placeholders for the others) become a
:class:`~megatron_s2.parallel.image_sharding.ShardedImages` holding the local chunks' positions.
"""

from __future__ import annotations

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.image_sharding import ShardedImages

__all__ = ["local_chunk_positions", "split_micro_batch", "gather_sequence_ordered", "window_keys_with_halo",
           "rows_after_chunks"]


def local_chunk_positions(seq: int, cp: Group, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions held by this CP rank (chunk r then chunk 2cp-1-r)."""
    chunk = seq // (2 * cp.size)
    a, b = cp.rank, 2 * cp.size - 1 - cp.rank
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk, device=device),
                      torch.arange(b * chunk, (b + 1) * chunk, device=device)])


def split_micro_batch(mb: dict[str, torch.Tensor], cp: Group) -> dict[str, torch.Tensor]:
    if not cp.active:
        return mb
    seq = mb["tokens"].size(1)
    device = mb["tokens"].device
    idx = local_chunk_positions(seq, cp, device)
    out = {k: (v.index_select(1, idx) if torch.is_tensor(v) and v.dim() >= 2 and v.size(1) == seq else v)
           for k, v in mb.items()}
    positions = mb.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=device).expand_as(mb["tokens"])
    out["position_ids"] = positions.index_select(1, idx)
    out["full_tokens"] = mb["tokens"]
    out["full_doc_ids"] = mb.get("doc_ids")
    out["full_position_ids"] = positions
    if mb.get("loss_mask") is not None:  # the drafter's rollout states (draft_objective) cross chunks
        out["full_loss_mask"] = mb["loss_mask"]
    out["full_image_mask"] = mb.get("image_mask")
    if mb.get("images") is not None:  # each rank encodes its own images, spans exchanged (image_sharding)
        out["images"] = ShardedImages(mb["images"], idx, cp)
    out["full_seq"] = seq
    return out


def gather_sequence_ordered(t: torch.Tensor, positions: torch.Tensor, cp: Group) -> torch.Tensor:
    """All-gather per-token tensors [b, s_local, ...] over CP and put them in position order."""
    if not cp.active:
        return t
    full = mappings.all_gather_sequence(t, cp, dim=1)
    pos = mappings.gather_from_group(positions[:1].contiguous(), cp, dim=1)[0]
    return full.index_select(1, torch.argsort(pos))


def window_keys_with_halo(kv: torch.Tensor, positions: torch.Tensor, window: int, cp: Group):
    """Window keys of the local chunks plus the ``window`` tokens before each chunk.

    kv: [b, s_local, d] (two chunks). Returns (keys [b, 2(W + c), d], key positions [b, 2(W + c)]),
    positions ascending.
    """
    b, s, d = kv.shape
    c = s // 2
    if c < window:
        raise ValueError(f"context parallel chunks of {c} tokens are shorter than the window {window}; "
                         "use fewer CP ranks or longer sequences")
    tails = torch.stack([kv[:, c - window:c], kv[:, s - window:]], dim=1)  # [b, 2, W, d]
    gathered = mappings.all_gather_sequence(tails, cp, dim=1)               # [b, 2cp, W, d]
    n = 2 * cp.size

    def tail_of(chunk: int) -> torch.Tensor:
        if chunk < 0:
            return kv.new_zeros(b, window, d)
        rank = chunk if chunk < cp.size else n - 1 - chunk
        return gathered[:, 2 * rank + (0 if chunk < cp.size else 1)]

    ca, cb = cp.rank, n - 1 - cp.rank
    keys = torch.cat([tail_of(ca - 1), kv[:, :c], tail_of(cb - 1), kv[:, c:]], dim=1)
    w = torch.arange(window, device=kv.device)
    pos = torch.cat([ca * c - window + w, positions[0, :c], cb * c - window + w, positions[0, c:]])
    return keys, pos.unsqueeze(0).expand(b, -1)


def rows_after_chunks(t: torch.Tensor, n: int, cp: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``t`` [b, s_local, ...] (two chunks) with the ``n`` rows after each chunk: the
    head of the next chunk, held by another rank (zeros past the sequence end). Not
    differentiable (the drafter's targets are detached).

    Returns (rows [b, 2(c + n), ...], their sequence rows [2(c + n)]), the mirror of
    :func:`window_keys_with_halo`'s halo before each chunk.
    """
    c = t.size(1) // 2
    if c < n:
        raise ValueError(f"context parallel chunks of {c} tokens are shorter than the {n} rows needed after "
                         "each; use fewer CP ranks or longer sequences")
    t = t.detach()
    heads = torch.stack([t[:, :n], t[:, c:c + n]], dim=1)                  # [b, 2, n, ...]
    gathered = mappings.all_gather_sequence(heads, cp, dim=1)               # [b, 2cp, n, ...]
    last = 2 * cp.size

    def head_of(chunk: int) -> torch.Tensor:
        if chunk >= last:
            return t.new_zeros(t.size(0), n, *t.shape[2:])
        rank = chunk if chunk < cp.size else last - 1 - chunk
        return gathered[:, 2 * rank + (0 if chunk < cp.size else 1)]

    ca, cb = cp.rank, last - 1 - cp.rank
    rows = torch.cat([t[:, :c], head_of(ca + 1), t[:, c:], head_of(cb + 1)], dim=1)
    ar_c, ar_n = torch.arange(c, device=t.device), torch.arange(n, device=t.device)
    where = torch.cat([ca * c + ar_c, (ca + 1) * c + ar_n, cb * c + ar_c, (cb + 1) * c + ar_n])
    return rows, where

