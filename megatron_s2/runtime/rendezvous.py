"""Where is rank 0, and who am I? Rendezvous discovery from the launcher's environment.

Sources, in order of precedence:

1. **torchrun** (and `megatron-s2 launch --local`): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
2. **mpirun / mpiexec** (Open MPI ``OMPI_COMM_WORLD_*``, MPICH/Hydra ``PMI_RANK``/``PMI_SIZE``,
   MVAPICH ``MV2_COMM_WORLD_*``): rank and size from MPI; rank 0 picks the address and port
   and broadcasts them with mpi4py. It outranks SLURM because ranks started by ``mpirun``
   inside a batch job inherit the batch shell's ``SLURM_PROCID=0``.
3. **SLURM step** (``srun``, with or without ``--mpi=pmix``): ``SLURM_PROCID``,
   ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the tasks on this node from
   ``SLURM_STEP_TASKS_PER_NODE``; rank 0's node is the first of the step's node list
   (``scontrol show hostnames``, or our own hostlist parser where ``scontrol`` is absent,
   e.g. inside a container); the port is derived from the job id so all ranks agree
   without talking. ``SLURM_STEP_ID`` must be set: the batch shell itself is no rank.
4. **PMIx without SLURM** (``PMIX_RANK``, e.g. ``prterun``): via mpi4py, like 2.
5. Otherwise a single process.

``MASTER_ADDR``/``MASTER_PORT`` from the environment always win over derived values.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Rendezvous", "detect_source", "discover", "expand_hostlist", "slurm_port", "SOURCES",
           "SLURM_PORT_BASE", "SLURM_PORT_SPAN"]

SOURCES = ("torchrun", "mpi", "slurm", "single")

SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000
"""Ports derived from SLURM job ids: 10000-29999, below Linux's ephemeral range (32768+)."""

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """Which of :data:`SOURCES` provided it."""


def detect_source(env: Mapping[str, str]) -> str:
    """The rendezvous source the environment describes (see the module docstring)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if any(v in env for v in _MPI_RANK_VARS):
        return "mpi"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return "slurm"
    if "PMIX_RANK" in env:
        return "mpi"
    return "single"


def discover(env: Mapping[str, str] | None = None, source: str = "auto") -> Rendezvous:
    """Rendezvous information from ``env`` (default: os.environ); ``source`` forces a path."""
    env = os.environ if env is None else env
    source = detect_source(env) if source == "auto" else source
    if source == "torchrun":
        return _from_torchrun(env)
    if source == "slurm":
        return _from_slurm(env)
    if source == "mpi":
        return _from_mpi(env)
    if source == "single":
        return Rendezvous(0, 1, 0, 1, "127.0.0.1", 0, "single")
    raise ValueError(f"unknown rendezvous source {source!r}; use one of {('auto',) + SOURCES}")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"rendezvous: environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"rendezvous: {name}={value!r} is not an integer") from None


# ---- torchrun ----------------------------------------------------------------------------
def _from_torchrun(env: Mapping[str, str]) -> Rendezvous:
    world = _int(env, "WORLD_SIZE")
    return Rendezvous(
        rank=_int(env, "RANK"), world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
        source="torchrun")


# ---- SLURM -------------------------------------------------------------------------------
def slurm_port(job_id: int) -> int:
    """The port every rank of a job derives alike from the job id."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def expand_hostlist(expr: str) -> list[str]:
    """Expand a SLURM hostlist (``gpu[01-03,07],rack[1-2]-n[1-2]``) like ``scontrol show hostnames``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    items.append(expr[start:])
    return [host for item in items if item for host in _expand_item(item)]


def _expand_item(item: str) -> list[str]:
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_item(rest)
    hosts = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        hosts += [f"{prefix}{i:0{len(lo)}d}{tail}" for i in range(int(lo), int(hi or lo) + 1) for tail in tails]
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """``SLURM_STEP_TASKS_PER_NODE`` ("2(x3),1") -> tasks on node ``node_id``."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise RuntimeError(f"rendezvous: cannot parse SLURM tasks per node {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else counts[-1]


def _first_node(nodelist: str) -> str:
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    return expand_hostlist(nodelist)[0]


def _routable(node: str) -> str:
    """The node name if it resolves, else its SLURM NodeAddr (emulated or DNS-less nodes)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except socket.gaierror:
        pass
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True)
        match = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        if match:
            return match.group(1)
    raise RuntimeError(f"rendezvous: head node {node!r} does not resolve and SLURM knows no address for it; "
                       "set MASTER_ADDR")


def _from_slurm(env: Mapping[str, str]) -> Rendezvous:
    world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = _tasks_on_node(tasks, _int(env, "SLURM_NODEID", 0)) if tasks else world
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise RuntimeError("rendezvous: SLURM_STEP_NODELIST/SLURM_JOB_NODELIST not set; set MASTER_ADDR")
        addr = _routable(_first_node(nodelist))
    port = _int(env, "MASTER_PORT", 0) or slurm_port(_int(env, "SLURM_JOB_ID"))
    return Rendezvous(rank=_int(env, "SLURM_PROCID"), world_size=world, local_rank=_int(env, "SLURM_LOCALID", 0),
                      local_world_size=local_world, master_addr=addr, master_port=port, source="slurm")


# ---- MPI ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _from_mpi(env: Mapping[str, str]) -> Rendezvous:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("rendezvous: launched by MPI but mpi4py is not importable "
                           f"({exc}); pip install mpi4py, or set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT") from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    proposal = None
    if rank == 0:
        proposal = (env.get("MASTER_ADDR") or socket.getfqdn(), _int(env, "MASTER_PORT", 0) or _free_port())
    addr, port = comm.bcast(proposal, root=0)
    return Rendezvous(rank, world, local_rank, local_world, addr, port, "mpi")
