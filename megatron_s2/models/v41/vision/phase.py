"""The disaggregated encoder step (report §3.1.1, "End-to-End Parallelism").

The vision encoder is replicated outside the LLM's parameter tree and a training step runs in
three phases:

1. **vision forward** (:func:`encode_images`, before the LLM): every micro-batch's images are
   encoded — under context parallelism only the images this CP rank owns, then the span
   embeddings are all-gathered over the CP group (:mod:`megatron_s2.parallel.image_sharding`).
   The result is cut from the encoder's graph: the LLM receives a leaf tensor of span rows;
2. **LLM forward/backward**, unchanged (any layout): ``embed`` writes the span rows into the
   token embeddings of the rank's positions (:func:`merge_encoded_images`; under CP only the
   parts of each span inside the rank's two chunks), and the LLM backward leaves the span rows'
   gradient on the leaf;
3. **vision backward** (:meth:`EncodedImages.backward`, after the LLM): the leaf's gradient
   runs back through the exchange (each owner receives the summed gradient of its own spans)
   and the encoder.

The LLM phase is thus free of vision computation and keeps the parallel strategy of text-only
training; the vision phases are where image load balancing happens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.image_sharding import RemoteImage, ShardedImages, gather_image_spans

__all__ = ["EncodedImages", "encode_images", "merge_encoded_images", "merge_sharded_image_embeddings", "merge_images"]


@dataclass
class EncodedImages:
    """Span rows of a micro-batch's images and where they go (phase 1's result)."""

    spans: torch.Tensor
    """[rows, d]: every image's span embeddings, owners' blocks in rank order."""
    rows: torch.Tensor
    """Sequence (batch row) of each span row."""
    positions: torch.Tensor
    """Global position of each span row in its sequence."""
    local_positions: torch.Tensor | None
    """Under CP: the global positions of this rank's tokens (its two chunks); None: whole rows."""
    graph: torch.Tensor | None = None
    """The encoder's output when :attr:`spans` is a detached leaf: phase 3 backpropagates into it."""

    def backward(self) -> None:
        """Phase 3: the LLM's gradient of the span rows through the exchange and the encoder.
        Collective under CP (every rank of the group calls it, with zeros where its chunks held
        no span position)."""
        if self.graph is None or not self.graph.requires_grad:
            return
        grad = self.spans.grad if self.spans.grad is not None else torch.zeros_like(self.spans)
        torch.autograd.backward(self.graph, grad)


def encode_images(images, encoder, dtype: torch.dtype, *, detach: bool = True) -> EncodedImages | None:
    """Phase 1 for one micro-batch: ``images`` as ``model.embed`` takes them (per-row image lists,
    or a :class:`ShardedImages` under CP). ``detach``: cut the result from the encoder's graph
    (the disaggregated step); False keeps the graph (one-call forward, e.g. evaluation)."""
    group, local_positions, rows_of_images = Group.single(), None, images
    if isinstance(images, ShardedImages):
        group, local_positions, rows_of_images = images.group, images.positions, images.rows
    owned, placed = [], []  # placed: (row, start, length, owner) of every image, in plan order
    for i, row in enumerate(rows_of_images):
        for image in row or ():
            if isinstance(image, RemoteImage):
                placed.append((i, image.start, image.length, image.owner))
            else:
                owned.append(encoder.span_embeddings(image, dtype))
                placed.append((i, image.start, owned[-1].size(0), group.rank))
    if not placed:
        return None
    counts = [sum(length for _, _, length, owner in placed if owner == r) for r in range(group.size)]
    if owned:
        local = torch.cat(owned)
    else:  # no image of ours: still give every trainable encoder parameter a (zero) gradient, so
        # the replicas' gradient all-reduce sums the same tensors on every rank
        tie = sum(p.sum() for p in encoder.parameters() if p.requires_grad) * 0.0
        local = torch.zeros(0, encoder.config.hidden_size, dtype=dtype, device=encoder.image_start.device) + tie
    spans = gather_image_spans(local, counts, group)  # owners' blocks in rank order, each in plan order
    block_start = [sum(counts[:r]) for r in range(group.size)]
    order, rows, positions = [], [], []
    for i, start, length, owner in placed:
        order.append(torch.arange(block_start[owner], block_start[owner] + length))
        rows.append(torch.full((length,), i))
        positions.append(torch.arange(start, start + length))
        block_start[owner] += length
    spans = spans.index_select(0, torch.cat(order).to(spans.device))  # plan order
    graph = None
    if detach:
        graph, spans = spans, spans.detach().requires_grad_(spans.requires_grad)
    return EncodedImages(spans, torch.cat(rows), torch.cat(positions), local_positions, graph)


