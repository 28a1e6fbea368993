"""Policy weights over a process group: trainer -> inference servers (issue 25, seed 004).

The Prime Intellect stack (seed 004) has the trainer hand each new policy to the inference
servers, which only consume it; prime-rl and verl do that with a collective broadcast (NCCL on
GPUs) instead of a checkpoint on a shared file system. Here: one *stateless* group per update —
the trainer's first rank (rank 0, the root) and the servers it found alive (ranks 1..n) — formed
through a ``TCPStore`` that the trainer hosts, under a prefix naming the version, independent of
the trainer's own ``torch.distributed`` world (``ProcessGroupGloo`` / ``ProcessGroupNCCL``
built directly on the store, as vLLM's stateless groups are). A new group per update is what
makes membership elastic: a server killed and restarted is simply one of the next update's
members.

The tensors travel in the order of a *manifest* (sorted names, full shapes, dtypes) that the
root sends with the request (``POST /update_weights`` with a ``broadcast`` object,
:mod:`megatron_s2.serve.weights_api`); a receiver checks it against its own model before it
joins, so a mismatch is a 400 naming the tensor, never a silent mis-copy. Same-dtype runs of the
manifest are packed into flat buckets (:func:`buckets`; one broadcast each — the sender assembles
each bucket's global tensors from its layout's shards first), unpacked by the same manifest on
arrival.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch

__all__ = ["BroadcastAborted", "BroadcastSpec", "TensorEntry", "buckets", "check_manifest", "close_group",
           "gather_members", "join_group", "manifest_of", "open_group", "receive"]

BUCKET_BYTES = 64 * 2 ** 20
"""Largest flat buffer of one broadcast."""


@dataclass(frozen=True)
class BroadcastSpec:
    """Where and how one update's group meets (sent to each receiver with its own ``rank``)."""

    host: str
    port: int
    prefix: str
    """Names this update's group in the store (e.g. ``v12``): every update is a new group."""
    rank: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    """Longest wait of any member for the others (joining, then each bucket): a member that died
    stalls the rest no longer than this (``rl.disaggregated.broadcast_timeout_s``)."""

    def for_rank(self, rank: int) -> "BroadcastSpec":
        return BroadcastSpec(**{**asdict(self), "rank": rank})

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @staticmethod
    def from_json(item) -> "TensorEntry":
        name, shape, dtype = item
        return TensorEntry(str(name), tuple(int(n) for n in shape), str(dtype))


def manifest_of(state: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """The tensors of ``state`` in broadcast order (sorted names)."""
    return [TensorEntry(n, tuple(state[n].shape), str(state[n].dtype).replace("torch.", "")) for n in sorted(state)]


def check_manifest(manifest: list[TensorEntry], own: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``manifest`` cannot be loaded into a model whose state is ``own`` (None: it can)."""
    names = [e.name for e in manifest]
    missing = sorted(set(own) - set(names))
    if missing:
        return f"the broadcast lacks '{missing[0]}' ({len(missing)} tensors missing)"
    if len(set(names)) != len(names):
        seen: set[str] = set()
        return f"'{next(n for n in names if n in seen or seen.add(n))}' is listed twice"
    for e in manifest:  # every entry is allocated on arrival: nothing beyond the model's own tensors
        if e.name not in own:
            return f"'{e.name}' is not a tensor of the served model"
        if tuple(own[e.name].shape) != e.shape:
            return f"'{e.name}' is {list(e.shape)} in the broadcast, {list(own[e.name].shape)} here"
        dtype = str(own[e.name].dtype).replace("torch.", "")
        if e.dtype != dtype:
            return f"'{e.name}' is {e.dtype} in the broadcast, {dtype} here"
    return None


def open_group(spec: BroadcastSpec, store=None):
    """The update's group (``store``: the root's own ``TCPStore``; receivers connect to it)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{spec.prefix}/", store)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, options)
    return dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)


