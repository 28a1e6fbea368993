"""Fixtures shared by the backbone tests: model configs loaded from ``recipes/models/`` and
small factories for models, single CSA2 layers and forward contexts.

Everything runs on CPU in float32 unless a test says otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_s2.models.v41.config import V41Config
from megatron_s2.config.schema import from_mapping

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "models"


def load_model_recipe(name: str) -> V41Config:
    return from_mapping(V41Config, yaml.safe_load((RECIPES / f"{name}.yaml").read_text()))


@pytest.fixture(scope="session")
def tiny_cfg() -> V41Config:
    """recipes/models/tiny.yaml: every layer mode, m=2 and m=1, CED, hierarchical indexer."""
    return load_model_recipe("tiny")


@pytest.fixture(scope="session")
def small_cfg() -> V41Config:
    return load_model_recipe("small")


@pytest.fixture(scope="session")
def flagship_cfg() -> V41Config:
    return load_model_recipe("flagship")


@pytest.fixture
def make_model():
    """``make_model(cfg, seed=0)`` -> an initialised V41Model in float32."""
    from megatron_s2.models.v41.model import build_model

    def make(cfg: V41Config, seed: int = 0):
        torch.manual_seed(seed)
        return build_model(cfg, seed=seed)

    return make


@pytest.fixture
def make_attention():
    """``make_attention(cfg, layer, seed=0)`` -> the initialised CSA2Attention of one layer,
    built from the config's plan exactly as the model builds it."""
    from megatron_s2.models.init import initialize_parameters
    from megatron_s2.models.v41.attention.csa2 import CSA2Attention
    from megatron_s2.parallel.groups import ParallelGroups

    def make(cfg: V41Config, layer: int, seed: int = 0) -> CSA2Attention:
        attn = CSA2Attention(cfg, cfg.plan[layer], ParallelGroups.single())
        initialize_parameters(attn, seed, cfg.init_std)
        return attn

    return make


@pytest.fixture
def make_ctx():
    """``make_ctx(cfg, ids, doc_ids=None, routing=None)`` -> a fresh ForwardContext."""
    from megatron_s2.models.v41.context import ForwardContext

    def make(cfg: V41Config, ids: torch.Tensor, doc_ids: torch.Tensor | None = None, routing=None):
        return ForwardContext.create(ids, cfg.plan, doc_ids=doc_ids, routing=routing)

    return make
