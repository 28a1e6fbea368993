"""Engram rows prefetched once per step equal the per-micro-batch lookups (report §3.1.3).

Two gloo ranks = data parallel 2 = engram parallel 2; two Engram layers; four micro-batches
per rank. Each rank runs the micro-batches twice on the same modules: with a lookup per
micro-batch and layer (``EngramTable.forward``), and with :class:`EngramPrefetch` (one
exchange before the first micro-batch, row gradients returned after the last backward).
Outputs and input gradients must be identical, table gradients equal up to summation order
(1e-6 of their largest value); the prefetch path issues 4 all-to-alls in all, the
per-micro-batch path 4 per micro-batch and layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.engram import Engram, EngramPrefetch
from megatron_s2.parallel.groups import Group, ParallelGroups
from tests.parallel.spawn import run_distributed
from tests.parallel.test_engram_parallel import SEED, TOKEN_MAP, config, union_data

WORLD, MICRO = 2, 4
LAYERS = (1, 3)


def _micro_batches(rank: int) -> list[dict]:
    cfg = config()
    out = []
    for k in range(MICRO):
        data = union_data(cfg)  # B x S per call; vary the rows by micro-batch and rank
        rows = slice((k + rank) % 2 * 2, (k + rank) % 2 * 2 + 2)
        g = torch.Generator().manual_seed(1000 * rank + k)
        out.append({"tokens": torch.randint(0, cfg.vocab_size, (2, data["ids"].size(1)), generator=g),
                    "doc_ids": data["doc"][rows], "x": data["x"][rows], "probe": data["probe"][rows]})
    return out


def _run(modules, mbs, prefetch: EngramPrefetch | None) -> dict:
    cfg = config()
    for m in modules:
        m.zero_grad(set_to_none=True)
    outs, x_grads = [], []
    for mb in mbs:
        ctx = ForwardContext.create(mb["tokens"], cfg.plan, doc_ids=mb["doc_ids"])
        ctx.engram_rows = prefetch
        x = mb["x"].clone().requires_grad_(True)
        y = x
        for m in modules:
            y = m(y, ctx)
        (y * mb["probe"]).sum().backward()
        outs.append(y.detach())
        x_grads.append(x.grad)
    if prefetch is not None:
        prefetch.return_grads()
    return {"out": outs, "x_grad": x_grads,
            "table_grads": [m.table.weight.grad.clone() for m in modules],
            "other_grads": [m.linear_kv.weight.grad.clone() for m in modules]}


def _worker(rank: int, world: int, out: str) -> None:
    cfg = config()
    group = Group(pg=dist.new_group([0, 1]), size=world, rank=rank, ranks=(0, 1))
    groups = ParallelGroups(engram=group, dp_cp=group)
    modules = [Engram(cfg, layer, groups, compressed_token_map=TOKEN_MAP) for layer in LAYERS]
    for m, layer in zip(modules, LAYERS):
        initialize_parameters(m, SEED + layer, cfg.init_std)
    mbs = _micro_batches(rank)
    calls = []
    original = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        per_micro = _run(modules, mbs, None)
        per_micro_calls = len(calls)
        calls.clear()
        prefetch = EngramPrefetch.for_step(torch.nn.ModuleList(modules), mbs, lambda mb: ForwardContext.create(
            mb["tokens"], cfg.plan, doc_ids=mb["doc_ids"]))
        prefetched = _run(modules, mbs, prefetch)
        prefetch_calls = len(calls)
    finally:
        dist.all_to_all_single = original
    torch.save({"per_micro": per_micro, "prefetched": prefetched, "calls": (per_micro_calls, prefetch_calls)},
               Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
def test_prefetch_equals_per_micro_batch_lookups(tmp_path):
    run_distributed(WORLD, _worker, str(tmp_path))
    for rank in range(WORLD):
        rec = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        a, b = rec["per_micro"], rec["prefetched"]
        for name in ("out", "x_grad"):
            for u, v in zip(a[name], b[name]):
                assert torch.equal(u, v), f"rank {rank}: {name} differs"
        for name in ("table_grads", "other_grads"):
            for u, v in zip(a[name], b[name]):
                assert u.abs().max() > 0
                assert (u - v).abs().max() <= 1e-6 * u.abs().max(), f"rank {rank}: {name}"
        assert rec["calls"] == (4 * MICRO * len(LAYERS), 4), rec["calls"]
