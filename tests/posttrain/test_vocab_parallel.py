"""Log-prob, entropy, KL and TV on vocabulary shards: float64 autograd of hand implementations,
the walkthrough's worked examples 12 and 26, and 2 gloo ranks (tp = 2) against one rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.vocab_parallel import (
    token_log_probs,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_overlap,
    vocab_parallel_total_variation,
)
from tests.parallel.spawn import run_distributed

SINGLE = Group.single()
B, S, V = 2, 3, 8


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, V, generator=g, dtype=dtype) * 2).requires_grad_()
    y = (torch.randn(B, S, V, generator=g, dtype=dtype) * 2).requires_grad_()
    tokens = torch.randint(0, V, (B, S), generator=g)
    upstream = torch.randn(B, S, generator=g, dtype=dtype)
    return x, y, tokens, upstream


# ---- hand implementations (plain torch ops, autograd) -----------------------------------------------
def hand_logprob(x, t, temperature=1.0):
    return torch.log_softmax(x / temperature, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def hand_entropy(x):
    logp = torch.log_softmax(x, -1)
    return -(logp.exp() * logp).sum(-1)


def hand_kl(x, y):
    logp, logq = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def hand_tv(x, y):
    return 0.5 * (torch.softmax(x, -1) - torch.softmax(y, -1)).abs().sum(-1)


CASES = {
    "logprob": (lambda x, y, t: token_log_probs(x, t, SINGLE), lambda x, y, t: hand_logprob(x, t)),
    "logprob_T": (lambda x, y, t: token_log_probs(x, t, SINGLE, temperature=0.7),
                  lambda x, y, t: hand_logprob(x, t, 0.7)),
    "entropy": (lambda x, y, t: vocab_parallel_entropy(x, SINGLE), lambda x, y, t: hand_entropy(x)),
    "kl": (lambda x, y, t: vocab_parallel_kl(x, y, SINGLE), lambda x, y, t: hand_kl(x, y)),
    "tv": (lambda x, y, t: vocab_parallel_total_variation(x, y, SINGLE), lambda x, y, t: hand_tv(x, y)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_autograd_of_hand_implementation(name):
    ours, hand = CASES[name]
    x, y, t, up = _inputs()
    out = ours(x, y, t)
    gx, gy = torch.autograd.grad((out * up).sum(), (x, y), allow_unused=True)
    x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ref = hand(x2, y2, t)
    rx, ry = torch.autograd.grad((ref * up).sum(), (x2, y2), allow_unused=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, rx, rtol=1e-10, atol=1e-12)
    if ry is not None:
        torch.testing.assert_close(gy, ry, rtol=1e-10, atol=1e-12)
    else:
        assert gy is None or gy.abs().max() == 0


def test_gradcheck_kl_and_tv():
    x, y, _, _ = _inputs(seed=3)
    assert torch.autograd.gradcheck(lambda a, b: vocab_parallel_kl(a, b, SINGLE), (x, y))
    assert torch.autograd.gradcheck(lambda a, b: vocab_parallel_total_variation(a, b, SINGLE), (x, y))
    assert torch.autograd.gradcheck(lambda a: vocab_parallel_entropy(a, SINGLE), (x,))


def _logits(p):
    return torch.log(torch.tensor(p, dtype=torch.float64)).view(1, 1, -1)


def test_overlap_is_one_minus_tv_worked_example_12():
    p, q = _logits([0.60, 0.30, 0.10]), _logits([0.50, 0.20, 0.30])
    assert vocab_parallel_total_variation(p, q, SINGLE).item() == pytest.approx(0.20)
    assert vocab_parallel_overlap(p, q, SINGLE).item() == pytest.approx(0.80)  # = sum min(p, q)
    k = 4  # expected tokens per verification round (1 - a^(K+1)) / (1 - a)
    assert (1 - 0.8 ** (k + 1)) / (1 - 0.8) == pytest.approx(3.3616)


def test_forward_and_reverse_kl_worked_example_26():
    teacher = _logits([0.45, 0.45, 0.10])
    cover, mode, pruned = _logits([0.34, 0.33, 0.33]), _logits([0.90, 0.08, 0.02]), _logits([0.49, 0.49, 0.02])
    fwd = lambda s: vocab_parallel_kl(teacher, s, SINGLE).item()  # noqa: E731  D(p_T || S)
    rev = lambda s: vocab_parallel_kl(s, teacher, SINGLE).item()  # noqa: E731  D(S || p_T)
    assert fwd(cover) == pytest.approx(0.14631, abs=5e-6) and fwd(mode) == pytest.approx(0.626, abs=5e-4)
    assert rev(cover) == pytest.approx(0.19634, abs=5e-6) and rev(mode) == pytest.approx(0.453, abs=5e-4)
    assert fwd(mode) / fwd(cover) == pytest.approx(4.3, abs=0.05)
    assert rev(pruned) == pytest.approx(0.05127, abs=5e-6) and fwd(pruned) == pytest.approx(0.08430, abs=5e-6)
    assert 1 - rev(pruned) / rev(cover) == pytest.approx(0.74, abs=0.005)  # reverse KL: 74% reduction
    assert 1 - fwd(pruned) / fwd(cover) == pytest.approx(0.42, abs=0.005)  # forward KL: 42%
    assert 0.33 * math.log(0.33 / 0.10) == pytest.approx(0.394, abs=5e-4)
    # the third component pushed to zero: reverse KL stays bounded (0 ln 0 = 0), forward KL diverges
    for eps in (1e-4, 1e-8, 1e-12):
        dropped = _logits([0.5 - eps / 2, 0.5 - eps / 2, eps])
        assert rev(dropped) == pytest.approx(math.log(0.5 / 0.45), abs=1e-3)
        assert fwd(dropped) == pytest.approx(0.90 * math.log(0.90) + 0.10 * math.log(0.10 / eps), abs=1e-3)


# ---- tp = 2 on gloo against one rank -----------------------------------------------------------------
def _tp2_worker(rank: int, world: int) -> None:
    for dtype in (torch.float64, torch.float32):
        _tp2_check(rank, world, dtype)


def _tp2_check(rank: int, world: int, dtype: torch.dtype) -> None:
    tp = Group(pg=dist.group.WORLD, size=world, rank=rank, ranks=tuple(range(world)))
    x, y, t, up = _inputs(dtype, seed=7)
    part = V // world
    sl = slice(rank * part, (rank + 1) * part)
    fns = {
        "logprob": (lambda a, b: token_log_probs(a, t, tp, temperature=0.9),
                    lambda a, b: token_log_probs(a, t, SINGLE, temperature=0.9)),
        "entropy": (lambda a, b: vocab_parallel_entropy(a, tp), lambda a, b: vocab_parallel_entropy(a, SINGLE)),
        "kl": (lambda a, b: vocab_parallel_kl(a, b, tp), lambda a, b: vocab_parallel_kl(a, b, SINGLE)),
        "tv": (lambda a, b: vocab_parallel_total_variation(a, b, tp),
               lambda a, b: vocab_parallel_total_variation(a, b, SINGLE)),
    }
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    for name, (sharded, single) in fns.items():
        xs = x.detach()[..., sl].clone().requires_grad_()
        ys = y.detach()[..., sl].clone().requires_grad_()
        out = sharded(xs, ys)
        gx, gy = torch.autograd.grad((out * up).sum(), (xs, ys), allow_unused=True)
        xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        ref = single(xr, yr)
        rx, ry = torch.autograd.grad((ref * up).sum(), (xr, yr), allow_unused=True)
        torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"{name} value: {m}")
        torch.testing.assert_close(gx, rx[..., sl], **tol, msg=lambda m: f"{name} grad p: {m}")
        if ry is not None:
            torch.testing.assert_close(gy, ry[..., sl], **tol, msg=lambda m: f"{name} grad q: {m}")


@pytest.mark.slow
def test_tp2_shards_match_single_rank():
    """float64 to 1e-12 and float32 to 2e-6: values and gradients of every shard."""
    run_distributed(2, _tp2_worker)
