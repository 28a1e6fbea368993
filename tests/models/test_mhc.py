"""Single-Pass mHC (report §2.4.1, Eq. 2-6): Sinkhorn projection, coefficient ranges,
gradients, a hand-computed case, the training initialisation and the single-pass wiring."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.mhc import (
    HyperConnection,
    _sinkhorn,
    collapse,
    expand,
    expand_embedding,
    one_hot_pre,
    sinkhorn_knopp,
    split_coefficients,
)
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.placement import placement_of


def tiny_config(**overrides) -> V41Config:
    base = dict(vocab_size=128, hidden_size=16, num_encoder_layers=2, layer_groups=(LayerGroupSpec(modes=("swa", "swa")),),
                num_attention_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                window_size=8, index_num_heads=2, index_head_dim=32, index_topk=6, candidate_topk_blocks=0,
                num_routed_experts=4, moe_topk=2, moe_ffn_hidden_size=32, hc_mult=4, engram_layers=(),
                fp8_swa_kv=False, fp4_indexer=False, init_std=0.02)
    base.update(overrides)
    return V41Config(**base)


def make_hc(config: V41Config, seed: int = 0, groups: ParallelGroups | None = None) -> HyperConnection:
    hc = HyperConnection(config, groups)
    initialize_parameters(hc, seed, config.init_std)
    return hc


# ---- Sinkhorn-Knopp ---------------------------------------------------------------------
def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(0))
    m = sinkhorn_knopp(logits, iters=20, eps=1e-6)
    assert (m > 0).all()
    # The last step normalises columns: column sums are 1 up to eps.
    torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)
    # Row sums converge with the iterations: 20 iterations on logits of std 1 reach 5e-4
    # (measured 9e-5; 2 iterations leave 0.17).
    assert (m.sum(-1) - 1).abs().max() < 5e-4
    few = sinkhorn_knopp(logits, iters=2, eps=1e-6)
    assert (m.sum(-1) - 1).abs().max() < (few.sum(-1) - 1).abs().max()


def test_sinkhorn_recompute_backward_matches_autograd():
    logits = torch.randn(8, 4, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(8, 4, 4, dtype=torch.float64)
    (g_fn,) = torch.autograd.grad(sinkhorn_knopp(logits, 7, 1e-6), logits, grad)
    (g_ref,) = torch.autograd.grad(_sinkhorn(logits, 7, 1e-6), logits, grad)
    torch.testing.assert_close(g_fn, g_ref, rtol=1e-12, atol=1e-12)
    small = logits[:2, :3, :3].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_knopp(t, 5, 1e-6), (small,))


def test_sinkhorn_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iters"):
        sinkhorn_knopp(torch.zeros(4, 4), 0, 1e-6)


# ---- coefficients -------------------------------------------------------------------------
def test_pre_post_ranges_with_large_weights():
    cfg = tiny_config()
    hc = make_hc(cfg)
    with torch.no_grad():
        hc.fn.normal_(0, 1.0)
        hc.scale.fill_(5.0)
    x = torch.randn(3, 5, 4, 16) * 10
    pre, post, comb = hc.coefficients(x)
    assert pre.shape == (3, 5, 4) and post.shape == (3, 5, 4) and comb.shape == (3, 5, 4, 4)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert (pre >= cfg.hc_eps).all() and (pre <= 1 + cfg.hc_eps).all()
    assert (post >= 0).all() and (post <= 2).all()
    assert (comb >= 0).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, 5, 4), atol=1e-5, rtol=0)


def test_coefficients_are_float32_for_bfloat16_streams():
    hc = make_hc(tiny_config())
    x = torch.randn(2, 3, 4, 16).bfloat16()
    pre, post, comb = hc.coefficients(x)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    f = torch.randn(2, 3, 16).bfloat16()
    assert collapse(x, pre).dtype == torch.bfloat16
    assert expand(f, x, post, comb).dtype == torch.bfloat16


def test_gradcheck_coefficients_collapse_expand():
    cfg = tiny_config(hidden_size=3, hc_mult=2, hc_sinkhorn_iters=4, norm_eps=1e-6)
    hc = make_hc(cfg).double()
    with torch.no_grad():
        hc.fn.normal_(0, 0.5)
        hc.scale.copy_(torch.tensor([0.7, 1.3, 0.9]))
    x = torch.randn(1, 2, 2, 3, dtype=torch.float64, requires_grad=True)
    fn, base, scale = (p.detach().clone().requires_grad_(True) for p in (hc.fn, hc.base, hc.scale))

    def coeffs(x, fn, base, scale):
        xf = x.flatten(-2)
        mixes = (xf @ fn.t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.norm_eps)
        return split_coefficients(mixes, scale, base, 2, cfg.hc_sinkhorn_iters, cfg.hc_eps)

    # The functional form is the module's forward.
    for a, b in zip(coeffs(x, fn, base, scale), hc.coefficients(x)):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(coeffs, (x, fn, base, scale))
    pre, post, comb = (t.detach().requires_grad_(True) for t in hc.coefficients(x))
    f = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(collapse, (x, pre))
    assert torch.autograd.gradcheck(expand, (f, x, post, comb))


def test_hand_computed_case():
    """n = 2, d = 2, X = [[2, 2], [2, -2]]: mean square 4, so r = 1/2 and a row of ``fn`` equal
    to (m, 0, 0, 0) yields the mix m. pre = sigmoid(ln 1/3, 0) = (1/4, 1/2); post = 2 sigmoid(ln 3, 0)
    = (3/2, 1); comb = softmax([[ln 3, 0], [0, ln 3]]) = [[3/4, 1/4], [1/4, 3/4]] (already doubly
    stochastic). collapse = X0/4 + X1/2 = (3/2, -1/2). With F = (1, 0):
    X'_0 = 3/2 F + 3/4 X0 + 1/4 X1 = (7/2, 1), X'_1 = F + 1/4 X0 + 3/4 X1 = (3, -1)."""
    cfg = tiny_config(hidden_size=2, hc_mult=2, norm_eps=1e-30)
    hc = HyperConnection(cfg)
    ln3 = math.log(3.0)
    mix = [math.log(1 / 3), 0.0, 0.0, 0.0, ln3 / 2, 0.0, 0.0, ln3 / 2]  # pre | post | comb (scale 2)
    with torch.no_grad():
        hc.fn.zero_()
        hc.fn[:, 0] = torch.tensor(mix)
        hc.base.zero_()
        hc.base[2] = ln3  # post logit of stream 0 comes from base
        hc.scale.copy_(torch.tensor([1.0, 1.0, 2.0]))
    x = torch.tensor([[2.0, 2.0], [2.0, -2.0]]).view(1, 1, 2, 2)
    pre, post, comb = hc.coefficients(x)
    eps = 1e-5
    torch.testing.assert_close(pre.view(2), torch.tensor([0.25, 0.5]), atol=eps, rtol=0)
    torch.testing.assert_close(post.view(2), torch.tensor([1.5, 1.0]), atol=eps, rtol=0)
    torch.testing.assert_close(comb.view(2, 2), torch.tensor([[0.75, 0.25], [0.25, 0.75]]), atol=eps, rtol=0)
    torch.testing.assert_close(collapse(x, pre).view(2), torch.tensor([1.5, -0.5]), atol=eps, rtol=0)
    f = torch.tensor([1.0, 0.0]).view(1, 1, 2)
    torch.testing.assert_close(expand(f, x, post, comb).view(2, 2), torch.tensor([[3.5, 1.0], [3.0, -1.0]]),
                               atol=eps, rtol=0)


# ---- initialisation and single-pass wiring ------------------------------------------------
def test_initialisation_matches_documented_values():
    cfg = tiny_config()
    hc = make_hc(cfg)
    n = cfg.hc_mult
    assert hc.fn.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    torch.testing.assert_close(hc.scale.detach(), torch.full((3,), 0.01))
    x = torch.randn(2, 3, n, 16)
    pre, post, comb = hc.coefficients(x)
    torch.testing.assert_close(pre, torch.full_like(pre, 1 / n), atol=0.01, rtol=0)
    torch.testing.assert_close(post, torch.ones_like(post), atol=0.02, rtol=0)
    expected = torch.full((n, n), 0.1 / (n - 1)).fill_diagonal_(0.9)
    torch.testing.assert_close(comb, expected.expand_as(comb), atol=0.01, rtol=0)


def test_single_pass_starts_as_a_residual_stack_and_shifts_pre():
    cfg = tiny_config()
    hcs = [make_hc(cfg, seed=s) for s in range(3)]
    emb = torch.randn(2, 5, 16)
    sublayers = [torch.nn.Linear(16, 16) for _ in hcs]
    seen = []

    def run(layer):
        def f(y):
            seen.append(y)
            return layer(y)
        return f

    x = expand_embedding(emb, cfg.hc_mult)
    pre = one_hot_pre(x)
    states = [x]
    for hc, layer in zip(hcs, sublayers):
        x, pre = hc(x, run(layer), pre)  # Single-Pass: collapse with the previous sublayer's A
        states.append(x)
    # Eq. 6: sublayer 0 collapses with the one-hot pre, sublayer l with the pre of sublayer l-1.
    torch.testing.assert_close(seen[0], collapse(states[0], one_hot_pre(states[0])))
    torch.testing.assert_close(seen[0], emb)
    for i in (1, 2):
        torch.testing.assert_close(seen[i], collapse(states[i], hcs[i - 1].coefficients(states[i - 1])[0]))
    torch.testing.assert_close(collapse(x, pre), collapse(x, hcs[-1].coefficients(states[-2])[0]))
    # At initialisation the network is (close to) a pre-norm residual stack.
    ref = emb
    for layer in sublayers:
        ref = ref + layer(ref)
    torch.testing.assert_close(collapse(x, pre), ref, atol=0.05, rtol=0.02)


def test_classic_mhc_uses_its_own_pre():
    cfg = tiny_config()
    hc = make_hc(cfg)
    x = torch.randn(2, 3, 4, 16)
    seen = []
    out, _ = hc(x, lambda y: seen.append(y) or y, pre_in=None)
    pre_ref, post, comb = hc.coefficients(x)
    torch.testing.assert_close(seen[0], collapse(x, pre_ref))
    torch.testing.assert_close(out, expand(seen[0], x, post, comb))


def test_sequence_parallel_flags():
    cfg = tiny_config()
    sp = ParallelGroups(tp=Group(size=2, rank=0, ranks=(0, 1)), sequence_parallel=True)
    assert all(placement_of(p).tp_partial for p in HyperConnection(cfg, sp).parameters())
    assert not any(placement_of(p).tp_partial for p in HyperConnection(cfg).parameters())
