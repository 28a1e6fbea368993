"""The memory decoder's training loss (Intern-S2 walkthrough Ch. 2, Eq. 2).

The memory is trained to predict what retrieval would have said, anchored to the gold token:

    L_mem = beta * KL(p_kNN || p_mem) + (1 - beta) * CE(y_gold, p_mem),    beta in [0, 1]

"Pure KL: the memory learns to imitate a retriever, including the retriever's mistakes ... Pure
cross-entropy: you are back to ordinary fine-tuning on hard labels and you have thrown away the
ranking structure." KL uses 0 log 0 = 0: tokens no neighbour voted for contribute nothing.
"""

from __future__ import annotations

import torch

__all__ = ["memory_decoder_token_loss", "memory_decoder_loss"]


def memory_decoder_token_loss(mem_logits: torch.Tensor, knn_log_probs: torch.Tensor, labels: torch.Tensor, *,
                              beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Eq. 2 per position, its KL term, its cross-entropy term), each [...].

    ``mem_logits`` [..., V] (the memory decoder's, full vocabulary), ``knn_log_probs`` [..., V]
    (Eq. 1, -inf where no neighbour voted), ``labels`` [...]."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"memory decoder beta must be in [0, 1], got {beta}")
    log_q = torch.log_softmax(mem_logits.float(), dim=-1)
    log_p = knn_log_probs.float()
    # sum_v p (log p - log q), with the p = 0 terms exactly zero (their log p is -inf)
    kl = (log_p.exp() * (log_p.clamp_min(torch.finfo(torch.float32).min) - log_q)).sum(-1)
    ce = -log_q.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return beta * kl + (1.0 - beta) * ce, kl, ce


def memory_decoder_loss(mem_logits: torch.Tensor, knn_log_probs: torch.Tensor, labels: torch.Tensor,
                        mask: torch.Tensor | None = None, *, beta: float) -> tuple[torch.Tensor, dict]:
    """Mean over valid positions (``mask`` [...], 1 = counts) of Eq. (2); (loss, {"kl", "ce"} detached means)."""
    per_token, kl, ce = memory_decoder_token_loss(mem_logits, knn_log_probs, labels, beta=beta)
    mask = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    count = mask.sum().clamp_min(1.0)
    metrics = {"kl": ((kl * mask).sum() / count).detach(), "ce": ((ce * mask).sum() / count).detach()}
    return (per_token * mask).sum() / count, metrics
