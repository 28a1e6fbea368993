"""The tiny backbone recipe (recipes/models/tiny.yaml) for post-training tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron_s2.config.model import ModelConfig
from megatron_s2.config.schema import from_mapping

TINY = Path(__file__).resolve().parents[2] / "recipes" / "models" / "tiny.yaml"


def tiny_config() -> ModelConfig:
    return from_mapping(ModelConfig, yaml.safe_load(TINY.read_text()))
