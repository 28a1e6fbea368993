"""Suite-wide set-up that must happen before any test module is imported.

One intra-op thread everywhere: this process and every process a test starts (CLI runs, launches,
ranks, servers) inherit ``OMP_NUM_THREADS=1``, set before torch (and its OpenMP runtime, which
reads the variable once when it loads) is imported. The suite's models are tiny and its tests
often run several processes side by side on 2 cores; a 2-thread OpenMP team then waits at every
tiny op's barrier for a thread that is not running (8-15x slower modules beside other jobs; the
``one_thread_children`` docstring has figures), and even alone it burns CPU spinning. Runs compared
with each other (a single-rank reference and its ranks, an in-process run and a CLI one) thus
always use the same thread count. A test that needs more sets it itself.

Triton's standard library (``tl.zeros``, ``tl.max`` ...) is decorated when ``triton.language`` is
first imported, and only then reads ``TRITON_INTERPRET``. Several of our dependencies import
``triton.language`` (megatron-core, transformers), so the interpreter switch for the CPU kernel
tests is set here, before any test module of any directory is collected, unless a GPU is visible.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads (see above)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # in case a plugin imported torch first
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restoring the previous count after it. The whole suite
    already runs with one (above); modules keep opting in (``pytestmark =
    pytest.mark.usefixtures("one_thread")`` or an autouse wrapper) so that a test which raised
    the count cannot leak it into them."""
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
    The suite sets the variable for every test now (above); this fixture restores it for a test
    whose earlier code changed it. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread_children")``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# Fixtures that own a machine-wide resource: the local SLURM clusters (fixed state directories,
# ports and munge sockets under /tmp/slurm-local). Under pytest-xdist every test that uses one is
# kept on one worker (``--dist loadgroup``), so two workers never start the same cluster.
_SERIAL_FIXTURES = {"slurm": "slurm", "slurm2": "slurm", "slurm3": "slurm", "slurm_one_node": "slurm",
                    "slurm_two_nodes": "slurm", "slurm_three_nodes": "slurm"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the nodeid's @group
def pytest_collection_modifyitems(config, items):
    for item in items:
        groups = {_SERIAL_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in _SERIAL_FIXTURES}
        for group in groups:
            item.add_marker(pytest.mark.xdist_group(group))
