"""Fixtures for launcher tests: local SLURM clusters, stand-in payloads, job builders.

SLURM tests skip (with the reason) only when the cluster cannot be installed or started here;
set ``MEGATRON_S2_REQUIRE_SLURM=1`` (CI does) to turn that skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import ClusterUnavailable, LocalSlurmCluster

def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: takes tens of seconds (real trainer, two-node SLURM); "
                                       "deselect with -m 'not slow'")


def _start_cluster(nodes: int, port: int, request) -> LocalSlurmCluster:
    state_dir = Path(os.environ.get("MEGATRON_S2_SLURM_DIR", "/tmp/slurm-local")) / f"megatron-s2-{nodes}node"
    cluster = LocalSlurmCluster(nodes, state_dir, port)
    try:
        cluster.start()
    except (ClusterUnavailable, OSError) as exc:
        if os.environ.get("MEGATRON_S2_REQUIRE_SLURM") == "1":
            pytest.fail(f"SLURM required (MEGATRON_S2_REQUIRE_SLURM=1) but unavailable: {exc}")
        pytest.skip(f"local SLURM cluster unavailable: {exc}")
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="session")
def slurm_one_node(request) -> LocalSlurmCluster:
    """One-node SLURM cluster (controller, slurmd, munge; OpenMPI + PMIx installed)."""
    return _start_cluster(1, 6917, request)


@pytest.fixture(scope="session")
def slurm_two_nodes(request) -> LocalSlurmCluster:
    """Two emulated nodes n1, n2 (two slurmd on this host)."""
    return _start_cluster(2, 6927, request)


@pytest.fixture(scope="session")
def slurm_three_nodes(request) -> LocalSlurmCluster:
    """Three emulated nodes n1..n3: a heterogeneous job's components never share a node here
    (SLURM 22.05's backfill plans whole nodes per component), so disaggregated RL's trainer, one
    inference server and the orchestrator need three."""
    return _start_cluster(3, 6937, request)


@pytest.fixture
def slurm(slurm_one_node, monkeypatch) -> LocalSlurmCluster:
    """The one-node cluster, with SLURM_CONF pointing at it for code under test."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_one_node.conf))
    yield slurm_one_node
    slurm_one_node.cancel_all()


@pytest.fixture
def slurm2(slurm_two_nodes, monkeypatch) -> LocalSlurmCluster:
    monkeypatch.setenv("SLURM_CONF", str(slurm_two_nodes.conf))
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    yield slurm_two_nodes
    slurm_two_nodes.cancel_all()


@pytest.fixture
def slurm3(slurm_three_nodes, monkeypatch) -> LocalSlurmCluster:
    monkeypatch.setenv("SLURM_CONF", str(slurm_three_nodes.conf))
    yield slurm_three_nodes
    slurm_three_nodes.cancel_all()


@pytest.fixture
def no_cluster(monkeypatch) -> None:
    """Dry runs judged without a cluster: a running test cluster's sinfo would refuse the
    test's partitions and node counts (that check has its own tests, test_partition_capacity.py)."""
    monkeypatch.setattr("megatron_s2.launcher.capacity.query_partition", lambda partition: None)


@pytest.fixture
def mpirun() -> str:
    path = shutil.which("mpirun")
    if path is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin; .ci/run does)")
    # In a child: MPI_Init in the test process would leak OMPI_*/PMIX_* variables into mpirun.
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mpi4py unusable (pip install mpi4py): {probe.stderr.strip().splitlines()[-1:]}")
    return path
