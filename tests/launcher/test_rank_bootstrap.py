"""Rank discovery and torch.distributed start-up under every launcher we support."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_helpers import ALLREDUCE

from megatron_s2.runtime.bootstrap import init_distributed
from megatron_s2.runtime.rendezvous import detect_source, discover, expand_hostlist, slurm_port


def records(out_dir: Path, world: int) -> list[dict]:
    found = sorted(out_dir.glob("rank*.json"))
    assert len(found) == world, f"{len(found)} of {world} ranks reported"
    return [json.loads(p.read_text()) for p in found]


def check_world(recs: list[dict], world: int, source: str) -> None:
    assert sorted(r["rank"] for r in recs) == list(range(world))
    assert all(r["world_size"] == world and r["source"] == source and r["backend"] == "gloo" for r in recs)
    assert all(r["sum"] == world * (world + 1) / 2 for r in recs), "all_reduce over the whole world"


# ---- discovery from environment variables (no processes) ---------------------------------
SLURM_STEP = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123457",
              "SLURM_STEP_NODELIST": "gpu[07-08]", "MASTER_ADDR": "gpu07"}


@pytest.mark.parametrize("env, source", [
    ({}, "single"),
    ({"RANK": "1", "WORLD_SIZE": "2", **SLURM_STEP}, "torchrun"),
    (SLURM_STEP, "slurm"),
    ({**SLURM_STEP, "PMIX_RANK": "3"}, "slurm"),                     # srun --mpi=pmix
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_RANK": "1"}, "mpi"),  # mpirun in sbatch
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "single"),           # the batch shell is no rank
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
    ({"PMIX_RANK": "0"}, "mpi"),
])
def test_detect_source(env, source):
    assert detect_source(env) == source


def test_slurm_step_rendezvous():
    rdv = discover(SLURM_STEP)
    assert (rdv.rank, rdv.world_size, rdv.local_rank, rdv.local_world_size) == (3, 4, 1, 2)
    assert rdv.master_addr == "gpu07" and rdv.master_port == slurm_port(123457) == 10000 + 123457 % 20000
    uneven = discover({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"})
    assert uneven.local_world_size == 1
    assert discover({**SLURM_STEP, "MASTER_PORT": "4000"}).master_port == 4000


def test_torchrun_rendezvous():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h0",
           "MASTER_PORT": "29400"}
    assert discover(env).__dict__ == {"rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4,
                                      "master_addr": "h0", "master_port": 29400, "source": "torchrun"}


HOSTLISTS = {"vm": ["vm"], "gpu[01-03,07],login1": ["gpu01", "gpu02", "gpu03", "gpu07", "login1"],
             "rack[1-2]-n[8-10]": ["rack1-n8", "rack1-n9", "rack1-n10", "rack2-n8", "rack2-n9", "rack2-n10"],
             "a[09-11],c": ["a09", "a10", "a11", "c"]}


def test_expand_hostlist():
    for expr, hosts in HOSTLISTS.items():
        assert expand_hostlist(expr) == hosts, expr


def test_expand_hostlist_agrees_with_scontrol(slurm):
    for expr, hosts in HOSTLISTS.items():
        assert slurm.run(["scontrol", "show", "hostnames", expr]).stdout.split() == hosts, expr


def test_single_process_needs_no_process_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed()
    assert (info.rank, info.world_size, info.backend, info.source) == (0, 1, "none", "single")


# ---- real launchers ----------------------------------------------------------------------
@pytest.mark.slow
def test_mpirun(mpirun, tmp_path):
    result = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
                             str(ALLREDUCE), str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    recs = records(tmp_path, 2)
    check_world(recs, 2, "mpi")
    assert all(r["mpi_rank"] == r["rank"] and r["local_world_size"] == 2 for r in recs)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["auto", "mpi"])
def test_srun_mpi_pmix(slurm, tmp_path, source):
    """srun --mpi=pmix: auto takes the SLURM step variables; forcing mpi goes through mpi4py/PMIx."""
    result = slurm.run(["srun", "--mpi=pmix", "-n", "2", sys.executable, str(ALLREDUCE), str(tmp_path), source],
                       timeout=180)
    assert result.returncode == 0, result.stderr
    recs = records(tmp_path, 2)
    check_world(recs, 2, "slurm" if source == "auto" else "mpi")
    if source == "mpi":
        assert all(r["mpi_rank"] == r["rank"] for r in recs)


@pytest.mark.slow
def test_srun_two_nodes(slurm2, tmp_path):
    """Two emulated nodes: the head node 'n1' does not resolve, so its SLURM NodeAddr is used."""
    result = slurm2.run(["srun", "-N", "2", "--ntasks-per-node=1", sys.executable, str(ALLREDUCE), str(tmp_path)],
                        timeout=180)
    assert result.returncode == 0, result.stderr
    recs = records(tmp_path, 2)
    check_world(recs, 2, "slurm")
    assert all(r["local_rank"] == 0 and r["local_world_size"] == 1 for r in recs)


# ---- the rendezvous socket a local launcher hands to rank 0 ------------------------------
def test_rank0_takes_the_launchers_listening_socket_and_hides_it_from_its_children():
    import socket

    from megatron_s2.launcher.local import listening_socket
    from megatron_s2.runtime.store_fd import STORE_FD_ENV, take_store_fd

    with listening_socket() as sock:
        with pytest.raises(OSError):  # already taken: no one else can bind it in the meantime
            socket.create_server(("127.0.0.1", sock.getsockname()[1]))
        env = {STORE_FD_ENV: str(sock.fileno())}
        assert take_store_fd(env) == sock.fileno() and STORE_FD_ENV not in env
    assert take_store_fd({STORE_FD_ENV: "not-a-number"}) is None
    assert take_store_fd({STORE_FD_ENV: "987654"}) is None  # not inherited: bind as usual
    assert take_store_fd({}) is None