JOIN_POLL_S = 0.05
"""How often a joining member checks for the root's go / abort, and the root for its members."""


def _keys(spec: BroadcastSpec) -> tuple[str, str, str]:
    return f"{spec.prefix}/joined", f"{spec.prefix}/go", f"{spec.prefix}/abort"


def join_group(spec: BroadcastSpec):
    """A receiver's side of the rendezvous: announce itself in the root's store, wait for the
    root's *go* (every member is there) or *abort* (one refused or died before joining: the
    update is abandoned, :class:`BroadcastAborted`), then form the group. The root therefore
    never sits in a group's constructor waiting for a member that will not come, and the members
    that did come are let go at once."""
    import time

    import torch.distributed as dist

    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
    joined, go, abort = _keys(spec)
    store.add(joined, 1)
    deadline = time.monotonic() + spec.timeout_s
    while not store.check([go]):
        if store.check([abort]):
            raise BroadcastAborted(f"the trainer abandoned update {spec.prefix}: {store.get(abort).decode()[:200]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not start update {spec.prefix} within {spec.timeout_s:g} s")
        time.sleep(JOIN_POLL_S)
    return open_group(spec, store)


def gather_members(spec: BroadcastSpec, store, failed) -> str | None:
    """The root's side: wait until the ``spec.world_size - 1`` members have announced themselves,
    and tell them to form the group (None), or abandon the update (the reason, a str).
    ``failed()`` names a member that answered without joining (a 400, a dead server), polled while
    waiting: the update is then abandoned at once (the members that came are told to leave) and
    its version reaches the servers as a checkpoint."""
    import time

    joined, go, abort = _keys(spec)
    deadline = time.monotonic() + spec.timeout_s
    while store.add(joined, 0) < spec.world_size - 1:
        why = failed()
        if why is None and time.monotonic() > deadline:
            why = f"not every server joined within {spec.timeout_s:g} s"
        if why is not None:
            store.set(abort, why)
            return why
        time.sleep(JOIN_POLL_S)
    store.set(go, "1")
    return None


class BroadcastAborted(RuntimeError):
    """The root abandoned the update before the group was formed."""


def close_group(group, *, abort: bool = False) -> None:
    """Release an update's group (its connections; an NCCL communicator is not freed by garbage
    collection). Errors here change nothing that was received. ``abort``: the broadcast failed
    part-way — tear the group down at once (NCCL ``abort``), so that the members still waiting for
    the next bucket see their connections close and give up now instead of at ``timeout_s``. A
    gloo group's connections close only when the group object is freed (measured: ``shutdown`` /
    ``abort`` alone leave a waiting member to its timeout): the caller drops its last reference."""
    for how in ("abort", "shutdown") if abort else ("shutdown",):
        try:
            getattr(group, how)()
            return
        except Exception:  # noqa: BLE001 - already broken (a member died) or not offered by this backend
            continue


def buckets(manifest: list[TensorEntry]) -> Iterator[list[TensorEntry]]:
    """Consecutive same-dtype runs of the manifest, each at most :data:`BUCKET_BYTES` (or one tensor)."""
    bucket, used = [], 0
    for e in manifest:
        size = _numel(e.shape) * torch.empty((), dtype=getattr(torch, e.dtype)).element_size()
        if bucket and (e.dtype != bucket[0].dtype or used + size > BUCKET_BYTES):
            yield bucket
            bucket, used = [], 0
        bucket.append(e)
        used += size
    if bucket:
        yield bucket


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@torch.no_grad()
def receive(group, manifest: list[TensorEntry], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a broadcast, by name (on ``device``)."""
    out = {}
    for bucket in buckets(manifest):
        flat = torch.empty(sum(_numel(e.shape) for e in bucket), dtype=getattr(torch, bucket[0].dtype), device=device)
        group.broadcast(flat, 0).wait()
        offset = 0
        for e in bucket:
            n = _numel(e.shape)
            out[e.name] = flat[offset:offset + n].view(e.shape)
            offset += n
    return out
