"""The file queues between the roles of disaggregated RL: batch files and published weights.

``<run>/disaggregated/batches/step_000012.json`` — batch 12 (trained at policy version 12): its
groups of samples (exact token ids, behaviour log-probs, per-token versions, rewards, R3 routing),
the orchestrator's rollout metrics and its state after packaging. Written to a temporary name and
renamed, so a reader never sees half a batch.

``<run>/disaggregated/weights/step_00000012/`` — policy version 12, a committed checkpoint of the model
alone (:class:`~megatron_s2.checkpoint.CheckpointManager`: any training layout, read back whole by
``read_checkpoint``). The newest few are kept; ``POST /update_weights`` loads one.

``<run>/disaggregated/servers.json`` — the inference servers' base URLs, written by the
orchestrator at start-up (it is given them); the trainer reads them to evaluate through the same
servers (:mod:`.served_eval`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["exchange_dir", "BatchQueue", "ORCHESTRATOR_FAILED", "published_versions", "read_servers", "weights_path",
           "weights_root", "write_servers", "WAIT_POLL_S"]

WAIT_POLL_S = 0.05
"""How often a waiting role looks for the file it waits for."""

SERVERS = "servers.json"
"""The servers' URLs in the exchange directory (module docstring); removed by the local launcher
before the roles start, so a resumed trainer never reads a previous launch's."""

ORCHESTRATOR_FAILED = "ORCHESTRATOR_FAILED"
"""Marker in the exchange directory of an orchestrator that stopped with an error (its reason):
the trainer waiting for a batch stops on it instead of waiting out ``batch_wait_s``."""


def exchange_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "disaggregated"


def weights_root(run_dir: Path) -> Path:
    return exchange_dir(run_dir) / "weights"


def weights_path(run_dir: Path, version: int) -> Path:
    """The published checkpoint of policy ``version``."""
    from megatron_s2.checkpoint.store import CheckpointStore

    return CheckpointStore(weights_root(run_dir)).step_dir(version)


def published_versions(run_dir: Path) -> list[int]:
    """Policy versions the trainer has committed, oldest first."""
    from megatron_s2.checkpoint.format import parse_step_name
    from megatron_s2.checkpoint.store import CheckpointStore

    return [parse_step_name(p.name) for p in CheckpointStore(weights_root(run_dir)).committed()]


def write_servers(run_dir: Path, urls: list[str]) -> None:
    """``servers.json`` (module docstring), written whole and renamed into place."""
    path = exchange_dir(run_dir) / SERVERS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"servers": list(urls)}))
    tmp.replace(path)


def read_servers(run_dir: Path, timeout_s: float) -> list[str]:
    """The servers' URLs once the orchestrator has written them; an error naming it after
    ``timeout_s`` or when it failed."""
    path = exchange_dir(run_dir) / SERVERS
    _wait_for(path, exchange_dir(run_dir) / ORCHESTRATOR_FAILED, timeout_s, "the servers' URLs",
              f"no {path} after {timeout_s:.0f} s (the orchestrator writes it at start-up)")
    return list(json.loads(path.read_text())["servers"])


def _wait_for(path: Path, failed: Path, timeout_s: float, what: str, missing: str,
              interrupted=lambda: False) -> bool:
    """Poll until ``path`` exists (True) or ``interrupted()`` (False); an error naming the
    orchestrator when it failed (its ``failed`` marker) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if interrupted():
            return False
        if failed.exists():
            raise RuntimeError(f"disaggregated RL: waiting for {what}: {failed.read_text().strip()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"disaggregated RL: {missing}; is the orchestrator running "
                               "(its log: <run>/logs/orchestrator.log)?")
        time.sleep(WAIT_POLL_S)
    return True


class BatchQueue:
    """Batch files, one per training step, in ``<run>/disaggregated/batches``."""

    def __init__(self, run_dir: Path):
        self.root = exchange_dir(run_dir) / "batches"

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}.json"

    def put(self, step: int, payload: dict) -> Path:
        """Write batch ``step`` atomically (temporary file, fsync, rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_suffix(".json.tmp")
        with open(tmp, "w") as fh:
            json.dump(payload, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(final)
        return final

    def get(self, step: int) -> dict:
        return json.loads(self.path(step).read_text())

    def steps(self) -> list[int]:
        """Steps with a batch file, ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.stem[len("step_"):]) for p in self.root.glob("step_*.json"))

    def wait(self, step: int, timeout_s: float, interrupted=lambda: False) -> dict | None:
        """Batch ``step`` once it exists; None as soon as ``interrupted()`` (a preemption signal);
        an error naming the orchestrator when it failed or after ``timeout_s``."""
        if not _wait_for(self.path(step), self.root.parent / ORCHESTRATOR_FAILED, timeout_s, f"batch {step}",
                         f"no batch for step {step} in {self.root} after {timeout_s:.0f} s", interrupted):
            return None
        return self.get(step)
