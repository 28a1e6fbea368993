"""A real SLURM cluster on the test machine, started with the project's `.ci/slurm` scripts.

Clusters can run side by side (different state directories and ports): one node, two emulated
nodes ``n1``/``n2`` (two ``slurmd`` on this host), and three (``n1``..``n3``) for heterogeneous jobs. Each node advertises ``cpus`` CPUs
(4 by default, oversubscribing a 2-core machine) so that 4-rank layouts fit. Jobs are
inspected with ``scontrol show job`` (there is no accounting database).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_SCRIPT = REPO / ".ci" / "slurm" / "start-local-slurm.sh"
STOP_SCRIPT = REPO / ".ci" / "slurm" / "stop-local-slurm.sh"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"}


class ClusterUnavailable(RuntimeError):
    """SLURM could not be installed or started here (the message says why)."""


@dataclass
class LocalSlurmCluster:
    nodes: int
    state_dir: Path
    port: int
    cpus: int = 4
    conf: Path | None = None

    @property
    def script_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_LOCAL_DIR": str(self.state_dir), "SLURM_LOCAL_NODES": str(self.nodes),
                "SLURM_LOCAL_PORT": str(self.port), "SLURM_LOCAL_WITH_MPI": "1",
                "SLURM_LOCAL_CPUS": str(self.cpus)}

    @property
    def env(self) -> dict[str, str]:
        """Environment for commands talking to this cluster."""
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        if self.nodes > 1:
            env["OMPI_MCA_btl"] = "self,tcp"  # two emulated nodes on one host: no shared-memory transport
        return env

    def start(self) -> "LocalSlurmCluster":
        result = subprocess.run(["bash", str(START_SCRIPT)], env=self.script_env, capture_output=True, text=True,
                                timeout=900)
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-6:])
            raise ClusterUnavailable(f"{START_SCRIPT.name} failed (exit {result.returncode}): {tail}")
        self.conf = Path(result.stdout.strip().splitlines()[-1]) / "slurm.conf"
        return self

    def stop(self) -> None:
        subprocess.run(["bash", str(STOP_SCRIPT)], env=self.script_env, capture_output=True, text=True, timeout=120)

    # ---- commands ------------------------------------------------------------------------
    def run(self, argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)

    def sbatch(self, *args: str) -> str:
        result = self.run(["sbatch", "--parsable", *args])
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once the job is forgotten)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, until, timeout: float, poll: float = 0.25) -> dict[str, str]:
        """Poll the job until ``until(info)`` is true; raise TimeoutError with its state otherwise."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info and until(info):
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s: {info}")

    def wait_done(self, job_id: str, timeout: float = 180) -> dict[str, str]:
        return self.wait(job_id, lambda i: i.get("JobState") in TERMINAL_STATES, timeout)

    def start_now(self, job_id: str) -> None:
        """A requeued job waits ~120 s (BeginTime); let it start almost at once.

        slurmd refuses a job whose new credential carries the same second as the revocation
        done by the requeue ("Job credential revoked"), so the first second is waited out.
        """
        time.sleep(1.5)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def cancel_all(self) -> None:
        ids = self.run(["squeue", "-h", "-o", "%A"]).stdout.split()
        if ids:
            self.run(["scancel", *ids])
