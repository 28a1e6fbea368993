"""The image processor against the reference's resize planning (DeepSeek-V4.1-Flash
``inference/image_processor.py``), worked by hand on the flagship's released settings
(patch 14, 3x3 downsample, 1024-token cap, 544 x 544 pixel floor, no aspect limit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_s2.models.v41.vision.processor import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT,
                                                     image_patches, image_token_types, num_image_tokens,
                                                     plan_image_grid, prepare_vl_inputs)

FLAGSHIP = dict(patch_size=14, downsample_ratio=3, max_n_token=1024, min_pixels=295936, max_wh_ratio=None)


# (width, height) -> (planned width, height), patch grid (h, w), token grid (h, w), span tokens
WORKED = {
    # no resize needed: sides rounded up to 14 (72 x 14, 58 x 14); ceil(58/3) x ceil(72/3); 20 * 25 + 2
    (1000, 800): ((1008, 812), (58, 72), (20, 24), 502),
    # below the floor: x sqrt(295936 / 10^4) = 5.44 -> 544 -> 546 (39 patches), 13 x 13 tokens, 13 * 14 + 2
    (100, 100): ((546, 546), (39, 39), (13, 13), 184),
    # over the cap (72 x 96 tokens): w_max = sqrt(1022 / 0.75 + 1/4) - 1/2 = 36.4, h_max = 27.3, cell 42 px,
    # beta = 36 * 42 / 4000 = 27 * 42 / 3000 = 0.378 -> 1512 x 1134, 27 x 36 tokens, 27 * 37 + 2
    (4000, 3000): ((1512, 1134), (81, 108), (27, 36), 1001),
    # wide and small: x 2.72 -> 5440 x 54 -> 5446 x 56, 2 x 130 tokens
    (2000, 20): ((5446, 56), (4, 389), (2, 130), 264),
    # one row of 14 px: h_max < 1 -> one token row, 1024 - 3 columns of 42 px: exactly the cap
    (100000, 14): ((42882, 42), (3, 3063), (1, 1021), 1024),
    # one column: w_max < 1 -> (1024 - 2) // 2 = 511 rows of 42 px: exactly the cap
    (14, 100000): ((42, 21462), (1533, 3), (511, 1), 1024),
}


@pytest.mark.parametrize("size", sorted(WORKED))
def test_reference_grid_planning_on_worked_sizes(size):
    (w, h), vit, llm, tokens = WORKED[size]
    g = plan_image_grid(*size, **FLAGSHIP)
    assert (g.width, g.height) == (w, h)
    assert (g.n_vit_h, g.n_vit_w) == vit and (g.n_llm_h, g.n_llm_w) == llm
    assert g.num_tokens == tokens == num_image_tokens(*llm) <= FLAGSHIP["max_n_token"]


def test_aspect_limit_clips_then_scales():
    # 1000 x 50 at ratio 8: width -> 400; x sqrt(295936 / 20000) -> 1538 x 192 -> 1540 x 196; 5 x 37 tokens
    g = plan_image_grid(1000, 50, **{**FLAGSHIP, "max_wh_ratio": 8})
    assert (g.width, g.height, g.n_llm_h, g.n_llm_w, g.num_tokens) == (1540, 196, 5, 37, 192)


@pytest.mark.parametrize("size", [(3, 7), (640, 480), (1344, 1344), (5000, 37), (37, 5000), (12345, 6789)])
def test_every_plan_fits_the_cap_on_the_patch_grid(size):
    for cap in (4, 40, 1024):
        g = plan_image_grid(*size, **{**FLAGSHIP, "max_n_token": cap})
        assert g.num_tokens <= cap and g.width % 14 == 0 and g.height % 14 == 0 and g.num_patches > 0


def test_token_types_of_a_span():
    assert image_token_types(2, 3) == [IMAGE_START, IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE,
                                       IMAGE, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END]
    assert len(image_token_types(5, 7)) == num_image_tokens(5, 7) == 5 * 8 + 2


def test_patches_are_the_grid_in_reading_order(vision_cfg):
    # 24 x 12 pixels (above the 256-pixel floor, on the 4-pixel patch grid): no resize, no padding
    pixels = np.zeros((12, 24, 3), dtype=np.uint8)
    for i in range(3):
        for j in range(6):
            pixels[4 * i:4 * i + 4, 4 * j:4 * j + 4, 0] = 10 * (6 * i + j)  # red channel = patch index * 10
    pixels[..., 1] = 255
    patches, grid = image_patches(Image.fromarray(pixels), vision_cfg)
    assert patches.shape == (18, 3, 4, 4) and (grid.n_vit_h, grid.n_vit_w) == (3, 6)
    expect = (torch.arange(18, dtype=torch.float32) * 10 / 255 - 0.5) / 0.5
    assert torch.allclose(patches[:, 0, 0, 0], expect) and torch.all(patches[:, 1] == 1.0)  # [-1, 1] scaling


def test_letterbox_pads_grey_and_very_wide_images_stretch(vision_cfg):
    red = Image.new("RGB", (20, 14), (255, 0, 0))  # planned 20 x 16: letterboxed, grey rows added
    patches, grid = image_patches(red, vision_cfg)
    assert (grid.width, grid.height) == (20, 16)
    grey = (127 / 255 - 0.5) / 0.5
    assert torch.isclose(patches[:, 0].min(), torch.tensor(grey)) and patches[:, 0].max() == 1.0
    wide = vision_cfg.replace(vision_max_wh_ratio=2.0)
    patches, grid = image_patches(Image.new("RGB", (64, 8), (255, 0, 0)), wide)  # clipped to 2:1, stretched
    assert grid.width / grid.height == pytest.approx(2.0, rel=0.2) and torch.all(patches[:, 0] == 1.0)


def test_prepare_vl_inputs_expands_placeholders(vision_cfg):
    img = Image.new("RGB", (50, 30), (0, 128, 255))  # 52 x 32 -> 8 x 13 patches -> 3 x 5 tokens, span 20
    tokens, types, images = prepare_vl_inputs([1, 100, 2, 100], [img, img], vision_cfg)
    assert len(tokens) == 1 + 20 + 1 + 20 and tokens.count(100) == 40
    assert types[0] == TEXT and types[1] == IMAGE_START and types[20] == IMAGE_END and types[21] == TEXT
    assert [im.start for im in images] == [1, 22] and images[0].patches.shape == (104, 3, 4, 4)
    assert prepare_vl_inputs([1, 2], [], vision_cfg) == ([1, 2], [TEXT, TEXT], None)
    with pytest.raises(ValueError, match="2 image placeholders .* but 1 images"):
        prepare_vl_inputs([100, 100], [img], vision_cfg)
    with pytest.raises(ValueError, match="no vision tower"):
        prepare_vl_inputs([100], [img], vision_cfg.replace(vision_n_layers=0))
