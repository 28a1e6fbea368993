"""Fixtures of the Hugging Face conversion tests: the `tiny` model (recipes/models/tiny.yaml),
a trained-looking state of it, and an exported directory shared by the module's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_s2.models.v41.config import V41Config
from megatron_s2.config.schema import from_mapping

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"


def load_model(name: str, **changes) -> V41Config:
    cfg = from_mapping(V41Config, yaml.safe_load((MODELS / f"{name}.yaml").read_text()), "model")
    return cfg.replace(**changes) if changes else cfg


@pytest.fixture(scope="session")
def tiny_cfg() -> V41Config:
    return load_model("tiny")


def trained_state(cfg: V41Config, seed: int = 7) -> dict[str, torch.Tensor]:
    """An initialised state whose router biases have moved away from their initial values (as
    after training), so no tensor equals its import substitute."""
    from megatron_s2.models.v41.model import build_model

    state = build_model(cfg, seed=seed).state_dict()
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("expert_bias"):
            state[name] = t + 0.05 * torch.randn(t.shape, generator=gen)
    return state


@pytest.fixture(scope="session")
def tiny_state(tiny_cfg) -> dict[str, torch.Tensor]:
    return trained_state(tiny_cfg)
