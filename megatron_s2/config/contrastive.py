"""The ``contrastive:`` section of a recipe (``phase.kind: contrastive``): SigLIP pre-training of
the vision encoder over image-text pairs (V4.1 report §4.2.2, "Vision Encoder Training").

The vision tower itself is the model's (``model.vision_*``); this section adds what only the
contrastive phase has: the text tower, the shared embedding, SigLIP's ``t'`` / ``b``
initialisation, the phase's resolution cap and the image-text source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["ContrastiveConfig"]


@dataclass(frozen=True)
class ContrastiveConfig:
    text_layers: int = 2
    """Blocks of the text tower (bidirectional; the vision tower's block, megatron_s2/models/v41/vision/contrastive.py)."""
    text_dim: int = 64
    """Hidden dimension of the text tower."""
    text_heads: int = 4
    """Attention heads of the text tower (text_dim / text_heads must be a multiple of 4: 2D-RoPE)."""
    text_inter_dim: int = 128
    """SwiGLU width of the text tower."""
    text_max_tokens: int = 32
    """Caption tokens kept (longer alt text is cut, as SigLIP does)."""
    embed_dim: int = 64
    """Width of the shared image-text embedding both towers project to."""
    max_image_size: int = 224
    """Resolution cap (pixels, longest side): larger images are downscaled with their aspect ratio
    kept (report §4.2.2: 224 x 224 in the contrastive phase)."""
    init_log_temperature: float = math.log(10.0)
    """Initial t' (t = exp(t')); SigLIP: log 10."""
    init_bias: float = -10.0
    """Initial logit bias b; SigLIP: -10."""
    overlap: bool = True
    """Hide the feature all-gathers behind the text tower (report §3.1.1); false: blocking gathers
    (same loss and gradients, for comparison)."""
    source: Literal["procedural"] = "procedural"
    """Image-text pairs: 'procedural' (megatron_s2.data.procedural_images, rendered on the fly).
    Local pairs instead: ``data.kind: image_text`` with a file ``data.source`` (folder / parquet /
    webdataset) and ``data.paths`` (megatron_s2.data.image_text_pairs)."""
    image_size: int = 56
    """Side of the procedural images (pixels)."""
    eval_items: int = 0
    """Held-out pairs for zero-shot image->caption top-1 retrieval at the end of the run (logged
    with chance): procedural items of another seed, or the last ``eval_items`` local pairs (never
    trained on); 0 = none."""

    def __post_init__(self) -> None:
        for name in ("text_layers", "text_dim", "text_heads", "text_inter_dim", "text_max_tokens", "embed_dim",
                     "max_image_size", "image_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"contrastive.{name}: must be positive, got {getattr(self, name)}")
        if self.text_dim % self.text_heads or (self.text_dim // self.text_heads) % 4:
            raise ConfigError(f"contrastive.text_heads: text_dim={self.text_dim} / {self.text_heads} heads must be a "
                              "head dimension that is a multiple of 4 (2D-RoPE)")
        if self.eval_items < 0 or self.eval_items == 1:
            raise ConfigError(f"contrastive.eval_items: 0 (no evaluation) or at least 2, got {self.eval_items}")


def check_contrastive_recipe(recipe) -> None:
    """What a contrastive phase cannot run, refused at recipe load (train, launch, plan alike)."""
    kind = recipe.phase.kind
    if recipe.contrastive is not None and kind != "contrastive":
        raise ConfigError(f"contrastive: the recipe has a 'contrastive:' section but phase.kind is '{kind}'; set "
                          "phase.kind: contrastive or remove the section")
    if kind != "contrastive":
        return
    if not getattr(recipe.model, "vision_n_layers", 0):
        raise ConfigError("model.vision_n_layers: phase.kind: contrastive trains the vision tower, but the model has "
                          "none; set model.vision_n_layers (and the other vision_* fields) to a positive depth")
    p = recipe.parallel
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name, 1) > 1:
            raise ConfigError(f"parallel.{name}: phase.kind: contrastive replicates both towers and splits only the "
                              f"batch (data parallelism); set parallel.{name}: 1")
    if p.distributed_optimizer:
        raise ConfigError("parallel.distributed_optimizer: not supported in phase.kind: contrastive; set it false")
    t = recipe.training
    if t.freeze_vision_until_decay:
        raise ConfigError("training.freeze_vision_until_decay: the contrastive phase trains the vision tower from its "
                          "first step (the freeze belongs to joint pre-training, report §2.5); set it false")
    if p.dp and t.micro_batch_size * p.dp != t.global_batch_size:
        raise ConfigError(f"training.micro_batch_size: the SigLIP loss spans the whole batch, so a contrastive step "
                          f"is one micro-batch per rank; set training.micro_batch_size: global_batch_size / dp = "
                          f"{t.global_batch_size // p.dp}")
