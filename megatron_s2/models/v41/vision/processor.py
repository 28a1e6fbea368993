"""The V4.1 image processor: resize planning, the token grid and image spans (report §2.1.1).

An image becomes an ``n_vit_h x n_vit_w`` grid of ``patch x patch`` RGB patches for the vision
tower, and after the aligner's ``r x r`` pixel-unshuffle an ``n_llm_h x n_llm_w`` grid of
visual embeddings (``n_llm = ceil(n_vit / r)``). In the token sequence the image occupies the
span ::

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

i.e. ``n_llm_h * (n_llm_w + 1) + 2`` positions, every one carrying ``image_token_id`` in the
input ids and told apart only by its *token type* (``TEXT`` = -1 outside images). The IMAGE
slots take the aligner's rows in reading order; the delimiters take learned embeddings
(:mod:`megatron_s2.models.v41.vision.tower`).

Resize planning follows the public DeepSeek-V4.1-Flash reference (``inference/
image_processor.py``: ``plan_image_grid`` / ``safe_resize`` / ``solve_resize_ratio``) step by
step, so an image yields the released model's token count and patch grid:

1. a width beyond ``vision_max_wh_ratio`` x height is clipped to that ratio (no clip when None);
2. an image below ``vision_min_pixels`` is scaled up (aspect kept, each side truncated to int);
3. each side is rounded *up* to a multiple of the patch size;
4. if the span would exceed ``vision_max_n_token`` tokens, the largest aspect-preserving size
   whose grid fits is solved for (``h_llm * (w_llm + 1) + 2 <= max``), each side rounded
   *down* to the patch size; extreme aspect ratios collapse to one column or one row.

Pixels (:func:`image_patches`): an image at least ``vision_max_wh_ratio`` times wider than high
is stretched to the planned size, any other is letterboxed (aspect kept, centred, padded with
RGB 127); values are scaled to [-1, 1] (mean 0.5, std 0.5). The reference then casts the
patches to bfloat16 before the tower; here the caller chooses the dtype.

The planning functions are pure Python (no torch), so a server or data loader can size an
image before decoding it; torch and Pillow are imported only to make patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["TEXT", "IMAGE_START", "IMAGE", "IMAGE_NEW_LINE", "IMAGE_END", "ImageGrid", "ImageInput",
           "num_image_tokens", "llm_grid", "plan_image_grid", "plan_for", "image_token_types", "image_patches",
           "prepare_image", "prepare_vl_inputs", "plan_capped", "V41ImageProcessor"]

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of an image span: the grid, one newline per row, start and end."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(height: int, width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """Token grid the aligner makes of an image of ``height x width`` pixels (multiples of the patch)."""
    return (math.ceil((height // patch_size) / downsample_ratio),
            math.ceil((width // patch_size) / downsample_ratio))


@dataclass(frozen=True)
class ImageGrid:
    """The plan for one image: pixel size after resizing, patch grid and token grid."""

    height: int
    width: int
    patch_size: int
    downsample_ratio: int

    @property
    def n_vit_h(self) -> int:
        return self.height // self.patch_size

    @property
    def n_vit_w(self) -> int:
        return self.width // self.patch_size

    @property
    def n_llm_h(self) -> int:
        return llm_grid(self.height, self.width, self.patch_size, self.downsample_ratio)[0]

    @property
    def n_llm_w(self) -> int:
        return llm_grid(self.height, self.width, self.patch_size, self.downsample_ratio)[1]

    @property
    def num_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def num_tokens(self) -> int:
        """Positions of the image's span in the token sequence."""
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


