"""ZeRO-1 moves gradients with a reduce-scatter to their owners and parameters with an all-gather.

Three gloo ranks (an odd group, so owners' chunks need padding) and a bucket size small enough
to force several buckets: after ``reduce_scatter_grads`` each owner holds the sum of every
rank's gradient of its parameters and the others hold none; after ``step`` every rank holds
the owners' updates. The only collectives are reduce-scatters and all-gathers (one of each
per bucket), each moving the owners' chunks padded to the bucket's largest (the padding is
large here, with buckets of a few parameters; bench/comm_volume.py measures it on the model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_s2.optim.distributed_optimizer import DistributedOptimizer, owner_buckets
from megatron_s2.parallel.groups import Group, ParallelGroups
from tests.parallel.spawn import run_distributed

WORLD = 3
SHAPES = [(40, 8), (64,), (7, 9), (33,), (5, 5, 5), (100,), (3,)]
LR = 0.5


class _SGD:
    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None


def _model() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    for i, shape in enumerate(SHAPES):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=gen)))
    return model


def _grad(i: int, rank: int) -> torch.Tensor:
    return torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(100 * rank + i))


def _worker(rank: int, world: int, out: str) -> None:
    group = Group(pg=dist.new_group(list(range(world))), size=world, rank=rank, ranks=tuple(range(world)))
    groups = ParallelGroups(dp_cp=group, stage=group)
    model = _model()
    opt = DistributedOptimizer(_SGD(model.parameters()), model, groups, bucket_mb=300 * 4 / 2 ** 20)
    for i, p in enumerate(model.parameters()):
        p.grad = _grad(i, rank)
    calls = []
    originals = {}
    for name in ("all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor",
                 "reduce_scatter_single", "all_gather_single"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(*args, _fn=fn, _name=name, **kwargs):
            kind = "_".join(_name.split("_")[:2])
            t = args[1] if kind == "reduce_scatter" else args[0]  # the full (padded) buffer of either
            calls.append((kind, t.numel() * t.element_size()))
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        opt.reduce_scatter_grads()
        grads = {i: (p.grad.clone() if p.grad is not None else None) for i, p in enumerate(model.parameters())}
        opt.step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    torch.save({"grads": grads, "params": [p.detach().clone() for p in model.parameters()], "calls": calls,
                "owned": [id(p) in opt.owned for p in model.parameters()], "buckets": len(opt.buckets),
                "width": sum(b.width for b in opt.buckets)}, Path(out) / f"rank{rank}.pt")


@pytest.mark.slow
def test_reduce_scatter_to_owners_and_all_gather(tmp_path):
    run_distributed(WORLD, _worker, str(tmp_path))
    recs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    start = list(_model().parameters())
    for i in range(len(SHAPES)):
        total = sum(_grad(i, r) for r in range(WORLD))
        owners = [r for r in range(WORLD) if recs[r]["owned"][i]]
        assert len(owners) == 1, f"p{i} has owners {owners}"
        for r, rec in enumerate(recs):
            if r == owners[0]:
                torch.testing.assert_close(rec["grads"][i], total, rtol=1e-6, atol=1e-6)
            else:
                assert rec["grads"][i] is None
            torch.testing.assert_close(rec["params"][i], start[i].detach() - LR * total, rtol=1e-6, atol=1e-6)
    rec = recs[0]
    assert rec["buckets"] > 1
    kinds = [k for k, _ in rec["calls"]]
    assert set(kinds) <= {"reduce_scatter", "all_gather"}, kinds
    assert kinds.count("reduce_scatter") == kinds.count("all_gather") == rec["buckets"]
    # Payload: the reduce-scatter input and the all-gather output are the padded model, once each.
    n = sum(torch.Size(s).numel() for s in SHAPES)
    for kind in ("reduce_scatter", "all_gather"):
        moved = sum(b for k, b in rec["calls"] if k == kind)
        assert n * 4 <= moved == WORLD * rec["width"] * 4


def test_buckets_hold_whole_parameters_of_every_owner():
    layout = owner_buckets([[10, 10, 10], [25], [1, 1]], bucket_elems=60)
    assert layout == [[[0, 1], [0], [0, 1]], [[2], [], []]]
    assert owner_buckets([[], []], 10) == []
