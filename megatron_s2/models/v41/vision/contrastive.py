"""The two-tower model of the contrastive phase: DeepSeek-ViT + a small text tower (report §4.2.2).

* **Image side** — the model's own :class:`~.tower.VisionEncoder`, held as ``vision`` so that its
  parameters carry exactly the names ``V41Model.vision`` gives them (``vision.tower.*``,
  ``vision.aligner.*``, ``vision.image_*``): a later phase loads them from this phase's
  checkpoint. An image's embedding is the **mean of the tower's patch outputs** (after the final
  norm), projected by ``image_proj`` to ``embed_dim``. The aligner is left out on purpose: it maps
  to the *backbone* width, is trained with the LLM in the autoregressive stage, and would tie
  the contrastive features to one LLM's size. The aligner and the span delimiters therefore stay
  at their initialisation and are frozen in this phase (no gradient, no optimiser state).
* **Text side** — :class:`TextTower`: token embedding, the vision tower's own pre-norm SwiGLU
  block (:class:`~.tower.VisionBlock`, bidirectional, reused rather than copied; a caption is a
  ``1 x L`` grid, so its 2D-RoPE rotates with the token index), a final RMSNorm, mean pooling,
  then ``text_proj`` to ``embed_dim``.
* **SigLIP scalars** — ``log_temperature`` (t', init log 10) and ``logit_bias`` (b, init -10).

Both embeddings are L2-normalised; the loss is :mod:`megatron_s2.training.siglip`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.init import constant_init
from megatron_s2.models.v41.config import V41Config
from megatron_s2.models.v41.norm import RMSNorm
from megatron_s2.models.v41.vision.processor import plan_capped, prepare_image
from megatron_s2.models.v41.vision.rope2d import rope_2d_tables
from megatron_s2.models.v41.vision.tower import VISION_NORM_EPS, BiasedLinear, VisionBlock, VisionEncoder
from megatron_s2.parallel.placement import mark_param

__all__ = ["TextTower", "ContrastiveModel", "FROZEN_VISION"]

FROZEN_VISION = ("vision.aligner.*", "vision.image_*")
"""Parameters of the vision encoder this phase does not train (module docstring)."""


class TextTower(nn.Module):
    """A bidirectional transformer over one caption's tokens -> its mean-pooled features [dim]."""

    def __init__(self, config: V41Config, vocab_size: int, dim: int, n_layers: int, n_heads: int, inter_dim: int):
        super().__init__()
        self.head_dim, self.rope_theta = dim // n_heads, config.vision_rope_theta
        self.embed = nn.Parameter(torch.empty(vocab_size, dim))
        mark_param(self.embed, (vocab_size, dim))
        # the vision block reads its widths from a model config: the same block, text-sized
        block_cfg = config.replace(vision_dim=dim, vision_n_heads=n_heads, vision_inter_dim=inter_dim)
        self.blocks = nn.ModuleList([VisionBlock(block_cfg) for _ in range(n_layers)])
        self.norm = RMSNorm(dim, VISION_NORM_EPS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [L] -> [dim] (mean over the caption's positions)."""
        x = F.embedding(tokens, self.embed)
        cos, sin = rope_2d_tables(1, tokens.numel(), self.head_dim, self.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x).mean(dim=0)


class ContrastiveModel(nn.Module):
    """Vision encoder + text tower + projections + SigLIP's t' and b (module docstring)."""

    FROZEN = FROZEN_VISION

    def __init__(self, config: V41Config, contrastive, vocab_size: int, groups=None):
        super().__init__()
        c = contrastive
        self.config = config
        self.vision = VisionEncoder(config, groups)
        self.text = TextTower(config, vocab_size, c.text_dim, c.text_layers, c.text_heads, c.text_inter_dim)
        self.image_proj = BiasedLinear(config.vision_dim, c.embed_dim, bias=False)
        self.text_proj = BiasedLinear(c.text_dim, c.embed_dim, bias=False)
        self.log_temperature = nn.Parameter(torch.empty(1))
        self.logit_bias = nn.Parameter(torch.empty(1))
        mark_param(self.log_temperature, (1,), init=constant_init(c.init_log_temperature))
        mark_param(self.logit_bias, (1,), init=constant_init(c.init_bias))

    def prepare_images(self, images: Sequence, max_side: int) -> list:
        """Decoded Pillow images -> patch grids at the phase's resolution cap (:func:`~.processor.plan_capped`)."""
        cfg = self.config
        return [prepare_image(im, cfg, grid=plan_capped(cfg, im.width, im.height, max_side)) for im in images]

    def encode_images(self, images: Sequence) -> torch.Tensor:
        """Images (each with ``patches``, ``n_vit_h``, ``n_vit_w``) -> L2-normalised [n, embed_dim]."""
        device = self.log_temperature.device
        pooled = torch.stack([self.vision.tower(im.patches.to(device), im.n_vit_h, im.n_vit_w).mean(dim=0)
                              for im in images])
        return F.normalize(self.image_proj(pooled).float(), dim=-1)

    def encode_texts(self, captions: Sequence[torch.Tensor]) -> torch.Tensor:
        """Token-id tensors -> L2-normalised [n, embed_dim]."""
        device = self.log_temperature.device
        pooled = torch.stack([self.text(tokens.to(device)) for tokens in captions])
        return F.normalize(self.text_proj(pooled).float(), dim=-1)

    def after_optimizer_step(self, skipped: bool) -> None:
        """Nothing runs once per step here (no MoE correction biases)."""
