"""Context parallelism for the hybrid: Gated DeltaNet by state passing, gated attention by gathered
keys (issue 23, "CP for Gated DeltaNet by state passing").

The sequence is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r``
(:mod:`megatron_s2.parallel.context_parallel`, the load-balanced split every family's batches
get). Per chunk, the delta rule is affine in the state it starts from::

    S_out = T S_in + B,        o_t = o_t^local + Q_t S_in

(``T``: d_k x d_k, the product of every token's ``a_t (I - beta_t k_t k_t^T)``; ``B``: the
chunk's own writes from an empty memory; ``Q_t``: how token ``t``'s output reads ``S_in``). One
run of the chunked rule on the augmented state ``[S | M]``, started at ``[0 | I]`` with zero
values in the ``M`` columns, yields all of them: its state ends at ``[B | T]`` and its output
is ``[o^local | Q]`` (:func:`chunk_transfer`). The ranks all-gather ``(T, B)`` of every chunk
(``2 cp`` small matrices per head; reduce-scatter in backward), run the ``2 cp``-step recursion
``S_in(c+1) = T_c S_in(c) + B_c`` in chunk order — cut to zero where a document starts at a
chunk boundary — and add ``Q S_in`` to their outputs: the single-rank forward and backward.

The short convolution needs the ``K-1`` inputs before each chunk: a halo of every chunk's tail,
all-gathered (:func:`~megatron_s2.parallel.context_parallel.window_keys_with_halo`). Full
attention all-gathers keys and values in position order and masks by global positions (and
documents).
"""

from __future__ import annotations

import torch

from megatron_s2.models.intern_s2.gated_delta import causal_conv1d, lean_chunk_gated_delta_rule
from megatron_s2.parallel import mappings
from megatron_s2.parallel.context_parallel import gather_sequence_ordered, window_keys_with_halo
from megatron_s2.parallel.groups import Group

__all__ = ["chunk_transfer", "cp_causal_conv1d", "cp_gated_delta_rule", "cp_attention_keys"]


def chunk_transfer(q, k, v, g, beta, *, chunk_size: int, doc_ids=None):
    """(o_local [b, s, Hv, dv], Q [b, s, Hv, dk], T [b, Hv, dk, dk], B [b, Hv, dk, dv]) of one
    contiguous chunk (module docstring)."""
    b, s, hv, dv = v.shape
    dk = k.size(-1)
    dtype = torch.promote_types(v.dtype, torch.float32)
    v_aug = torch.cat([v.to(dtype), v.new_zeros(b, s, hv, dk, dtype=dtype)], dim=-1)
    eye = torch.eye(dk, dtype=dtype, device=v.device).expand(b, hv, dk, dk)
    start = torch.cat([torch.zeros(b, hv, dk, dv, dtype=dtype, device=v.device), eye], dim=-1)
    out, state = lean_chunk_gated_delta_rule(q, k, v_aug, g, beta, chunk_size=chunk_size, initial_state=start,
                                             doc_ids=doc_ids)
    return out[..., :dv], out[..., dv:], state[..., dv:], state[..., :dv]


def _chunk_of(entry: int, cp: Group) -> int:
    """Chunk index of gathered entry ``entry`` (rank ``entry // 2``: its chunk r, then 2cp-1-r)."""
    rank, second = divmod(entry, 2)
    return 2 * cp.size - 1 - rank if second else rank


def cp_gated_delta_rule(q, k, v, g, beta, *, chunk_size: int, cp: Group, doc_ids=None, full_doc_ids=None):
    """The delta rule over this rank's two chunks ``[b, 2c, ...]`` equal to the full sequence's."""
    s = v.size(1)
    c = s // 2
    parts = []
    for lo, hi in ((0, c), (c, s)):
        docs = doc_ids[:, lo:hi] if doc_ids is not None else None
        parts.append(chunk_transfer(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                    chunk_size=chunk_size, doc_ids=docs))
    dv = v.size(-1)
    local = torch.stack([torch.cat([p[3], p[2]], dim=-1) for p in parts], dim=1)   # [b, 2, Hv, dk, dv+dk]
    gathered = mappings.all_gather_sequence(local.contiguous(), cp, dim=1)        # [b, 2cp, ...]
    by_chunk = {_chunk_of(j, cp): gathered[:, j] for j in range(gathered.size(1))}
    n = 2 * cp.size
    keep = None
    if full_doc_ids is not None:  # a document starting at chunk c's first token: nothing carries in
        starts = torch.arange(1, n, device=v.device) * c
        keep = (full_doc_ids[:, starts] == full_doc_ids[:, starts - 1]).to(gathered.dtype)  # [b, n-1]
    state, incoming = torch.zeros_like(by_chunk[0][..., :dv]), {0: None}
    for chunk in range(n - 1):
        pair = by_chunk[chunk]
        state = pair[..., dv:] @ state + pair[..., :dv] if chunk else pair[..., :dv]
        if keep is not None:
            state = state * keep[:, chunk, None, None, None]
        incoming[chunk + 1] = state
    outs = []
    for (o_local, read, _, _), chunk in zip(parts, (cp.rank, n - 1 - cp.rank)):
        s_in = incoming[chunk]
        outs.append(o_local if s_in is None else o_local + torch.einsum("bthk,bhkv->bthv", read, s_in))
    return torch.cat(outs, dim=1).to(v.dtype)


def cp_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cp: Group,
                     full_doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The causal convolution of this rank's two chunks ``x`` [b, 2c, C] with the K-1 inputs before
    each chunk taken from its neighbour (a gathered halo)."""
    halo = weight.size(1) - 1
    if halo == 0:
        return causal_conv1d(x, weight)[0]
    keys, key_pos = window_keys_with_halo(x, positions, halo, cp)         # [b, 2(W + c), C]
    docs = None
    if full_doc_ids is not None:
        docs = full_doc_ids.gather(1, key_pos.clamp(min=0))
        docs = docs.masked_fill(key_pos < 0, -1)
    y, _ = causal_conv1d(keys, weight, doc_ids=docs)
    c = x.size(1) // 2
    return torch.cat([y[:, halo:halo + c], y[:, 2 * halo + c:]], dim=1)


def cp_attention_keys(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cp: Group,
                      doc_ids: torch.Tensor | None, full_doc_ids: torch.Tensor | None):
    """Every key / value of the sequence in position order and the mask ``[b, s_local, S]`` of
    what each local query may attend (causal in global positions, same document)."""
    keys, values = gather_sequence_ordered(k, positions, cp), gather_sequence_ordered(v, positions, cp)
    key_pos = torch.arange(keys.size(1), device=k.device)
    allowed = key_pos.view(1, 1, -1) <= positions.unsqueeze(-1)
    if doc_ids is not None and full_doc_ids is not None:
        allowed = allowed & (full_doc_ids.unsqueeze(1) == doc_ids.unsqueeze(-1))
    return keys, values, allowed
