"""The SigLIP sigmoid contrastive loss (Zhai et al. 2023; V4.1 report §4.2.2, "Vision Encoder Training").

For a batch of ``N`` image-text pairs with L2-normalised image features ``x_i`` and text
features ``y_j``, a learnable log-temperature ``t'`` (``t = exp(t')``, init ``log 10``) and bias
``b`` (init ``-10``)::

    L = -1/N * sum_i sum_j log sigmoid(z_ij * (t * x_i . y_j + b)),   z_ij = +1 if i == j else -1

Every pair is an independent binary problem (no softmax over the batch), so the loss splits
into *blocks* of rows and columns that add up exactly: a data-parallel rank evaluates the
block of its own texts against every gathered image (and its own images against every gathered
text) with the *global* ``N`` as the divisor and the *global* indices deciding the diagonal.
:func:`siglip_block_loss` is that block; :func:`siglip_loss` the whole batch. The overlapped
step that uses the blocks is :mod:`megatron_s2.training.contrastive_schedule`.

Computed in float32 whatever the features' dtype (logits reach ``|t| + |b|`` ~ 20 at init).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["INIT_LOG_TEMPERATURE", "INIT_BIAS", "siglip_logits", "siglip_block_loss", "siglip_loss"]

INIT_LOG_TEMPERATURE = math.log(10.0)
"""SigLIP's initial ``t'`` (``t = 10``)."""
INIT_BIAS = -10.0
"""SigLIP's initial ``b``: with N - 1 negatives per positive, start near the prior log-odds."""


def siglip_logits(images: torch.Tensor, texts: torch.Tensor, log_temperature: torch.Tensor,
                  bias: torch.Tensor) -> torch.Tensor:
    """``t * x_i . y_j + b`` for images [n, d] x texts [m, d] -> [n, m], float32."""
    return images.float() @ texts.float().t() * log_temperature.float().exp() + bias.float()


def siglip_block_loss(images: torch.Tensor, texts: torch.Tensor, log_temperature: torch.Tensor,
                      bias: torch.Tensor, *, image_offset: int, text_offset: int, batch_size: int) -> torch.Tensor:
    """The block of images ``image_offset + [0, n)`` x texts ``text_offset + [0, m)`` of the global
    loss: ``-sum log sigmoid(z_ij logit_ij) / batch_size`` (``batch_size``: the global N).
    Pair (i, j) is positive when its global indices agree."""
    logits = siglip_logits(images, texts, log_temperature, bias)
    rows = torch.arange(images.size(0), device=logits.device) + image_offset
    cols = torch.arange(texts.size(0), device=logits.device) + text_offset
    signs = torch.where(rows[:, None] == cols[None, :], 1.0, -1.0)  # z_ij: +1 on the global diagonal
    return -F.logsigmoid(signs * logits).sum() / batch_size


def siglip_loss(images: torch.Tensor, texts: torch.Tensor, log_temperature: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
    """The loss of one whole batch (pairs ``(images[i], texts[i])``)."""
    if images.size(0) != texts.size(0):
        raise ValueError(f"siglip_loss: {images.size(0)} images but {texts.size(0)} texts; pairs must align")
    return siglip_block_loss(images, texts, log_temperature, bias, image_offset=0, text_offset=0,
                             batch_size=images.size(0))
