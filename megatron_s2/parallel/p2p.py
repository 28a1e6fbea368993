"""Point-to-point transport of payloads between pipeline stages (CPU gloo and GPU NCCL).

Megatron-core's ``p2p_communication`` allocates receive buffers with ``device="cuda"``; this
transport allocates on the model's device and moves a :class:`PayloadSpec`'s fields. All
fields of one (micro-batch, virtual stage, direction) travel as **one message**: the sender
packs their bytes into one buffer (each field 16-byte aligned), the receiver unpacks views of
the received buffer with the spec's shapes and dtypes — one isend / irecv per payload instead
of one per field, so a payload with shared-state extensions costs no more messages than the
bare hidden state. Sends are non-blocking (completed ones are released as later calls see
them, the rest at :meth:`flush`), receives block, and every message carries a tag derived from
(micro-batch, virtual stage, direction), so matching never depends on arrival order on gloo;
NCCL matches in issue order, which the schedules keep identical on both ends. Time spent
blocked in receives is accumulated per rank — the measured pipeline bubble.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineTransport", "PayloadField", "FORWARD", "BACKWARD"]


@dataclass(frozen=True)
class PayloadField:
    """One tensor of a message between pipeline stages: the receiver allocates from this."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


class MessageSpec(Protocol):
    """What the transport needs of a payload description (e.g. a family's ``PayloadSpec``)."""

    fields: Sequence[PayloadField]

FORWARD, BACKWARD = 0, 1
ALIGN = 16  # bytes; every field starts at a multiple, so any dtype can view its slice


def _layout(fields) -> tuple[list[int], int]:
    """Byte offset of each field in the packed message, and the message size."""
    offsets, end = [], 0
    for f in fields:
        offsets.append(end)
        end += -(-f.nbytes // ALIGN) * ALIGN
    return offsets, end


class PipelineTransport:
    def __init__(self, pp_ranks: tuple[int, ...], vpp: int, device: torch.device):
        self.ranks, self.vpp, self.device = pp_ranks, vpp, device
        self.p = len(pp_ranks)
        self.pending: list = []
        self.wait_time = 0.0
        self.bytes_sent = 0  # payload bytes (the fields, without alignment padding)
        self.messages_sent = 0

    def _tag(self, mb: int, chunk: int, direction: int) -> int:
        return ((mb * self.vpp + chunk) * 2 + direction) % (1 << 30)

    def send(self, tensors: list[torch.Tensor], dst_pp: int, mb: int, chunk: int, direction: int) -> None:
        self.pending = [(w, buf) for w, buf in self.pending if not w.is_completed()]
        tensors = [t.detach().contiguous() for t in tensors]
        offsets, size = _layout([_Field(t) for t in tensors])
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            buf[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            self.bytes_sent += n
        self.pending.append((dist.isend(buf, self.ranks[dst_pp], tag=self._tag(mb, chunk, direction)), buf))
        self.messages_sent += 1

    def recv(self, spec: MessageSpec, src_pp: int, mb: int, chunk: int, direction: int) -> list[torch.Tensor]:
        fields = [f for f in spec.fields if direction == FORWARD or f.requires_grad]
        offsets, size = _layout(fields)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        dist.irecv(buf, self.ranks[src_pp], tag=self._tag(mb, chunk, direction)).wait()
        self.wait_time += time.perf_counter() - t0
        return [buf[off:off + f.nbytes].view(f.dtype).view(f.shape) for f, off in zip(fields, offsets)]

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class _Field:
    """Byte size of a tensor, as ``_layout`` reads it from payload fields."""

    def __init__(self, t: torch.Tensor):
        self.nbytes = t.numel() * t.element_size()