def merge_encoded_images(h: torch.Tensor, encoded: EncodedImages) -> torch.Tensor:
    """Token embeddings [b, s_local, d] with the span rows that fall on this rank's positions
    written in (out of place: gradients reach the span rows and every other position's embedding)."""
    rows, positions, picks = encoded.rows, encoded.positions, torch.arange(encoded.positions.numel())
    if encoded.local_positions is not None:  # CP: global position -> index in the local chunks
        where = torch.full((int(max(encoded.local_positions.max(), positions.max())) + 1,), -1, dtype=torch.long)
        where[encoded.local_positions.cpu()] = torch.arange(encoded.local_positions.numel())
        local = where[positions]
        keep = local >= 0
        rows, positions, picks = rows[keep], local[keep], picks[keep]
    if positions.numel() and int(positions.max()) >= h.size(1):
        raise ValueError(f"an image span runs past the {h.size(1)} positions of its sequence")
    values = encoded.spans.index_select(0, picks.to(encoded.spans.device)).to(h.dtype)
    if not picks.numel():  # no span position here; keep the span rows in the graph for phase 3
        return h + encoded.spans.sum().to(h.dtype) * 0.0
    return h.index_put((rows.to(h.device), positions.to(h.device)), values)


def merge_sharded_image_embeddings(h: torch.Tensor, sharded: ShardedImages, encoder) -> torch.Tensor:
    """Context parallelism in one call (vision forward inside ``embed``, its backward with the
    LLM's): this rank's chunk embeddings [b, s_local, d] with the image spans merged."""
    encoded = encode_images(sharded, encoder, h.dtype, detach=False)
    return h if encoded is None else merge_encoded_images(h, encoded)


def merge_images(h: torch.Tensor, images, encoder, sp_slice: tuple[int, int] | None = None) -> torch.Tensor:
    """``embed``'s image merge for any form of image input: encoded by phase 1 (the training step),
    sharded across CP ranks (encoded here), or per-row image lists (encoded here, whole rows).

    ``sp_slice``: (tp rank, tp size) under sequence parallelism, where ``h`` [b, s / tp, d] holds
    the rank's contiguous slice of the (CP-local) sequence; only the span rows that fall there are
    written. Every tp rank encodes the same images, so each holds a partial sum of the encoder's
    gradient (its slice's share) that the finaliser all-reduces over tp (the ``vision`` rules of
    :mod:`megatron_s2.models.v41.parallel_plan` are partial under SP)."""
    if sp_slice is None:
        if isinstance(images, EncodedImages):
            return merge_encoded_images(h, images)
        if isinstance(images, ShardedImages):
            return merge_sharded_image_embeddings(h, images, encoder)
        from megatron_s2.models.v41.vision.tower import merge_image_embeddings

        return merge_image_embeddings(h, images, encoder)
    encoded = images if isinstance(images, EncodedImages) else encode_images(images, encoder, h.dtype, detach=False)
    if encoded is None:
        return h
    rank, size = sp_slice
    n = h.size(1)
    chunk = (encoded.local_positions if encoded.local_positions is not None
             else torch.arange(n * size, device=encoded.positions.device))  # the pre-SP local sequence
    if chunk.numel() != n * size:
        raise ValueError(f"sequence parallelism: {chunk.numel()} local positions do not split into {size} slices "
                         f"of {n}")
    return merge_encoded_images(h, replace(encoded, local_positions=chunk[rank * n:(rank + 1) * n]))
