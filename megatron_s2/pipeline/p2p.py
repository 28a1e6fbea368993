"""Point-to-point transport of payloads between pipeline stages (CPU gloo and GPU NCCL).

Megatron-core's ``p2p_communication`` allocates receive buffers with ``device="cuda"``; this
transport allocates on the model's device and moves a :class:`PayloadSpec`'s fields. Sends
are non-blocking (``isend``; buffers are kept alive until :meth:`flush`), receives block, and
every message carries a tag derived from (micro-batch, virtual stage, direction, field), so
matching never depends on arrival order on gloo; NCCL matches in issue order, which the
schedules keep identical on both ends. Time spent blocked in receives is accumulated per
rank — the measured pipeline bubble.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_s2.pipeline.payload import PayloadSpec

__all__ = ["PipelineTransport"]

FORWARD, BACKWARD = 0, 1


class PipelineTransport:
    def __init__(self, pp_ranks: tuple[int, ...], vpp: int, device: torch.device):
        self.ranks, self.vpp, self.device = pp_ranks, vpp, device
        self.p = len(pp_ranks)
        self.pending: list = []
        self.wait_time = 0.0
        self.bytes_sent = 0

    def _tag(self, mb: int, chunk: int, direction: int, field: int, num_fields: int) -> int:
        return (((mb * self.vpp + chunk) * 2 + direction) * 64 + field) % (1 << 30)

    def send(self, tensors: list[torch.Tensor], dst_pp: int, mb: int, chunk: int, direction: int) -> None:
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            self.pending.append((dist.isend(t, self.ranks[dst_pp], tag=self._tag(mb, chunk, direction, i, len(tensors))), t))
            self.bytes_sent += t.numel() * t.element_size()

    def recv(self, spec: PayloadSpec, src_pp: int, mb: int, chunk: int, direction: int) -> list[torch.Tensor]:
        bufs = [torch.empty(f.shape, dtype=f.dtype, device=self.device) for f in spec.fields]
        if direction == BACKWARD:
            bufs = [b for b, f in zip(bufs, spec.fields) if f.requires_grad]
        t0 = time.perf_counter()
        works = [dist.irecv(b, self.ranks[src_pp], tag=self._tag(mb, chunk, direction, i, len(bufs)))
                 for i, b in enumerate(bufs)]
        for w in works:
            w.wait()
        self.wait_time += time.perf_counter() - t0
        return bufs

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
