"""Fixtures of the DSpark tests: the `tiny` backbone with a two-block drafter reading its
three top layers (recipes/models/tiny.yaml + the drafter fields of recipes/dspark_tiny.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_s2.config.schema import from_mapping
from megatron_s2.models.v41.config import V41Config

ROOT = Path(__file__).resolve().parents[2]

DRAFTER = dict(dspark_layers=2, dspark_block_size=4, dspark_noise_token_id=127, dspark_target_layer_ids=[5, 6, 7],
               dspark_markov_rank=8, dspark_num_routed_experts=4, dspark_moe_topk=2)


def dspark_config(**changes) -> V41Config:
    raw = yaml.safe_load((ROOT / "recipes" / "models" / "tiny.yaml").read_text())
    raw.update(DRAFTER)
    raw.update(changes)
    return from_mapping(V41Config, raw, "model")


@pytest.fixture(scope="session")
def dspark_cfg() -> V41Config:
    return dspark_config()
