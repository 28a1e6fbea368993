"""``POST /update_weights``: reload the policy from a checkpoint directory (disaggregated RL, issue 25).

The trainer of ``rl.mode: disaggregated`` publishes each policy version as a checkpoint; the
orchestrator asks every server to load it (seed 004: the servers consume the trainer's weights).
Request::

    {"path": "<run>/disaggregated/weights/step_00000012", "version": 12}

The checkpoint is read off the event loop (any checkpoint form :func:`read_checkpoint` takes),
then copied into the engine's model as a driver side task — *between two engine steps*, so no
forward ever sees half the new weights — and the engine's policy version becomes ``version``.
Requests in flight keep their KV and continue under the new weights (partial rollout): every
token carries the version that produced it (``policy_versions`` of ``/inference/v1/generate``).
Weights of another architecture are refused (400) even when every tensor shape fits
(:func:`~megatron_s2.inference.weights.check_same_architecture`: the family's released-format
description must match; training-only fields may differ). A version older than the served one
is refused (409), one equal to it is a no-op; answers
``{"policy_version", "path", "load_s", "swap_s"}``.

``rl.disaggregated.weight_sync: broadcast`` sends the weights over a process group instead of a
path (:mod:`megatron_s2.inference.weight_broadcast`)::

    {"version": 12, "broadcast": {"group": {"host", "port", "prefix", "rank", "world_size", "backend",
                                            "timeout_s"},
                                  "tensors": [[name, shape, dtype], ...]}}

The server checks the manifest against its model (400 naming the tensor, before it joins), joins
the group, receives every tensor, then swaps them in between two engine steps as above. A member
always receives, even when the version turns out not to be newer (the root waits for every
member): the answer is then 409 / the no-op. A group that breaks (another member died, the trainer
abandoned the update) is a 503 at once, the served weights unchanged. ``timeout_s`` above the
server's ``max_broadcast_timeout_s`` is refused (400): no broadcast holds the update lock, which a
checkpoint update waits for, longer than that.
"""

from __future__ import annotations

import asyncio
import time

import torch

from fastapi.responses import JSONResponse

from megatron_s2.config.schema import ConfigError
from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, read_json_object
from megatron_s2.serve.state import ServerState

__all__ = ["update_weights"]



async def update_weights(state: ServerState, request):
    from megatron_s2.inference.weights import check_same_architecture, read_checkpoint

    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    version = f.int("version", None, minimum=0)
    if f.has("broadcast"):
        if version is None:
            f.fail("version", "give the policy version of these weights (an integer >= 0)")
        return await _receive_broadcast(state, f.object("broadcast"), version)
    path = f.str("path")
    if not path:
        f.fail("path", "give the checkpoint directory to load (or a broadcast group)")
    if version is None:
        f.fail("version", "give the policy version of these weights (an integer >= 0)")
    engine = state.backend.engine
    async with _update_lock(state):
        if version < engine.policy_version:
            return JSONResponse({"error": {"message": f"version: {version} is older than the served policy version "
                                           f"{engine.policy_version}", "type": "Conflict", "code": 409}},
                                status_code=409)
        if version == engine.policy_version:
            return {"policy_version": version, "path": path, "load_s": 0.0, "swap_s": 0.0}
        t0 = time.perf_counter()
        try:  # reading and checking the files happens on a worker thread: other clients go on
            loaded = await asyncio.to_thread(read_checkpoint, path)
            check_same_architecture(engine.model.config, loaded.model_config, path)
        except ConfigError as exc:
            raise BadRequest(f"path: {exc}", param="path") from None
        t1 = time.perf_counter()
        try:  # the copy itself: between two engine steps (AsyncEngine.run)
            await state.backend.run(engine.update_weights, loaded.state, version)
        except (ConfigError, ValueError) as exc:
            raise BadRequest(f"path: {path} does not fit the served model ({exc})", param="path") from None
    return {"policy_version": version, "path": path, "load_s": t1 - t0, "swap_s": time.perf_counter() - t1}


async def _receive_broadcast(state: ServerState, f: Fields, version: int):
    """The ``broadcast`` form (module docstring)."""
    from megatron_s2.inference.weight_broadcast import (BroadcastSpec, TensorEntry, check_manifest, close_group, join_group,
                                                        receive)

    group = f.object("group")
    try:
        spec = BroadcastSpec(host=group.str("host") or "", port=group.int("port", 0, minimum=1, maximum=65535),
                             prefix=group.str("prefix") or "", rank=group.int("rank", 0, minimum=1),
                             world_size=group.int("world_size", 0, minimum=2),
                             backend=group.str("backend", "gloo"),
                             timeout_s=group.float("timeout_s", 60.0, minimum=1,
                                                   maximum=state.config.max_broadcast_timeout_s))
    except TypeError:
        f.fail("group", "give host, port, prefix, rank and world_size")
    if not spec.host or not spec.prefix or not 1 <= spec.rank < spec.world_size:
        f.fail("group", "give host, prefix and a rank in 1..world_size-1 (rank 0 is the sender)")
    if spec.backend not in ("gloo", "nccl"):
        f.fail("group.backend", f"must be 'gloo' or 'nccl', got {spec.backend!r}")
    try:
        manifest = [TensorEntry.from_json(item) for item in f.raw("tensors", [])]
    except (TypeError, ValueError):
        f.fail("tensors", "must be a list of [name, shape, dtype]")
    engine = state.backend.engine
    own = engine.model.state_dict()
    why = check_manifest(manifest, own)
    if why is not None:
        f.fail("tensors", why)
    # gloo moves host memory; NCCL the server's GPU
    device = next(iter(own.values())).device if spec.backend == "nccl" else torch.device("cpu")
    async with _update_lock(state):
        t0 = time.perf_counter()

        def join_and_receive():
            group = join_group(spec)
            try:
                return receive(group, manifest, device)
            finally:
                close_group(group)

        try:  # the event loop serves other clients meanwhile
            received = await asyncio.to_thread(join_and_receive)
        except Exception as exc:  # noqa: BLE001 - a member or the root failed: the lock is released with this answer
            return _broadcast_failed(spec, exc)
        t1 = time.perf_counter()
        if version < engine.policy_version:
            return JSONResponse({"error": {"message": f"version: {version} is older than the served policy version "
                                           f"{engine.policy_version}", "type": "Conflict", "code": 409}},
                                status_code=409)
        if version == engine.policy_version:
            return {"policy_version": version, "path": None, "load_s": t1 - t0, "swap_s": 0.0}
        weights = {name: received[name] for name in own}
        await state.backend.run(engine.update_weights, weights, version)
    return {"policy_version": version, "path": None, "load_s": t1 - t0, "swap_s": time.perf_counter() - t1}


def _broadcast_failed(spec, exc: Exception) -> JSONResponse:
    """503: the update's group broke (a member died, the trainer gave up); nothing was swapped and
    the server keeps serving its version until the checkpoint reaches it."""
    why = " ".join(str(exc).split())[:200]
    return JSONResponse({"error": {"message": f"broadcast: update {spec.prefix} failed ({type(exc).__name__}: {why}); "
                                   "the served weights are unchanged", "type": "ServiceUnavailable", "code": 503}},
                        status_code=503)


def _update_lock(state: ServerState) -> asyncio.Lock:
    """The server's reload lock, bound to its event loop."""
    lock = getattr(state, "_update_weights_lock", None)
    if lock is None:
        lock = asyncio.Lock()
        state._update_weights_lock = lock
    return lock
