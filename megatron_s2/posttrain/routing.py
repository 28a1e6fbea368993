"""Concatenated Rollout Routing Replay (R3) records of samples (report §5.2.1, walkthrough Ch. 4, 6).

During generation the engine records, for every position it feeds through the model, the
experts each MoE layer selected. With partial rollouts a sample is generated in *segments*
under different policy versions; the report's **concatenated routing replay** joins the
routing of every segment instead of recomputing it with the newest checkpoint, and the
training forward replays it so that trainer and sampler evaluate the same sparse sub-network
("TITO preserves the sampled token sequence, R3 the conditional computation path").

A :class:`RoutingRecord` is one sample's record, aligned to its tokens: for each MoE layer
(global layer number, as :class:`~megatron_s2.models.family.routing_replay.RoutingReplay`
keys them) an int32 ``[n, topk]`` tensor for positions ``[start, start + n)``, plus the policy
version that routed each position. A position is routed when it is *fed* to the model: the
prompt at prefill, each generated token at the next decode step. The last sampled token is
never fed, so a complete record covers ``tokens[:-1]`` — exactly the training input (labels
are ``tokens[1:]``). Note the offset at a version switch: the last token generated before
an update is routed by the *new* version when generation resumes.

:meth:`RoutingRecord.batch` builds the per-micro-batch REPLAY object the MoE layers read
(``[b, seq, topk]`` per layer, call 0), padding positions with experts ``0..topk-1``.
Records serialise to JSON-safe dictionaries (base64 of little-endian int32) for the
orchestrator's checkpointed state — no pickle.
"""

from __future__ import annotations

import base64
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay

__all__ = ["RoutingRecord"]


def _encode(t: torch.Tensor) -> dict:
    arr = t.detach().cpu().to(torch.int32).numpy().astype("<i4", copy=False)
    return {"shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def _decode(d: Mapping) -> torch.Tensor:
    shape = [int(x) for x in d["shape"]]
    raw = base64.b64decode(d["data"].encode("ascii"), validate=True)
    arr = np.frombuffer(raw, dtype="<i4")
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"routing record: {arr.size} ids stored for shape {shape}")
    return torch.from_numpy(arr.reshape(shape).astype(np.int32))


