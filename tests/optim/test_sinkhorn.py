"""Sinkhorn-balanced momentum update (report §2.5, Eq. 7; §4.2.2 K = 11, tau = 1e-3, eps = 1e-20)."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_s2.config.optimizer import OptimizerConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.optim import SinkhornMomentum, build_optimizer, sinkhorn_balance, sinkhorn_update
from megatron_s2.parallel.sharding import mark_param


def _skewed_table(rows: int = 96, cols: int = 24, seed: int = 0) -> torch.Tensor:
    """Gradient-like table with row scales over 3 decades and column scales over 2."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-1.5, 1.5, rows)[torch.randperm(rows, generator=gen)]
    col_scale = torch.logspace(-1, 1, cols)
    return torch.randn(rows, cols, generator=gen) * row_scale[:, None] * col_scale[None, :]


def _row_rms(delta: torch.Tensor) -> torch.Tensor:
    return delta.square().mean(-1).sqrt()


def _col_rms(delta: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return delta[active].square().mean(0).sqrt()


def _reference_balance(g: torch.Tensor, iters: int, tau: float, eps: float) -> torch.Tensor:
    """Eq. 7 written out element by element in float64, as the algorithm text describes it."""
    g = g.double()
    m, n = g.shape
    rho = [math.sqrt(sum(g[i, j].item() ** 2 for j in range(n))) for i in range(m)]
    active = [r > tau * sum(rho) / m for r in rho]
    m_active = sum(active)
    u = [[g[i, j].item() if active[i] else 0.0 for j in range(n)] for i in range(m)]
    for k in range(1, iters + 1):
        if k % 2 == 1:
            for i in range(m):
                norm = math.sqrt(sum(x * x for x in u[i]))
                u[i] = [x / (norm + eps) for x in u[i]]
        else:
            for j in range(n):
                norm = math.sqrt(sum(u[i][j] ** 2 for i in range(m)))
                for i in range(m):
                    u[i][j] *= math.sqrt(m_active / n) / (norm + eps)
    return math.sqrt(n) * torch.tensor(u, dtype=torch.float64)


def test_matches_elementwise_reference_on_small_tables():
    gen = torch.Generator().manual_seed(1)
    for shape, iters in [((3, 2), 11), ((5, 3), 4), ((4, 4), 1)]:
        g = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(sinkhorn_balance(g, iters).double(), _reference_balance(g, iters, 1e-3, 1e-20),
                                   atol=1e-5, rtol=1e-5)


def test_rows_exactly_and_columns_approximately_unit_rms():
    g = _skewed_table()
    active = torch.ones(g.shape[0], dtype=torch.bool)
    delta = sinkhorn_balance(g, iters=11)
    assert delta.dtype == torch.float32
    # K = 11 ends with a row step: row RMS is 1 to float precision.
    torch.testing.assert_close(_row_rms(delta), torch.ones(g.shape[0]), atol=1e-5, rtol=0)
    # Columns start spread over two decades; after K = 11 (5 column steps) they are within
    # 0.1 % of unit RMS, while K = 3 is visibly short of it (alternating scaling converges).
    before = _col_rms(g / _row_rms(g)[:, None], active)
    assert before.max() / before.min() > 10
    assert (_col_rms(delta, active) - 1).abs().max() < 1e-3
    assert (_col_rms(sinkhorn_balance(g, iters=3), active) - 1).abs().max() > 0.05
    assert (_col_rms(sinkhorn_balance(g, iters=41), active) - 1).abs().max() < 1e-5


def test_near_zero_rows_are_masked_and_excluded_from_column_statistics():
    g = _skewed_table(rows=40, cols=16, seed=2)
    mean_norm = g.norm(dim=1).mean()
    g[3] = 0.0                                                  # token never seen
    g[7] = g[7] / g[7].norm() * mean_norm * 5e-4                 # rho < tau * mean: masked
    g[9] = g[9] / g[9].norm() * mean_norm * 5e-3                 # rho > tau * mean: kept
    delta = sinkhorn_balance(g, iters=11, tau=1e-3)
    assert torch.equal(delta[3], torch.zeros(16)) and torch.equal(delta[7], torch.zeros(16))
    active = torch.ones(40, dtype=torch.bool)
    active[[3, 7]] = False
    torch.testing.assert_close(_row_rms(delta[active]), torch.ones(38), atol=1e-5, rtol=0)
    assert (_col_rms(delta, active) - 1).abs().max() < 1e-3  # RMS over the 38 unmasked rows
    assert _row_rms(delta[9:10]).item() == pytest.approx(1.0, abs=1e-5)


def test_scale_invariant_down_to_tiny_gradients():
    g = _skewed_table(rows=32, cols=8, seed=3)
    torch.testing.assert_close(sinkhorn_balance(g * 1e-18), sinkhorn_balance(g), atol=1e-5, rtol=1e-5)
    assert torch.equal(sinkhorn_balance(torch.zeros(4, 3)), torch.zeros(4, 3))


def test_batched_tables_are_independent():
    a, b = _skewed_table(16, 8, seed=4), 100 * _skewed_table(16, 8, seed=5)
    both = sinkhorn_balance(torch.stack([a, b]))
    torch.testing.assert_close(both[0], sinkhorn_balance(a))
    torch.testing.assert_close(both[1], sinkhorn_balance(b))


def test_optimizer_step_uses_gamma_lr_nesterov_and_no_weight_decay():
    mu, lr, gamma = 0.95, 0.01, 0.18
    w0 = torch.randn(12, 6, generator=torch.Generator().manual_seed(6))
    param = torch.nn.Parameter(w0.clone())
    opt = SinkhornMomentum([param], lr=lr, momentum=mu, lr_scale=gamma)
    g1, g2 = _skewed_table(12, 6, seed=7), _skewed_table(12, 6, seed=8)
    g1[2] = 0.0
    g2[2] = 0.0
    param.grad = g1.clone()
    opt.step()
    expected = w0 - gamma * lr * sinkhorn_balance(g1 + mu * g1)
    torch.testing.assert_close(param.detach(), expected, atol=1e-6, rtol=0)
    param.grad = g2.clone()
    opt.step()
    expected = expected - gamma * lr * sinkhorn_balance(g2 + mu * (mu * g1 + g2))
    torch.testing.assert_close(param.detach(), expected, atol=1e-6, rtol=0)
    # The masked row is bit-identical: no update and no weight decay.
    assert torch.equal(param.detach()[2], w0[2])


def test_sinkhorn_update_advances_buffer():
    buffer = torch.ones(4, 3)
    grad = _skewed_table(4, 3, seed=9)
    delta = sinkhorn_update(grad, buffer, momentum=0.5, nesterov=False)
    torch.testing.assert_close(buffer, 0.5 + grad)
    torch.testing.assert_close(delta, sinkhorn_balance(0.5 + grad))


def _table_model(weight: torch.Tensor, splits=()) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embedding = torch.nn.Module()
    model.embedding.word_embeddings = torch.nn.Embedding(*weight.shape)
    param = model.embedding.word_embeddings.weight
    with torch.no_grad():
        param.copy_(weight)
    if splits:
        mark_param(param, (weight.shape[0] * splits[0][2], weight.shape[1]), splits)
    return model


def _train_table(model: torch.nn.Module, grads: list[torch.Tensor], **build_kwargs) -> torch.Tensor:
    opt = build_optimizer(model, OptimizerConfig(), **build_kwargs)
    param = model.embedding.word_embeddings.weight
    for grad in grads:
        param.grad = grad.clone()
        opt.set_lr(0.1)
        opt.step()
    return param.detach()


def _row_sharded_worker(rank: int, world: int, tmp: str, table: torch.Tensor, grads: list[torch.Tensor]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        rows = slice(rank * table.shape[0] // world, (rank + 1) * table.shape[0] // world)
        delta = sinkhorn_balance(grads[0][rows], iters=11, process_group=dist.group.WORLD)
        model = _table_model(table[rows], splits=((0, rank, world),))
        name = "embedding.word_embeddings.weight"
        with pytest.raises(ConfigError, match="row_groups"):
            build_optimizer(model, OptimizerConfig())
        trained = _train_table(model, [g[rows] for g in grads], row_groups={name: dist.group.WORLD})
        torch.save((delta, trained), os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()  # neither rank tears gloo down while the other still has an operation in flight
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_row_sharded_table_matches_single_rank():
    # Vocabulary- / Engram-parallel tables hold a row shard per rank (§3.1.3): the balanced
    # update and two optimiser steps on the shards equal the single-rank ones.
    table = _skewed_table(rows=24, cols=8, seed=10)
    grads = [_skewed_table(rows=24, cols=8, seed=s) for s in (11, 12)]
    grads[0][5] = 0.0  # a masked row on rank 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_row_sharded_worker, args=(2, tmp, table, grads), nprocs=2)
        shards = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    torch.testing.assert_close(torch.cat([d for d, _ in shards]), sinkhorn_balance(grads[0]), atol=1e-6, rtol=1e-6)
    single = _train_table(_table_model(table), grads)
    torch.testing.assert_close(torch.cat([t for _, t in shards]), single, atol=1e-6, rtol=1e-6)
