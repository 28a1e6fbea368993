"""Muon and head-wise Muon (report §2.5, §4.2.2): orthogonality, RMS matching, hand-computed step."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.optim import (
    MUON_QUINTIC_COEFFICIENTS,
    POLAR_QUINTIC_COEFFICIENTS,
    Muon,
    as_matrix_batch,
    muon_update,
    newton_schulz,
)


def _matrix_with_spectrum(rows: int, cols: int, singular_values: torch.Tensor, seed: int = 0):
    """G = U diag(s) V^T with random orthonormal U, V (float64); returns G, U, V."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return (u * singular_values.to(torch.float64)) @ v.T, u, v


def _rms(t: torch.Tensor) -> float:
    return t.double().square().mean().sqrt().item()


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_polar_iteration_matches_svd_polar_factor(shape):
    # Well-conditioned (cond 4): the convergent quintic reaches U V^T to float32 precision.
    g, u, v = _matrix_with_spectrum(*shape, torch.linspace(1.0, 0.25, min(shape)))
    x = newton_schulz(g.float(), steps=10, coefficients=POLAR_QUINTIC_COEFFICIENTS)
    assert x.dtype == torch.float32 and x.shape == g.shape
    torch.testing.assert_close(x.double(), u @ v.T, atol=2e-6, rtol=0)


def test_muon_coefficients_keep_singular_vectors_and_flatten_spectrum():
    # Muon's 5-step iteration: same singular vectors as the polar factor U V^T, singular
    # values in the iteration's band [0.68, 1.14] instead of exactly 1 (tolerance stated
    # in newton_schulz's docstring).
    g, u, v = _matrix_with_spectrum(24, 40, torch.logspace(0, -2, 24))
    x = newton_schulz(g.float(), steps=5, coefficients=MUON_QUINTIC_COEFFICIENTS).double()
    core = u.T @ x @ v  # diagonal iff x shares G's singular vectors
    diagonal = torch.diagonal(core)
    assert (core - torch.diag(diagonal)).abs().max() < 1e-5
    assert diagonal.min() > 0.68 and diagonal.max() < 1.14
    assert (x - u @ v.T).norm() / (u @ v.T).norm() < 0.3


def test_newton_schulz_zero_matrix_and_bad_input():
    assert torch.equal(newton_schulz(torch.zeros(3, 5)), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="matrices"):
        newton_schulz(torch.ones(4))


def test_update_rms_is_matched_to_0_18():
    g, _, _ = _matrix_with_spectrum(32, 96, torch.linspace(1.0, 0.3, 32), seed=1)
    # Exact polar factor: the Moonlight factor 0.18 * sqrt(max(rows, cols)) gives RMS 0.18.
    exact = muon_update(g.float(), torch.zeros(32, 96), ns_steps=12, ns_coefficients=POLAR_QUINTIC_COEFFICIENTS)
    assert _rms(exact) == pytest.approx(0.18, rel=1e-5)
    # Default 5-step Muon iteration: 0.18 * sqrt(mean s^2) with s in the band [0.68, 1.14].
    default = muon_update(g.float(), torch.zeros(32, 96))
    assert 0.18 * 0.68 < _rms(default) < 0.18 * 1.14
    # Two polish steps pin the singular values at one: RMS 0.18 to 0.1 %.
    polished = muon_update(g.float(), torch.zeros(32, 96), ns_polish_steps=2)
    assert _rms(polished) == pytest.approx(0.18, rel=1e-3)


def test_experts_are_independent_matrices():
    gen = torch.Generator().manual_seed(2)
    grads = torch.randn(3, 8, 12, generator=gen) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1)
    batched = muon_update(grads, torch.zeros(3, 8, 12))
    for e in range(3):
        torch.testing.assert_close(batched[e], muon_update(grads[e], torch.zeros(8, 12)), atol=1e-6, rtol=0)
        assert 0.18 * 0.68 < _rms(batched[e]) < 0.18 * 1.14  # each expert RMS-matched on its own


