"""Suite-wide set-up that must happen before any test module is imported.

Triton's standard library (``tl.zeros``, ``tl.max`` ...) is decorated when ``triton.language`` is
first imported, and only then reads ``TRITON_INTERPRET``. Several of our dependencies import
``triton.language`` (megatron-core, transformers), so the interpreter switch for the CPU kernel
tests is set here, before any test module of any directory is collected, unless a GPU is visible.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (engine/server tests measure nothing and several run
    processes side by side on 2 cores); restores the previous count. Directories and modules opt
    in with ``pytestmark = pytest.mark.usefixtures("one_thread")`` or an autouse wrapper."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
