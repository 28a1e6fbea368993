"""``rl.disaggregated.weight_sync: broadcast``: the trainer pushes each policy version to the
inference servers over a process group (issue 25, seed 004; prime-rl / verl's weight broadcast).

After the optimiser step of version ``v`` the trainer's first rank (the root; it holds whole
tensors, checked at start-up) finds the servers alive (``/health`` of the URLs the orchestrator
wrote, :func:`~.exchange.read_servers`), and for those ``n``:

1. asks each, on its own thread, to join update ``v``'s group as rank ``i`` (``POST
   /update_weights`` with the group's address and the tensor manifest,
   :mod:`megatron_s2.serve.weights_api`) — the servers check the manifest and join;
2. joins as rank 0 (the ``TCPStore`` it hosts for the whole run; the group's prefix names the
   version) and broadcasts every tensor (:func:`~megatron_s2.inference.weight_broadcast.send`);
3. waits for the servers' answers: each has swapped the weights in between two engine steps and
   serves version ``v``.

Only then does the trainer publish version ``v``'s checkpoint (:mod:`.trainer`): when the
orchestrator sees it and asks the servers to load it, they already serve ``v`` (a no-op). The
checkpoint stays the fallback: a server that was down, restarted (it starts from the phase's
initial weights) or failed during a broadcast is loaded from it by the orchestrator when it is
back (:class:`~.served_backend.ServedRolloutBackend`), and is a member of the next broadcast
anyway. A failed broadcast is logged and counted (``weight_sync_failed``), never fatal: the
servers that missed it load the checkpoint.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.weight_broadcast import BroadcastSpec, manifest_of, open_group, send
from megatron_s2.parallel.sharding import shard_spec
from megatron_s2.posttrain.disaggregated.exchange import read_servers

__all__ = ["BroadcastWeightSync", "check_broadcast_layout"]


def check_broadcast_layout(model: torch.nn.Module) -> None:
    """The root sends whole tensors: every tensor of its model must be whole on it."""
    for name, t in model.state_dict(keep_vars=True).items():
        if tuple(shard_spec(t).full_shape) != tuple(t.shape):
            raise ConfigError(f"rl.disaggregated.weight_sync: 'broadcast' sends whole tensors from the trainer's first "
                              f"rank, but this layout shards '{name}' ({list(t.shape)} of "
                              f"{list(shard_spec(t).full_shape)}); use tp = pp = ep = cp = 1 (data parallel only) "
                              "or weight_sync: checkpoint")


def _advertised_host(urls: list[str]) -> str:
    """The address the servers reach the trainer's store at: loopback when they all run here."""
    hosts = {urlsplit(u).hostname for u in urls}
    return "127.0.0.1" if hosts <= {"127.0.0.1", "localhost"} else socket.getfqdn()


class BroadcastWeightSync:
    """The root's side (module docstring); ``push`` is called on the trainer's first rank only."""

    def __init__(self, model: torch.nn.Module, run_dir: Path, config, *, device, log=print):
        import httpx
        import torch.distributed as dist

        check_broadcast_layout(model)
        self.model, self.run_dir, self.config, self.log = model, Path(run_dir), config, log
        self.device = torch.device(device) if config.broadcast_backend == "nccl" else torch.device("cpu")
        self.manifest = manifest_of(model.state_dict())
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self._http = httpx.Client(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0))
        self._servers: list[str] | None = None

    def close(self) -> None:
        self._http.close()

    def _live(self) -> list[str]:
        if self._servers is None:
            self._servers = read_servers(self.run_dir, self.config.server_wait_s)
        live = []
        for url in self._servers:
            try:
                if self._http.get(f"{url}/health", timeout=2.0).status_code == 200:
                    live.append(url)
            except Exception:  # noqa: BLE001 - down: it loads the checkpoint when it is back
                pass
        return live

    def push(self, version: int) -> dict[str, float]:
        """Broadcast version ``version`` to every live server; metrics ``weight_sync_*``."""
        t0 = time.perf_counter()
        live = self._live()
        if not live:
            self.log(f"weight sync: no inference server is up for version {version}; they load its checkpoint when back")
            return {"weight_sync_s": 0.0, "weight_sync_servers": 0.0, "weight_sync_failed": 1.0}
        spec = BroadcastSpec(host=_advertised_host(live), port=self.store.port, prefix=f"v{version}",
                             rank=0, world_size=len(live) + 1, backend=self.config.broadcast_backend,
                             timeout_s=self.config.request_timeout_s)
        tensors = [e.to_json() for e in self.manifest]
        answers: dict[str, str] = {}

        def ask(i: int, url: str) -> None:
            body = {"version": version, "broadcast": {"group": spec.for_rank(i + 1).to_json(), "tensors": tensors}}
            try:
                r = self._http.post(f"{url}/update_weights", json=body)
                answers[url] = "ok" if r.status_code in (200, 409) else f"{r.status_code} {r.text[:200]}"
            except Exception as exc:  # noqa: BLE001 - reported below
                answers[url] = type(exc).__name__

        threads = [threading.Thread(target=ask, args=(i, u), daemon=True) for i, u in enumerate(live)]
        for t in threads:
            t.start()
        sent, error = 0, None
        try:
            sent = send(open_group(spec, store=self.store), self.model.state_dict(), self.manifest, self.device)
        except Exception as exc:  # noqa: BLE001 - a member died or never joined: the checkpoint covers it
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        for t in threads:
            t.join()
        failed = {u: a for u, a in answers.items() if a != "ok"}
        if error or failed:
            self.log(f"weight sync: broadcast of version {version} incomplete ({error or ''}"
                     f"{'; ' if error and failed else ''}{'; '.join(f'{u}: {a}' for u, a in failed.items())}); "
                     "those servers load its checkpoint")
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(sent),
                "weight_sync_servers": float(len(live) - len(failed)), "weight_sync_failed": float(bool(error or failed))}
