"""One contrastive step over data-parallel ranks, with the feature all-gathers hidden behind
the text tower (V4.1 report §3.1.1, "Communication-Computation Overlap in Contrastive Learning").

The SigLIP loss (:mod:`.siglip`) is taken over the *global* batch, so each rank needs every
rank's features. The report's observation: the gradient of the text features depends only on
the gathered visual features, and that of the visual features only on the gathered text
features, so each all-gather can run behind computation::

    Forward(V) -> (Forward(T) || AllGather(V)) -> grad_Text
               -> (Backward(T) || AllGather(T)) -> grad_Vision -> Backward(V)

Rank ``r`` holds pairs ``r*n .. r*n + n - 1`` of the global batch of ``N = n * dp``. The global
loss splits into blocks that add up exactly (:func:`~.siglip.siglip_block_loss`):

* ``grad_Text``: ``L_T(r)`` = every gathered image x this rank's texts. Every term containing
  ``y_j`` (a text of this rank) lies in ``L_T(r)``, so ``dL/dy_j = dL_T(r)/dy_j``: no gradient
  has to travel back to the rank that produced a gathered image. ``L_T`` also gives this rank's
  share of ``dL/dt'`` and ``dL/db``; ``sum_r L_T(r) = L``.
* ``grad_Vision``: ``L_V(r)`` = this rank's images x every gathered text; likewise
  ``dL/dx_i = dL_V(r)/dx_i``. ``t'`` and ``b`` are taken as constants here (their gradient is
  already complete from the ``L_T`` blocks; counting it twice would double it).

Parameter gradients are therefore partial sums over ranks, and the trainer's usual gradient
reduction (a SUM over data-parallel replicas, :mod:`megatron_s2.parallel.grad_finalize`) makes
them the full-batch gradient. ``overlap=False`` runs the same computation in the same order
but waits for each all-gather as soon as it is issued: the blocking baseline of
``bench/contrastive_overlap.py``, with bitwise the same loss and gradients.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group
from megatron_s2.training.siglip import siglip_block_loss

__all__ = ["contrastive_forward_backward"]


def _start_all_gather(x: torch.Tensor, group: Group):
    """Issue the all-gather of ``x`` (rows) over ``group``: (pending work or None, output parts)."""
    if not group.active:
        return None, [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    return dist.all_gather(parts, x, group=group.pg, async_op=True), parts


def _finish_all_gather(pending, timings: dict | None = None) -> torch.Tensor:
    """Wait for the gather (the exposed part of its time is added to ``timings["wait_s"]``)."""
    work, parts = pending
    if work is not None:
        start = time.perf_counter()
        work.wait()
        if timings is not None:
            timings["wait_s"] = timings.get("wait_s", 0.0) + time.perf_counter() - start
    return torch.cat(parts)


def contrastive_forward_backward(encode_images: Callable[[], torch.Tensor], encode_texts: Callable[[], torch.Tensor],
                                 log_temperature: torch.Tensor, bias: torch.Tensor, group: Group, *,
                                 overlap: bool = True, timings: dict | None = None) -> torch.Tensor:
    """Run the step's forward and backward (module docstring); return this rank's ``L_T`` block
    (detached; summed over ``group`` it is the global loss).

    ``encode_images()`` / ``encode_texts()`` return this rank's n L2-normalised features [n, d]
    with their autograd graphs (the vision and text towers' forward). Gradients accumulate into
    the parameters' ``.grad`` as partial sums over ranks. ``timings``: a dict that receives the
    seconds spent waiting for the gathers (``wait_s``: communication not hidden)."""
    def gather(x: torch.Tensor):
        pending = _start_all_gather(x.detach(), group)
        return pending if overlap else (None, [_finish_all_gather(pending, timings)])

    images = encode_images()                                    # Forward(V)
    pending_images = gather(images)                             # AllGather(V) ...
    texts = encode_texts()                                      # ... || Forward(T)
    all_images = _finish_all_gather(pending_images, timings)
    n = texts.size(0)
    if images.size(0) != n:
        raise ValueError(f"contrastive step: {images.size(0)} images but {n} texts on rank {group.rank}")
    batch_size, offset = n * group.size, n * group.rank

    text_leaf = texts.detach().requires_grad_()                 # grad_Text (and this rank's dL/dt', dL/db)
    text_block = siglip_block_loss(all_images, text_leaf, log_temperature, bias, image_offset=0,
                                   text_offset=offset, batch_size=batch_size)
    text_block.backward()
    pending_texts = gather(texts)                               # AllGather(T) ...
    texts.backward(text_leaf.grad)                              # ... || Backward(T)
    all_texts = _finish_all_gather(pending_texts, timings)

    image_leaf = images.detach().requires_grad_()               # grad_Vision (t', b held constant)
    image_block = siglip_block_loss(image_leaf, all_texts, log_temperature.detach(), bias.detach(),
                                    image_offset=offset, text_offset=0, batch_size=batch_size)
    (image_grad,) = torch.autograd.grad(image_block, image_leaf)
    images.backward(image_grad)                                 # Backward(V)
    return text_block.detach()
