"""Triton kernels run on CPU tensors under the interpreter: ``TRITON_INTERPRET=1`` must be set
before a kernel module is imported (``@triton.jit`` reads it at decoration time), so it is set
here, at collection, unless a GPU is visible."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_triton():
    """Skip (with the reason) where Triton is not installed; CI installs it (setup.py dev extra)."""
    return pytest.importorskip("triton", reason="Triton is not installed (pip install -e .[dev] brings it)")
