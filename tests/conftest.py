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


@pytest.fixture
def one_thread_children(monkeypatch):
    """``OMP_NUM_THREADS=1`` in the environment this test's child processes inherit (CLI runs,
    launches, servers); this process keeps its own thread count (read once, when torch loaded).
    On 2 cores that other work also uses, a child's 2-thread OpenMP team waits at every tiny
    op's barrier for a thread that is not running: test_e2e_tiny's OPD run took 128-276 s with
    2 threads and 24-26 s with 1 beside other jobs (load 3-4), two copies of it side by side 434 s
    and 35 s. Alone on a quiet machine the two are about as fast for these tiny models (SFT of
    `tiny`: ~1.3 s/step with one thread idle, 1.4 s/step with two at load 1).
    Modules that spawn runs opt in with ``pytestmark = pytest.mark.usefixtures("one_thread_children")``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
