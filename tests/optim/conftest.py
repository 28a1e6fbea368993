"""Fixtures of the optimiser tests."""

from __future__ import annotations

import pytest
import torch
from optim_toy_model import ToyV41


@pytest.fixture
def toy_model() -> ToyV41:
    torch.manual_seed(0)
    return ToyV41()
