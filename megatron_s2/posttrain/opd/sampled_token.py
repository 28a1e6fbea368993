"""Sampled-token on-policy distillation (walkthrough Ch. 8, Eq. 31-36).

The student generates (on-policy: it is corrected on the states it visits) and the teacher of
the query's domain scores only the **sampled** tokens — an O(H) payload instead of O(H V)
(worked example 24). The idealised objective (**Eq. 31**) minimises the reverse KL
D(pi_theta || pi_T) on student-induced states, weighted per domain by lambda_d. In practice it
is written in the same clipped, importance-weighted REINFORCE form as RL; only the advantage
changes, **Eq. 33**::

    A_OPD(i, t) = sg[ log pi_T(y_{i,t} | ...) - log pi_prox(y_{i,t} | ...) ] = ln(p_T / p_prox)

with pi_prox the *frozen proximal student* (a snapshot at the start of the rollout batch, so
every mini-batch optimises the same target — the instinct of the detached weight). The ratio
and truncation are Eq. 10-11 again (**Eq. 34-35**, same interval as reasoning RL) and the
objective is **Eq. 36** = Eq. 29 with lambda_d on the sample's tokens:
:class:`~megatron_s2.posttrain.losses.PosttrainObjective` with the ``policy_gradient`` term,
advantages from :func:`opd_advantages`, and sample weights from :func:`domain_token_weights`.

In expectation over y ~ pi_theta with pi_prox = pi_theta, the gradient of Eq. 36's summand is
exactly -grad D(pi_theta || pi_T) at that state (tested), and the advantage is
self-annihilating: it vanishes where the student matches the teacher. Worked example 25: a
token the teacher rates 10x higher gets ln 10 = 2.303, one rated 1.1x higher 0.095.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["opd_advantages", "domain_token_weights"]


def opd_advantages(teacher_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 33 per token, detached; zero outside ``loss_mask`` (prompt, tool, padding tokens)."""
    if teacher_logprobs.shape != proximal_logprobs.shape:
        raise ValueError(f"OPD advantage: teacher log-probs {tuple(teacher_logprobs.shape)} vs proximal "
                         f"{tuple(proximal_logprobs.shape)}")
    adv = (teacher_logprobs.detach() - proximal_logprobs.detach().to(teacher_logprobs.dtype))
    if loss_mask is not None:
        adv = torch.where(loss_mask.bool(), adv, torch.zeros_like(adv))
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("OPD advantage is not finite: a teacher or proximal log-probability is -inf on a "
                         "loss token (check the teacher's tokenizer and temperature)")
    return adv


def domain_token_weights(domains: Sequence[str], weights: dict[str, float], shape: tuple[int, int],
                         dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
    """[b, s] tensor holding lambda_d of each row's domain (Eq. 36); domains missing from
    ``weights`` weigh 1.0."""
    b, s = shape
    if len(domains) != b:
        raise ValueError(f"{len(domains)} domains for a micro-batch of {b} rows")
    lam = torch.tensor([float(weights.get(d, 1.0)) for d in domains], dtype=dtype, device=device)
    return lam.view(b, 1).expand(b, s)
