"""Newton-Schulz orthogonalisation, the core of Muon (report §2.5, §4.2.2; Jordan et al., 2024).

For a matrix G = U S V^T, Muon replaces the momentum update by (approximately) its polar factor
U V^T, i.e. every singular value is set to one. The polar factor is computed without an SVD by
an odd matrix polynomial applied a few times to X_0 = G / ||G||_F (all singular values in
(0, 1]):

    A = X X^T,    X <- a X + (b A + c A^2) X        (quintic Newton-Schulz step)

which maps every singular value s to p(s) = a s + b s^3 + c s^5 and leaves the singular vectors
alone. Two coefficient sets are provided:

* :data:`MUON_QUINTIC_COEFFICIENTS` (3.4445, -4.7750, 2.0315), the Muon default: a large slope
  at zero pulls small singular values up fast, at the price of not converging to exactly one:
  after five steps every singular value with s / ||G||_F >= 0.01 lands in [0.68, 1.14]. That
  is what Muon needs, an update with G's singular vectors and a roughly flat spectrum.
* :data:`POLAR_QUINTIC_COEFFICIENTS` (15/8, -10/8, 3/8), the classical quintic polar iteration
  (p(1) = 1, p'(1) = p''(1) = 0): converges to U V^T itself, but slowly from small singular
  values. Used by the tests to check the iteration against an SVD to float32 precision.
* :data:`POLISH_QUINTIC_COEFFICIENTS` (2, -1.5, 0.5) (p(1) = 1, p'(1) = 0): optional
  ``polish_steps`` run after the main steps and pin the singular values at one (two polish
  steps take the Muon band [0.68, 1.14] to [0.9999, 1.0006]), so that the RMS matching of
  :func:`~megatron_s2.optim.muon.muon_update` becomes exact instead of ~0.8-0.9 x the target.

Inputs are batches ``(..., rows, cols)``; wide or tall matrices are both handled (the Gram
matrix is formed on the smaller side). The iteration runs in float32 by default; bfloat16
halves the cost on GPUs (``OptimizerConfig.ns_dtype``).
"""

from __future__ import annotations

import torch

__all__ = [
    "MUON_QUINTIC_COEFFICIENTS",
    "POLAR_QUINTIC_COEFFICIENTS",
    "POLISH_QUINTIC_COEFFICIENTS",
    "newton_schulz",
]

MUON_QUINTIC_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
POLAR_QUINTIC_COEFFICIENTS: tuple[float, float, float] = (15 / 8, -10 / 8, 3 / 8)
POLISH_QUINTIC_COEFFICIENTS: tuple[float, float, float] = (2.0, -1.5, 0.5)


def newton_schulz(
    matrices: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = MUON_QUINTIC_COEFFICIENTS,
    polish_steps: int = 0,
    compute_dtype: torch.dtype = torch.float32,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate polar factor of each matrix in ``matrices`` (shape ``(..., rows, cols)``).

    Returns a float32 tensor of the input's shape. A zero matrix maps to zero.
    """
    if matrices.ndim < 2:
        raise ValueError(f"newton_schulz needs (..., rows, cols) matrices, got shape {tuple(matrices.shape)}")
    if steps < 0 or polish_steps < 0:
        raise ValueError(f"steps and polish_steps must be non-negative, got {steps} and {polish_steps}")
    x = matrices.to(torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    # Frobenius normalisation bounds the spectral norm by one, inside the basin of p.
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    x = x.to(compute_dtype)
    for a, b, c in [coefficients] * steps + [POLISH_QUINTIC_COEFFICIENTS] * polish_steps:
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if transposed:
        x = x.mT
    return x.to(torch.float32)
