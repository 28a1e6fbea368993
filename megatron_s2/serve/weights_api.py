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
"""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse

from megatron_s2.config.schema import ConfigError
from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, read_json_object
from megatron_s2.serve.state import ServerState

__all__ = ["update_weights"]



async def update_weights(state: ServerState, request):
    from megatron_s2.inference.weights import check_same_architecture, read_checkpoint

    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    path = f.str("path")
    if not path:
        f.fail("path", "give the checkpoint directory to load")
    version = f.int("version", None, minimum=0)
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


def _update_lock(state: ServerState) -> asyncio.Lock:
    """The server's reload lock, bound to its event loop."""
    lock = getattr(state, "_update_weights_lock", None)
    if lock is None:
        lock = asyncio.Lock()
        state._update_weights_lock = lock
    return lock