class RoutingRecord:
    """Expert ids of one sample: layer -> int32 [n, topk] for positions [start, start + n)."""

    def __init__(self, layers: Mapping[int, torch.Tensor], start: int = 0, versions: torch.Tensor | None = None):
        if not layers:
            raise ValueError("routing record: no MoE layers")
        shapes = {tuple(t.shape) for t in layers.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"routing record: every layer needs ids of one shape [positions, topk], got {sorted(shapes)}")
        if start < 0:
            raise ValueError(f"routing record: start must be >= 0, got {start}")
        self.layers = {int(k): v.detach().to(device="cpu", dtype=torch.int32).contiguous()
                       for k, v in sorted(layers.items())}
        self.start = int(start)
        n = len(self)
        if versions is None:
            versions = torch.full((n,), -1, dtype=torch.int32)
        versions = torch.as_tensor(versions, dtype=torch.int32).reshape(-1)
        if versions.numel() != n:
            raise ValueError(f"routing record: {versions.numel()} versions for {n} positions")
        self.versions = versions

    # ---- shape -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return next(iter(self.layers.values())).size(0)

    @property
    def end(self) -> int:
        return self.start + len(self)

    @property
    def topk(self) -> int:
        return next(iter(self.layers.values())).size(1)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.layers)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RoutingRecord) and self.start == other.start
                and self.layer_ids == other.layer_ids and torch.equal(self.versions, other.versions)
                and all(torch.equal(self.layers[k], other.layers[k]) for k in self.layers))

    def __repr__(self) -> str:
        return f"RoutingRecord(positions {self.start}..{self.end}, {len(self.layers)} layers, topk {self.topk})"

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def from_replay(cls, replay: RoutingReplay, *, row: int = 0, positions: slice | None = None, start: int = 0,
                    version: int = -1) -> "RoutingRecord":
        """From a RECORD-mode forward: each layer's first call, one batch row, optionally a slice
        of its positions (``start`` is the absolute position of the slice's first entry)."""
        records = replay.records()
        if not records:
            raise ValueError("routing record: the RoutingReplay recorded nothing (was it in RECORD mode?)")
        layers = {k: v[0][row] if positions is None else v[0][row, positions] for k, v in records.items()}
        n = next(iter(layers.values())).size(0)
        return cls(layers, start, torch.full((n,), version, dtype=torch.int32))

    @classmethod
    def from_array(cls, ids: torch.Tensor | np.ndarray, layer_ids: Sequence[int], *, start: int = 0,
                   version: int = -1) -> "RoutingRecord":
        """From an engine's per-token array ``[n, num_moe_layers, topk]`` (vLLM-style ``routed_experts``)."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 3 or ids.size(1) != len(layer_ids):
            raise ValueError(f"routed experts: expected [positions, {len(layer_ids)} layers, topk], "
                             f"got {tuple(ids.shape)}")
        return cls({int(layer): ids[:, i] for i, layer in enumerate(layer_ids)}, start,
                   torch.full((ids.size(0),), version, dtype=torch.int32))

    @classmethod
    def concatenate(cls, records: Iterable["RoutingRecord"]) -> "RoutingRecord":
        """§5.2.1 concatenated routing replay: consecutive segments (each starting where the
        previous ended, same layers and topk) joined into one record."""
        records = list(records)
        if not records:
            raise ValueError("routing record: nothing to concatenate")
        first = records[0]
        for prev, rec in zip(records, records[1:]):
            if rec.start != prev.end:
                raise ValueError(f"routing record: segment starting at position {rec.start} does not continue "
                                 f"the previous one ending at {prev.end}")
            if rec.layer_ids != first.layer_ids or rec.topk != first.topk:
                raise ValueError("routing record: segments record different MoE layers or topk")
        layers = {k: torch.cat([r.layers[k] for r in records]) for k in first.layers}
        return cls(layers, first.start, torch.cat([r.versions for r in records]))

    def slice(self, start: int, end: int) -> "RoutingRecord":
        """Absolute positions [start, end) of this record."""
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"routing record: [{start}, {end}) is outside [{self.start}, {self.end})")
        a, b = start - self.start, end - self.start
        return RoutingRecord({k: v[a:b] for k, v in self.layers.items()}, start, self.versions[a:b])

    # ---- replay --------------------------------------------------------------------------------
    def to_replay(self) -> RoutingReplay:
        """REPLAY object for a forward over exactly this record's positions (batch of one)."""
        return RoutingReplay(RoutingMode.REPLAY, {k: [v.unsqueeze(0)] for k, v in self.layers.items()})

    @staticmethod
    def batch(rows: Sequence[Sequence["RoutingRecord"]], seq_length: int,
              device: torch.device | str | None = None) -> RoutingReplay:
        """REPLAY object for a micro-batch ``[len(rows), seq_length]``: each row holds its records
        packed back to back from position 0 (one record per packed sample); the remaining
        positions are padding routed to experts 0..topk-1 (their loss is masked, and
        ``counted`` keeps them out of the routers' expert loads)."""
        flat = [r for row in rows for r in row]
        if not flat:
            raise ValueError("routing record: an empty micro-batch has nothing to replay")
        layer_ids, topk = flat[0].layer_ids, flat[0].topk
        for r in flat:
            if r.layer_ids != layer_ids or r.topk != topk:
                raise ValueError("routing record: samples of one micro-batch record different layers or topk")
        pad = torch.arange(topk, dtype=torch.int32)
        out = {k: torch.empty(len(rows), seq_length, topk, dtype=torch.int32) for k in layer_ids}
        counted = torch.zeros(len(rows), seq_length, dtype=torch.bool)
        for i, row in enumerate(rows):
            used = sum(len(r) for r in row)
            if used > seq_length:
                raise ValueError(f"routing record: row {i} holds {used} routed positions, more than seq_length={seq_length}")
            counted[i, :used] = True
            for k in layer_ids:
                parts = [r.layers[k] for r in row] + [pad.expand(seq_length - used, topk)]
                out[k][i] = torch.cat(parts)
        move = (lambda v: v.to(device)) if device is not None else (lambda v: v)
        return RoutingReplay(RoutingMode.REPLAY, {k: [move(v)] for k, v in out.items()}, counted=move(counted))

    # ---- serialisation ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"start": self.start, "versions": _encode(self.versions),
                "layers": {str(k): _encode(v) for k, v in self.layers.items()}}

    @classmethod
    def from_state_dict(cls, state: Mapping) -> "RoutingRecord":
        return cls({int(k): _decode(v) for k, v in state["layers"].items()}, int(state["start"]),
                   _decode(state["versions"]))
