"""``rl.disaggregated.weight_sync: broadcast``: the trainer pushes each policy version to the
inference servers over a process group (issue 25, seed 004; prime-rl / verl's weight broadcast).

After the optimiser step of version ``v`` the trainer's first rank (the root) finds the servers
alive (``/health`` of the URLs the orchestrator wrote, :func:`~.exchange.read_servers`), and for
those ``n``:

1. asks each, on its own thread, to join update ``v``'s group as rank ``i`` (``POST
   /update_weights`` with the group's address and the tensor manifest — global names, shapes,
   dtypes, :mod:`megatron_s2.serve.weights_api`); the servers check the manifest and join;
2. waits until every member has announced itself in the ``TCPStore`` it hosts for the whole run
   (:func:`~megatron_s2.inference.weight_broadcast.gather_members`; the group's prefix names the
   version) — a member that answers first (a 400, a dead server) abandons the update at once and
   the members that came are told to leave — then joins as rank 0 and tells the other trainer ranks to go on (one broadcast of a flag over the
   trainer's world: a failed group is skipped by all alike);
3. for each bucket of the manifest (:func:`~megatron_s2.inference.weight_broadcast.buckets`)
   every trainer rank writes the slices it owns by the typed parallel plan's shard specs into a
   zero buffer of the bucket's *global* tensors and one all-reduce assembles them
   (:func:`~megatron_s2.posttrain.rollout.weights.assemble`, the co-located transfer's step: any
   tp / pp / ep / cp layout); the root broadcasts the bucket to the servers;
4. waits for the servers' answers: each has swapped the weights in between two engine steps and
   serves version ``v``.

Only then does the trainer publish version ``v``'s checkpoint (:mod:`.trainer`): when the
orchestrator sees it and asks the servers to load it, they already serve ``v`` (a no-op). The
checkpoint stays the fallback: a server that was down, restarted (it starts from the phase's
initial weights) or failed during a broadcast is loaded from it by the orchestrator when it is
back (:class:`~.served_backend.ServedRolloutBackend`), and is a member of the next broadcast
anyway. A failed broadcast is logged and counted (``weight_sync_failed``), never fatal. A member
that dies part-way makes the root tear the group down at once (the others' receives fail and they
answer 503, their update lock free); no member waits for another longer than
``rl.disaggregated.broadcast_timeout_s``.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from megatron_s2.inference.weight_broadcast import (BroadcastSpec, TensorEntry, buckets, close_group, gather_members,
                                                    open_group)
from megatron_s2.posttrain.disaggregated.exchange import read_servers
from megatron_s2.posttrain.rollout.weights import assemble, global_plan

__all__ = ["BroadcastWeightSync"]


def _advertised_host(urls: list[str]) -> str:
    """The address the servers reach the trainer's store at: loopback when they all run here."""
    hosts = {urlsplit(u).hostname for u in urls}
    return "127.0.0.1" if hosts <= {"127.0.0.1", "localhost"} else socket.getfqdn()


