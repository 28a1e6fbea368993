"""Build the token-level datastore from the frozen backbone (walkthrough Ch. 2, Step 1).

Every document of the domain corpus is cut into windows of ``seq_length`` tokens (the phase's
training shape, so a key sees the same amount of context as the queries of training); for each
position t whose next token is a target, the key is the backbone's normalised last hidden
state at t and the value is token t + 1. The datastore is cached as ``datastore.safetensors`` in
the run directory with the fingerprint of what built it (backbone weights, corpus, window);
a resumed phase reads it back, a changed backbone or corpus rebuilds it. Under a layout every
rank holds its own shards of the backbone, so the fingerprint is that of every rank's weights
together (:func:`layout_fingerprint`), and the ranks read or build together (one rank building
alone would wait in the backbone's tp collectives for ranks that read the cache).

Every rank builds the same datastore: the backbone holds every layer on each rank and its hidden
state is read whole over tp (:func:`~.forward.last_hidden`), so a layout changes the keys
only by its reduction order (tp2: 7e-7 of their scale; values identical,
tests/memory_decoder/test_layouts.py); the rank with ``save`` writes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_s2.models.memory_decoder.knn import Datastore, DatastoreError
from megatron_s2.posttrain.memdec.forward import last_hidden

__all__ = ["DATASTORE_FILE", "document_windows", "build_datastore", "weights_fingerprint", "layout_fingerprint",
           "datastore_meta", "load_or_build_datastore"]

DATASTORE_FILE = "datastore.safetensors"


def document_windows(stores, seq_length: int):
    """(offset in the document, tokens [n] int64, next-token target flags [n]) of each window of
    each document."""
    for store in stores:
        for index in range(len(store)):
            tokens = np.asarray(store.tokens(index), dtype=np.int64)
            targets = np.asarray(store.targets(index), dtype=bool)
            for start in range(0, max(len(tokens) - 1, 0), seq_length):
                window = tokens[start:start + seq_length + 1]
                if len(window) >= 2:
                    yield start, window, targets[start + 1:start + len(window)]


@torch.no_grad()
def build_datastore(backbone, stores, *, seq_length: int, pad_id: int, batch_size: int = 16,
                    device: torch.device | str = "cpu", meta: dict | None = None) -> Datastore:
    """The datastore of ``stores`` (DocumentStores) under ``backbone`` (module docstring)."""
    keys, values = [], []
    batch: list[tuple[np.ndarray, np.ndarray]] = []

    def flush():
        # rows padded at the end to the training shape: a causal model's earlier positions do not see the padding
        tokens = torch.full((len(batch), seq_length), pad_id, dtype=torch.long)
        for row, (window, _) in enumerate(batch):
            tokens[row, :len(window) - 1] = torch.from_numpy(window[:-1])
        hidden = last_hidden(backbone, {"tokens": tokens.to(device)})
        for row, (window, is_target) in enumerate(batch):
            n = len(window) - 1
            keep = torch.from_numpy(is_target[:n].copy())
            keys.append(hidden[row, :n].cpu()[keep])
            values.append(torch.from_numpy(window[1:n + 1].copy())[keep])
        batch.clear()

    for _, window, is_target in document_windows(stores, seq_length):
        batch.append((window, is_target))
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not keys:
        raise DatastoreError("datastore: the domain corpus has no target positions")
    return Datastore(torch.cat(keys), torch.cat(values), dict(meta or {}))


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """A digest of a model's weights (names, shapes, float64 sums): the same path retrained is a
    different backbone, and its datastore must be rebuilt."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().double()
        digest.update(f"{name}:{tuple(tensor.shape)}:{float(values.sum()):.12e}:{float(values.abs().sum()):.12e}".encode())
    return digest.hexdigest()[:32]


def layout_fingerprint(model) -> str:
    """:func:`weights_fingerprint` of every rank's part of ``model`` together (the same on every rank;
    one rank's own digest when no process group is running)."""
    own = weights_fingerprint(model)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return own
    every: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return hashlib.sha256("/".join(every).encode()).hexdigest()[:32]


def _on_every_rank(ok: bool, device) -> bool:
    """``ok`` and-ed over every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def datastore_meta(backbone_fingerprint: str, data_cfg, seed: int, seq_length: int) -> dict:
    """What a cached datastore must have been built from to be reused."""
    data = json.loads(json.dumps(dataclasses.asdict(data_cfg), default=str))
    return {"backbone": backbone_fingerprint, "data": data, "seed": seed, "seq_length": seq_length}


def load_or_build_datastore(run_dir: Path, backbone, stores, *, meta: dict, seq_length: int, pad_id: int,
                            device, save: bool, log=print) -> Datastore:
    """The cached datastore of ``run_dir`` when it was built from ``meta``, else a new one (saved
    by the rank with ``save``)."""
    path = Path(run_dir) / DATASTORE_FILE
    cached, problem = None, None
    if path.is_file():
        try:
            cached = Datastore.load(path, expect_meta=meta)
        except DatastoreError as exc:
            problem = exc
    if _on_every_rank(cached is not None, device):  # every rank reads, or every rank builds (module docstring)
        log(f"memdec: datastore of {len(cached)} keys read from {path}")
        return cached
    if path.is_file():
        log(f"memdec: rebuilding the datastore ({problem or 'another rank could not read it'})")
    store = build_datastore(backbone, stores, seq_length=seq_length, pad_id=pad_id, device=device, meta=meta)
    if save:
        store.save(path)
    log(f"memdec: datastore of {len(store)} keys (dim {store.keys.size(1)}) built from the frozen backbone"
        + (f", saved to {path}" if save else ""))
    return store
