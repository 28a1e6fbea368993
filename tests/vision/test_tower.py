"""The vision tower, aligner and their wiring into the backbone: shapes and the ninefold token
reduction, 2D-RoPE's relative-position property, the pixel-unshuffle layout against
``F.unfold`` (the reference's formulation), the merge into the embed step, accounting and
configuration errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.v41.accounting import account, count_parameters, report_lines, vision_parameters
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.vision.processor import IMAGE, ImageInput, image_token_types
from megatron_s2.models.v41.vision.rope2d import apply_rope_2d, rope_2d_tables
from megatron_s2.models.v41.vision.tower import pixel_unshuffle
from tests.vision.conftest import vision_config


@pytest.fixture(scope="module")
def model(vision_cfg):
    return build_model(vision_cfg, seed=0)


@pytest.mark.parametrize("grid", [(9, 9), (7, 11), (1, 1), (3, 4)])
def test_tower_and_aligner_shapes(model, vision_cfg, grid):
    n_h, n_w = grid
    p = vision_cfg.vision_patch_size
    feats = model.vision.tower(torch.randn(n_h * n_w, 3, p, p), n_h, n_w)
    assert feats.shape == (n_h * n_w, vision_cfg.vision_dim)
    out = model.vision(torch.randn(n_h * n_w, 3, p, p), n_h, n_w)
    assert out.shape == (-(-n_h // 3) * -(-n_w // 3), vision_cfg.hidden_size)
    if grid == (9, 9):
        assert feats.size(0) == 9 * out.size(0)  # 3x3 pixel-unshuffle: ninefold fewer tokens


def test_pixel_unshuffle_is_the_reference_unfold():
    x = torch.randn(7 * 11, 5)
    ref = F.unfold(F.pad(x.view(7, 11, 5).permute(2, 0, 1), (0, 1, 0, 2)).unsqueeze(0), 3, stride=3)[0].t()
    assert torch.equal(pixel_unshuffle(x, 7, 11, 3), ref)


def test_2d_rope_scores_depend_only_on_the_offset():
    torch.manual_seed(0)
    head_dim, n_h, n_w = 16, 6, 7
    cos, sin = rope_2d_tables(n_h, n_w, head_dim, 10000.0)
    q, k = torch.randn(1, 1, head_dim, dtype=torch.float64), torch.randn(1, 1, head_dim, dtype=torch.float64)

    def score(a, b):  # query at grid cell a, key at grid cell b
        ia, ib = a[0] * n_w + a[1], b[0] * n_w + b[1]
        qa = apply_rope_2d(q, cos[ia:ia + 1].double(), sin[ia:ia + 1].double())
        kb = apply_rope_2d(k, cos[ib:ib + 1].double(), sin[ib:ib + 1].double())
        return float((qa * kb).sum())

    for offset in ((0, 0), (1, 2), (-2, 3), (4, -5)):
        scores = [score((i, j), (i + offset[0], j + offset[1])) for i in range(n_h) for j in range(n_w)
                  if 0 <= i + offset[0] < n_h and 0 <= j + offset[1] < n_w]
        assert max(scores) - min(scores) < 1e-5, offset  # the rotation runs in float32
    assert abs(score((0, 0), (1, 2)) - score((0, 0), (2, 1))) > 1e-3  # rows and columns are distinct axes


def test_merge_fills_spans_and_trains_the_encoder(model, vision_cfg):
    p = vision_cfg.vision_patch_size
    types = torch.tensor(image_token_types(2, 3))  # a 6 x 7 patch grid -> 2 x 3 tokens, span 10
    image = ImageInput(start=2, patches=torch.randn(42, 3, p, p), n_vit_h=6, n_vit_w=7, types=types)
    ids = torch.tensor([[1, 2] + [vision_cfg.image_token_id] * 10 + [3, 4]])
    plain, _ = model.embed(ids)
    merged, _ = model.embed(ids, images=[[image]])
    assert torch.equal(merged[:, :2], plain[:, :2]) and torch.equal(merged[:, 12:], plain[:, 12:])
    span = merged[0, 2:12, 0]  # first stream: the expanded embedding
    visual = model.vision(image.patches, 6, 7).to(span.dtype)
    assert torch.allclose(span[types == IMAGE], visual)
    assert torch.equal(span[0], model.vision.image_start.to(span.dtype))
    assert torch.equal(span[4], model.vision.image_newline.to(span.dtype))
    assert torch.equal(span[-1], model.vision.image_end.to(span.dtype))
    model.zero_grad()
    x = model.embed(ids, images=[[image]])
    model.head(*model.run_layers(x, model.make_context({"tokens": ids}))).float().sum().backward()
    assert model.vision.tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.vision.image_start.grad.abs().sum() > 0


def test_text_only_by_default():
    cfg = vision_config(vision_n_layers=0)
    m = build_model(cfg, seed=0)
    assert m.vision is None and count_parameters(cfg).vision == 0
    with pytest.raises(ValueError, match="no vision tower"):
        m.embed(torch.zeros(1, 4, dtype=torch.long), images=[[]])


def test_accounting_equals_the_built_encoder(model, vision_cfg):
    built = sum(p.numel() for p in model.vision.parameters())
    counts = count_parameters(vision_cfg)
    assert counts.vision == vision_parameters(vision_cfg) == built
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert count_parameters(vision_cfg, [7], pre_process=False).vision == 0  # the encoder sits on the first stage
    assert any(line.startswith("vision encoder parameters") for line in report_lines(account(vision_cfg)))


@pytest.mark.parametrize("change, match", [
    (dict(vision_n_layers=-1), "vision_n_layers: must be 0"),
    (dict(vision_n_heads=3), "vision_n_heads: vision_dim=16 / 3 heads"),
    (dict(vision_dim=24, vision_n_heads=4), "divisible by 4"),
    (dict(vision_max_n_token=3), "vision_max_n_token: an image span takes at least 4"),
    (dict(vision_max_wh_ratio=0.5), "vision_max_wh_ratio: must be null"),
    (dict(image_token_id=128), "image_token_id: must be a token id below vocab_size=128"),
    (dict(vision_patch_size=0), "vision_patch_size: must be positive"),
])
def test_config_errors_name_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        vision_config(**change)
    if "vision_n_layers" not in change:
        vision_config(**{**change, "vision_n_layers": 0})  # text only: the vision fields are not checked