def test_headwise_equals_per_block_vanilla_and_differs_from_vanilla():
    heads, head_dim, cols = 4, 6, 20
    gen = torch.Generator().manual_seed(3)
    # Heterogeneous heads: very different scales and spectra per head.
    grad = torch.randn(heads * head_dim, cols, generator=gen)
    grad = grad * torch.tensor([0.01, 1.0, 5.0, 0.2]).repeat_interleave(head_dim).unsqueeze(1)
    headwise = muon_update(grad, torch.zeros_like(grad), head_split=heads)
    vanilla = muon_update(grad, torch.zeros_like(grad), head_split=1)
    assert (headwise - vanilla).abs().max() > 0.05
    for h in range(heads):
        block = slice(h * head_dim, (h + 1) * head_dim)
        expected = muon_update(grad[block], torch.zeros(head_dim, cols))
        torch.testing.assert_close(headwise[block], expected, atol=1e-6, rtol=0)
        assert 0.18 * 0.68 < _rms(headwise[block]) < 0.18 * 1.14  # every head RMS-matched on its own
    # Vanilla Muon drowns the small-scale head; head-wise gives it a full-size update.
    assert _rms(vanilla[:head_dim]) < 0.5 * _rms(headwise[:head_dim])


def test_as_matrix_batch_layouts():
    assert as_matrix_batch(torch.zeros(6, 4)).shape == (1, 6, 4)
    assert as_matrix_batch(torch.zeros(2, 6, 4), head_split=3).shape == (6, 2, 4)
    assert as_matrix_batch(torch.zeros(5, 3, 2, 2)).shape == (1, 5, 12)
    with pytest.raises(ValueError, match="head_split=4"):
        as_matrix_batch(torch.zeros(6, 4), head_split=4)


def _quintic_power(s: float, steps: int) -> float:
    a, b, c = MUON_QUINTIC_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def test_hand_computed_nesterov_and_decoupled_weight_decay_step():
    # Gradients I and J (90-degree rotation): any a*I + b*J is sqrt(a^2+b^2) times a rotation,
    # so both singular values are equal (1/sqrt(2) after Frobenius normalisation) and the NS
    # output is p^5(1/sqrt(2)) * (a*I + b*J) / sqrt(a^2 + b^2), which we compute by hand.
    mu, lr, wd = 0.95, 0.1, 0.1
    eye = torch.eye(2, dtype=torch.float64)
    rot = torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    param = torch.nn.Parameter(w0.clone())
    opt = Muon([param], lr=lr, momentum=mu, nesterov=True, weight_decay=wd, update_rms=0.18, ns_steps=5)
    magnitude = 0.18 * math.sqrt(2) * _quintic_power(1 / math.sqrt(2), 5)

    param.grad = eye.clone()
    opt.step()
    # buffer = I; Nesterov update = I + mu * I (direction I).
    w1 = w0 * (1 - lr * wd) - lr * magnitude * eye
    torch.testing.assert_close(param.detach(), w1, atol=1e-6, rtol=0)

    param.grad = rot.clone()
    opt.step()
    # buffer = mu * I + J; Nesterov update = J + mu * buffer = mu^2 * I + (1 + mu) * J.
    a, b = mu**2, 1 + mu
    direction = (a * eye + b * rot) / math.hypot(a, b)
    w2 = w1 * (1 - lr * wd) - lr * magnitude * direction
    torch.testing.assert_close(param.detach(), w2, atol=1e-6, rtol=0)
    torch.testing.assert_close(opt.state[param]["momentum_buffer"], mu * eye + rot)


def test_bfloat16_newton_schulz_is_close_to_float32():
    g, _, _ = _matrix_with_spectrum(16, 32, torch.linspace(1.0, 0.2, 16), seed=4)
    full = newton_schulz(g.float())
    half = newton_schulz(g.float(), compute_dtype=torch.bfloat16)
    assert half.dtype == torch.float32
    assert (half - full).norm() / full.norm() < 0.05
