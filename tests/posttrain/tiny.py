"""The tiny backbone recipe (recipes/models/tiny.yaml) for post-training tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron_s2.models.v41.config import V41Config
from megatron_s2.config.schema import from_mapping

TINY = Path(__file__).resolve().parents[2] / "recipes" / "models" / "tiny.yaml"


def tiny_config() -> V41Config:
    return from_mapping(V41Config, yaml.safe_load(TINY.read_text()))