class BroadcastWeightSync:
    """Module docstring; built and :meth:`push` ed on every trainer rank (collective)."""

    def __init__(self, model: torch.nn.Module, run_dir: Path, config, *, rank: int = 0, world_size: int = 1,
                 log=print):
        self.run_dir, self.config, self.log = Path(run_dir), config, log
        self.rank, self.world = rank, world_size
        self.source = model.state_dict(keep_vars=True)
        self.plan = global_plan(self.source, world_size)  # collective
        self.manifest = [TensorEntry(n, tuple(self.plan[n]["shape"]), self.plan[n]["dtype"]) for n in sorted(self.plan)]
        self.device = next(iter(self.source.values())).device  # where the trainer's collectives run
        # what the servers' group moves: host memory (gloo) or the root's GPU (NCCL)
        self.wire = self.device if config.broadcast_backend == "nccl" else torch.device("cpu")
        self.store = self._http = None
        self._servers: list[str] | None = None
        if rank == 0:
            import httpx
            import torch.distributed as dist

            self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            self._http = httpx.Client(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0))

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
        self.store = None  # the last reference: the store's server stops and its port is free again

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

    def _agree(self, go: bool) -> bool:
        """The root's decision, on every trainer rank."""
        if self.world == 1:
            return go
        import torch.distributed as dist

        flag = torch.tensor([1 if go else 0], dtype=torch.int32, device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def push(self, version: int) -> dict[str, float]:
        """Broadcast version ``version`` to every live server (collective over the trainer's ranks);
        metrics ``weight_sync_*`` (the root's; zeros elsewhere)."""
        t0 = time.perf_counter()
        group, live, threads, answers, error = None, [], [], {}, None
        if self.rank == 0:
            live = self._live()
            if live:
                spec = BroadcastSpec(host=_advertised_host(live), port=self.store.port, prefix=f"v{version}", rank=0,
                                     world_size=len(live) + 1, backend=self.config.broadcast_backend,
                                     timeout_s=self.config.broadcast_timeout_s)
                tensors = [e.to_json() for e in self.manifest]

                def ask(i: int, url: str) -> None:
                    body = {"version": version, "broadcast": {"group": spec.for_rank(i + 1).to_json(),
                                                              "tensors": tensors}}
                    try:
                        r = self._http.post(f"{url}/update_weights", json=body)
                        answers[url] = "ok" if r.status_code in (200, 409) else f"{r.status_code} {r.text[:200]}"
                    except Exception as exc:  # noqa: BLE001 - reported below
                        answers[url] = type(exc).__name__

                threads = [threading.Thread(target=ask, args=(i, u), name=u, daemon=True) for i, u in enumerate(live)]
                for t in threads:
                    t.start()

                def refused() -> str | None:  # a member that answered before the group formed will not join
                    done = {u: a for u, a in list(answers.items()) if a != "ok"}
                    return "; ".join(f"{u}: {a}" for u, a in done.items()) or None

                try:
                    error = gather_members(spec, self.store, refused)
                    if error is None:
                        group = open_group(spec, store=self.store)
                except Exception as exc:  # noqa: BLE001 - a member never joined: the checkpoint covers it
                    error = _reason(exc)
            else:
                self.log(f"weight sync: no inference server is up for version {version}; they load its checkpoint "
                         "when back")
        sent = 0
        if self._agree(group is not None):
            for bucket in buckets(self.manifest):
                names = [e.name for e in bucket]
                flat, _ = assemble(self.plan, self.source, names, getattr(torch, bucket[0].dtype), self.device,
                                   self.rank, self.world)
                if group is not None and error is None:
                    try:
                        group.broadcast(flat.to(self.wire), 0).wait()
                        sent += flat.numel() * flat.element_size()
                    except Exception as exc:  # noqa: BLE001 - a member died: the others load the checkpoint
                        error = _reason(exc)
                        # torn down now, before waiting for the answers: the members still waiting
                        # for the next bucket see their connections close and answer at once
                        close_group(group, abort=True)
                        group = None  # the last reference: a gloo group's connections close when it is freed
        if self.rank != 0:
            return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": 0.0, "weight_sync_servers": 0.0,
                    "weight_sync_failed": 0.0}
        # a failed update's members answer at once (their group broke or was abandoned); a complete
        # one's swap the weights in between two engine steps first, as a generation call may take
        wait_s = self.config.request_timeout_s if error is None else self.config.broadcast_timeout_s + 5.0
        deadline = time.monotonic() + wait_s
        for t in threads:  # bounded: a member that neither answers nor fails is reported, not waited on
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                answers.setdefault(t.name, "no answer")
        if group is not None:  # after every member has answered: it has read all it was sent
            close_group(group)
        failed = {u: a for u, a in answers.items() if a != "ok"}
        if error or failed:
            said = [error] if error else []
            said += [f"{u}: {a}" for u, a in failed.items() if f"{u}: {a}" not in (error or "")]  # not twice
            self.log(f"weight sync: broadcast of version {version} incomplete ({'; '.join(said)}); "
                     "those servers load its checkpoint")
        ok = not (error or failed) and bool(live)
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(sent),
                "weight_sync_servers": float(len(live) - len(failed)) if error is None else 0.0,
                "weight_sync_failed": float(not ok)}


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
