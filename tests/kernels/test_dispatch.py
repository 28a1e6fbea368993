"""Triton is optional: importing megatron_s2 and running a CSA2 layer works where ``import
triton`` fails, and the dispatch mode is validated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_s2.kernels.dispatch import kernel_mode

SCRIPT = r"""
import sys
sys.modules["triton"] = None  # any 'import triton' now raises ImportError
import torch
import megatron_s2.kernels as k
from megatron_s2.kernels.dispatch import triton_available, use_triton
from megatron_s2.models.v41.model import build_model
assert not triton_available() and not use_triton(torch.zeros(1))
q, kv = torch.randn(1, 3, 2, 4), torch.randn(1, 5, 4)
idx = torch.tensor([[[0, 1], [2, -1], [4, 3]]])
out, _ = k.sparse_attention(q, kv, idx, torch.zeros(2), 0.5)
assert out.shape == q.shape
print("ok", all(not m.startswith("megatron_s2.kernels.triton") for m in sys.modules))
"""


def test_import_and_run_without_triton():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok True")


def test_mode_is_validated(monkeypatch):
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "fast")
    with pytest.raises(ValueError, match="MEGATRON_S2_KERNELS"):
        kernel_mode()


def test_forced_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch):
    """MEGATRON_S2_KERNELS=triton on CPU tensors without TRITON_INTERPRET reached Triton's driver
    lookup ("0 active drivers") as a traceback; it is a ConfigError naming both variables."""
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.kernels.dispatch import triton_available, use_triton
    import torch

    if not triton_available():
        pytest.skip("Triton is not importable here")
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "reference")
    assert not use_triton(torch.zeros(1))
