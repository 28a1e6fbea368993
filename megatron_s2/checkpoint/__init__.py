"""Sharded, layout-independent, crash-safe checkpoints on torch.distributed.checkpoint.

A checkpoint stores every tensor once, under a global name with its global shape: model
parameters and buffers (``model/...``), optimiser state keyed by the parameter it belongs to
(``optim/<kind>/<param>/<key>``, sharded like the parameter, written by the ZeRO-1 owner),
and per-rank RNG states (``rng/<rank>/...``). Non-tensor state — step, data-iterator state,
resolved config, layout, checksums of every file — is the JSON manifest. Any valid layout
(TP, SP, PP with virtual stages, EP, ETP, CP, DP, ZeRO-1, engram-parallel) loads a checkpoint
saved by any other: each rank reads the overlap of the stored chunks with its own slices.

Modules, in the order data flows:

* :mod:`.format` — names, :class:`Manifest`, checksums, durable writes;
* :mod:`.sharded_state` — model / optimiser / RNG state as :class:`~.dcp_io.GlobalShard` dicts;
* :mod:`.dcp_io` — DCP writer, safe reader and planners; :mod:`.safe_pickle` — the index reader
  that refuses arbitrary objects;
* :mod:`.store` — the ``checkpoints/`` directory: commit protocol, ``latest``, retention,
  verification; :mod:`.faults` — kill -9 injection points for tests;
* :mod:`.manager` — :class:`CheckpointManager` used by the trainer (sync or
  :mod:`.async_save` background writes);
* :mod:`.offline` — single-process full-tensor reading/writing and :func:`reshard`;
* :mod:`.describe`, :mod:`.cli` — ``megatron-s2 checkpoint inspect|verify|reshard|export|import``.
"""

from megatron_s2.checkpoint.format import (
           COMMIT,
           LATEST,
           MANIFEST,
           CheckpointError,
           Manifest,
)
from typing import Any

__all__ = [
           "COMMIT",
           "LATEST",
           "MANIFEST",
           "CheckpointError",
           "CheckpointManager",
           "CheckpointStore",
           "LoadedCheckpoint",
           "Manifest",
           "verify_checkpoint",
]

_LAZY = {"CheckpointManager": "manager", "LoadedCheckpoint": "manager", "CheckpointStore": "store",
         "verify_checkpoint": "store"}


def __getattr__(name: str) -> Any:
    """The manager and store (torch.distributed.checkpoint) load on first use, so that importing
    ``megatron_s2.checkpoint.format`` (errors, names) costs nothing."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_s2.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megatron_s2.checkpoint' has no attribute {name!r}")