def _fit_token_budget(height, width, patch_size: int, downsample_ratio: int, max_n_token: int) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (multiples of the patch) whose span fits ``max_n_token``.

    With aspect ``a = h / w`` a grid of ``w`` columns and ``a w`` rows costs ``a w (w + 1) + 2``
    tokens; solving for equality gives the real-valued bounds, whose floors always fit."""
    aspect = height / width
    max_w = math.sqrt((max_n_token - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    cell = patch_size * downsample_ratio  # pixels per token along each side
    if max_w < 1.0:  # too tall for even one column at this aspect: one column, as many rows as fit
        return (max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:  # too wide for even one row: one row, as many columns as fit
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return (math.floor(height * beta / patch_size) * patch_size,
            math.floor(width * beta / patch_size) * patch_size)


def plan_image_grid(width: int, height: int, *, patch_size: int, downsample_ratio: int, max_n_token: int,
                    min_pixels: int, max_wh_ratio: float | None) -> ImageGrid:
    """The resize plan of an image of ``width x height`` pixels (module docstring, steps 1-4)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image of {width}x{height} pixels: both sides must be positive")
    if max_wh_ratio is not None and width > height * max_wh_ratio:
        width = height * max_wh_ratio
    if 0 < width * height < min_pixels:
        scale = (min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_h = math.ceil(height / patch_size) * patch_size
    best_w = math.ceil(width / patch_size) * patch_size
    if num_image_tokens(*llm_grid(best_h, best_w, patch_size, downsample_ratio)) > max_n_token:
        best_h, best_w = _fit_token_budget(height, width, patch_size, downsample_ratio, max_n_token)
    grid = ImageGrid(best_h, best_w, patch_size, downsample_ratio)
    if grid.num_tokens > max_n_token or grid.num_patches == 0:  # the solve above guarantees neither
        raise RuntimeError(f"resize plan of a {width}x{height} image broke its budget: {grid}")
    return grid


def plan_for(cfg, width: int, height: int) -> ImageGrid:
    """:func:`plan_image_grid` with the ``vision_*`` fields of a model config."""
    return plan_image_grid(width, height, patch_size=cfg.vision_patch_size,
                           downsample_ratio=cfg.vision_downsample_ratio, max_n_token=cfg.vision_max_n_token,
                           min_pixels=cfg.vision_min_pixels, max_wh_ratio=cfg.vision_max_wh_ratio)


def plan_capped(cfg, width: int, height: int, max_side: int) -> ImageGrid:
    """The contrastive phase's resolution policy (report §4.2.2: "we restrict the maximum input
    resolution to 224 x 224 pixels by downscaling larger images while preserving their aspect
    ratios"): an image whose longer side exceeds ``max_side`` is scaled down to it, aspect kept;
    each side is then rounded up to the patch size, never past the cap's last whole patch.
    Smaller images are not scaled up (``vision_min_pixels`` belongs to the later stages)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image of {width}x{height} pixels: both sides must be positive")
    p = cfg.vision_patch_size
    if max_side < p:
        raise ValueError(f"resolution cap {max_side} px is below one {p}-pixel patch")
    scale = min(1.0, max_side / max(width, height))
    limit = max_side // p * p
    side = lambda n: min(limit, math.ceil(max(1, round(n * scale)) / p) * p)  # noqa: E731
    return ImageGrid(side(height), side(width), p, cfg.vision_downsample_ratio)


def image_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Token type of every position of an image span, in order (module docstring)."""
    return [IMAGE_START, *([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h, IMAGE_END]


@dataclass
class ImageInput:
    """One image of a sequence: where its span starts, its patches and the span's token types."""

    start: int
    patches: Any
    """[n_vit_h * n_vit_w, 3, patch, patch] in [-1, 1], the patch grid in reading order."""
    n_vit_h: int
    n_vit_w: int
    types: Any
    """int64 [span] token types (IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END)."""


def image_patches(image, cfg, dtype=None, grid: ImageGrid | None = None):
    """A decoded Pillow image -> (patches [N, 3, p, p], :class:`ImageGrid`) (module docstring);
    ``grid``: a plan made otherwise (e.g. :func:`plan_capped`) instead of :func:`plan_for`'s."""
    import numpy as np
    import torch
    from PIL import ImageOps

    image = image.convert("RGB")
    grid = grid if grid is not None else plan_for(cfg, image.width, image.height)
    size = (grid.width, grid.height)
    ratio = cfg.vision_max_wh_ratio
    if ratio is not None and image.width >= ratio * image.height:
        image = image.resize(size)  # very wide: stretch to the planned size
    else:
        image = ImageOps.pad(image, size, color=(127, 127, 127))  # letterbox, aspect kept
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    x = (x - 0.5) / 0.5
    p = grid.patch_size
    # [3, H, W] -> [n_vit_h, n_vit_w, 3, p, p]: patches in reading order, channel-major inside
    patches = x.reshape(3, grid.n_vit_h, p, grid.n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return (patches if dtype is None else patches.to(dtype)), grid


def prepare_image(image, cfg, start: int = 0, dtype=None, grid: ImageGrid | None = None) -> ImageInput:
    """A decoded image -> its :class:`ImageInput` for a span starting at token ``start``
    (``grid``: as :func:`image_patches`)."""
    import torch

    patches, grid = image_patches(image, cfg, dtype, grid)
    types = torch.tensor(image_token_types(grid.n_llm_h, grid.n_llm_w), dtype=torch.int64)
    return ImageInput(start, patches, grid.n_vit_h, grid.n_vit_w, types)


def prepare_vl_inputs(prompt_tokens: Sequence[int], images: Sequence, cfg, dtype=None
                      ) -> tuple[list[int], list[int], list[ImageInput] | None]:
    """Expand each ``image_token_id`` placeholder of a tokenized prompt into its image's span.

    Returns (tokens, token_types, image inputs or None without images), as the reference's
    ``prepare_vl_inputs`` does after tokenizing: span positions carry ``image_token_id``, their
    types tell them apart, every other position is ``TEXT``."""
    placeholder = cfg.image_token_id
    found = sum(int(t) == placeholder for t in prompt_tokens)
    if found != len(images):
        raise ValueError(f"the prompt has {found} image placeholders (token {placeholder}) but {len(images)} images "
                         "were given")
    if found and not cfg.vision_n_layers:
        raise ValueError("the prompt contains images but the model has no vision tower (model.vision_n_layers: 0)")
    tokens, types, inputs = [], [], []
    pending = iter(images)
    for tok in prompt_tokens:
        if int(tok) != placeholder:
            tokens.append(int(tok))
            types.append(TEXT)
            continue
        image = prepare_image(next(pending), cfg, start=len(tokens), dtype=dtype)
        inputs.append(image)
        tokens += [placeholder] * image.types.numel()
        types += image.types.tolist()
    return tokens, types, inputs or None


class V41ImageProcessor:
    """The family's :class:`~megatron_s2.models.family.base.ImageProcessor` for a model config with
    a vision tower: spans sized by :func:`plan_for`, inputs made by :func:`prepare_image`."""

    def __init__(self, cfg):
        if not cfg.vision_n_layers:
            raise ValueError("V41ImageProcessor: the model has no vision tower (model.vision_n_layers: 0)")
        self.cfg = cfg
        self.image_token_id = cfg.image_token_id

    def span_length(self, width: int, height: int) -> int:
        return plan_for(self.cfg, width, height).num_tokens

    def prepare(self, image, start: int) -> ImageInput:
        return prepare_image(image, self.cfg, start=start)

    def work(self, width: int, height: int) -> int:
        """The vision forward's cost of one image, for balanced image sharding across CP ranks
        (:func:`~megatron_s2.parallel.image_sharding.image_work`; resize planning only)."""
        from megatron_s2.parallel.image_sharding import image_work

        return image_work(plan_for(self.cfg, width, height).num_patches, self.cfg.vision_dim, self.cfg.vision_inter_dim)
