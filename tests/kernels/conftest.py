"""Triton kernels run on CPU tensors under the interpreter; ``TRITON_INTERPRET=1`` is set by the
suite's root ``tests/conftest.py`` (it must precede the first import of ``triton.language``)."""

import pytest
import torch


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_triton():
    """Skip (with the reason) where Triton is not installed; CI installs it (setup.py dev extra)."""
    return pytest.importorskip("triton", reason="Triton is not installed (pip install -e .[dev] brings it)")
