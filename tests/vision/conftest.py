"""Fixtures of the vision tests: the `tiny` backbone with a two-block vision tower
(recipes/models/tiny.yaml + :data:`VISION`): head dim 8, 4-pixel patches, the flagship's 3x3
aligner, a 40-token span cap and a 16 x 16 pixel floor."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_s2.config.schema import from_mapping
from megatron_s2.models.v41.config import V41Config

ROOT = Path(__file__).resolve().parents[2]

VISION = dict(vision_n_layers=2, vision_dim=16, vision_n_heads=2, vision_inter_dim=24, vision_patch_size=4,
              vision_downsample_ratio=3, vision_max_n_token=40, vision_min_pixels=256, vision_max_wh_ratio=None,
              vision_rope_theta=10000.0, image_token_id=100)


def vision_config(**changes) -> V41Config:
    raw = yaml.safe_load((ROOT / "recipes" / "models" / "tiny.yaml").read_text())
    raw.update(VISION)
    raw.update(changes)
    return from_mapping(V41Config, raw, "model")


@pytest.fixture(scope="session")
def vision_cfg() -> V41Config:
    return vision_config()
