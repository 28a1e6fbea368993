"""Seeding and RNG state capture (bit-identical resume on CPU)."""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

__all__ = ["seed_everything", "rng_state", "set_rng_state"]


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    if deterministic:
        _use_deterministic_algorithms()


def _use_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` without its import cost.

    The public call imports ``torch._inductor.config`` (and with it torch._dynamo and triton: ~1.7 s
    of CPU in every rank and CLI process) only to mirror the flag into Inductor's config. Nothing
    here compiles with Inductor, so set the ATen flag directly, and mirror it only when Inductor is
    already loaded (the one case where its config can matter).
    """
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.deterministic = True


def rng_state() -> dict:
    """RNG states as tensors and plain values only (loadable with weights_only=True)."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python_version": py[0],
        "python_state": torch.tensor(py[1], dtype=torch.int64, device="cpu"),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"].tolist()), None))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
