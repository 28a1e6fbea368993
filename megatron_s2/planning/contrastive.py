"""Per-rank memory of the contrastive phase (``phase.kind: contrastive``, report §4.2.2).

That phase trains no language model: each data-parallel rank holds the vision tower, the text
tower, their projections and SigLIP's ``t'`` / ``b``
(the family's ``build_contrastive_model``, built here on the meta device, so the parameter
count is the real one), their gradients and optimiser state, and the
activations of its micro-batch: ``micro_batch_size`` images at the resolution cap through the
tower and as many captions through the text tower, kept for the backward (no recomputation).

Activation bytes per layer follow the usual transformer count (Korthikanti et al. 2022, no
recomputation): ``s * b * d * (34 + 5 * a * s / d)`` at two bytes per element, scaled by
``element_size / 2``, with ``s`` tokens per sample, ``a`` heads and ``d`` the width (SwiGLU's
wider MLP is within the count's margin at these widths). The gathered features (global batch x
embedding, both towers) and the ``[b, B]`` logit blocks are added once.
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

import torch

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.planning.model_state import ModelStateBytes

__all__ = ["contrastive_rank_state", "layer_activation_bytes"]


def layer_activation_bytes(tokens: int, batch: int, width: int, heads: int, element_size: int) -> float:
    """Saved activations of one transformer layer (module docstring)."""
    return tokens * batch * width * (34 + 5 * heads * tokens / width) * element_size / 2


def contrastive_rank_state(recipe: RecipeConfig) -> tuple[ModelStateBytes, dict[str, float]]:
    """(model state, saved activations by part) of one data-parallel rank."""
    from megatron_s2.config.contrastive import ContrastiveConfig
    from megatron_s2.models.family import family_of

    cfg, c, t = recipe.model, recipe.contrastive or ContrastiveConfig(), recipe.training
    with torch.device("meta"):
        model = family_of(cfg).build_contrastive_model(cfg, c, cfg.vocab_size)
    frozen = getattr(model, "FROZEN", ())
    dtype = getattr(torch, cfg.params_dtype)
    element = torch.empty((), dtype=dtype).element_size()
    state = ModelStateBytes()
    trainable = 0
    for name, p in model.named_parameters():
        part = "vision encoder" if name.startswith("vision.") else "text tower" if name.startswith("text.") \
            else "projections + t', b"
        state.parameters[part] = state.parameters.get(part, 0) + p.numel() * element
        trainable += 0 if any(fnmatch(name, pattern) for pattern in frozen) else p.numel()
    state.gradients = trainable * element
    # float32 master copy (low-precision parameters) + two moments: the AdamW upper bound (Muon keeps one)
    state.optimizer["adamw (fp32 moments" + (" + master)" if element < 4 else ")")] = \
        trainable * (8 + (4 if element < 4 else 0))
    b = t.micro_batch_size
    patches = (math.ceil(c.max_image_size / cfg.vision_patch_size)) ** 2  # at most, at the cap
    act = torch.empty((), dtype=getattr(torch, cfg.compute_dtype)).element_size()
    parts = {
        "vision tower": cfg.vision_n_layers * layer_activation_bytes(patches, b, cfg.vision_dim, cfg.vision_n_heads, act),
        "text tower": c.text_layers * layer_activation_bytes(c.text_max_tokens, b, c.text_dim, c.text_heads, act),
        "gathered features + logits": 4.0 * (2 * t.global_batch_size * c.embed_dim + 2 * b * t.global_batch_size),
    }
    return state, parts
