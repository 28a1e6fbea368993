"""Log-probabilities, entropy, KL and total variation on vocabulary-parallel logit shards.

Under tensor parallelism the LM head returns this rank's contiguous vocabulary shard of the
logits, ``[b, s, V/tp]`` (:class:`~megatron_s2.parallel.vocab.VocabParallelHead`). The
post-training losses need, per position,

* the log-probability of a given token (the sampled one: walkthrough Eq. 10, 29, 33),
* the entropy of the policy (metrics, optional bonus),
* KL(p || q) between two distributions over the *full* vocabulary (report §5.2.4 full-vocabulary
  OPD: reverse KL of the student against a teacher that shares the tokenizer; KL to a frozen
  reference),
* total variation / overlap (walkthrough Eq. 21: overlap = sum_v min(p, q) = 1 - TV; the
  acceptance rate of lossless speculative sampling, and a train/rollout mismatch diagnostic),

without ever gathering the full vocabulary. Each function all-reduces a few ``[b, s]``
statistics over the tp group (max, sum of exponentials, partial sums) — the same pattern as
:func:`~megatron_s2.parallel.vocab.vocab_parallel_cross_entropy` — and its backward is the
analytic gradient restricted to the local shard, assuming (like that function) that the
result is used identically on every tp rank. With a size-1 group no communication happens.

Gradients (p = softmax(x), q = softmax(y), per position):

* d log p_t / d x_v = 1[v = t] - p_v
* d H / d x_v = -p_v (log p_v + H)
* d KL(p||q) / d x_v = p_v (log p_v - log q_v - KL),   d KL / d y_v = q_v - p_v
* d TV / d x_v = 1/2 p_v (s_v - sum_u p_u s_u),   s = sign(p - q)   (and symmetrically for y)
"""

from __future__ import annotations

import torch

from megatron_s2.parallel import mappings
from megatron_s2.parallel.groups import Group

__all__ = [
    "vocab_parallel_log_softmax",
    "token_log_probs",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "vocab_parallel_total_variation",
    "vocab_parallel_overlap",
]


def vocab_parallel_log_softmax(logits: torch.Tensor, tp: Group) -> torch.Tensor:
    """This shard's slice of log_softmax over the full vocabulary (float32 or wider, no grad path)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    gmax = mappings.all_reduce_max(x.max(dim=-1).values, tp)
    shifted = x - gmax.unsqueeze(-1)
    sum_exp = mappings.all_reduce_sum(shifted.exp().sum(-1), tp)
    return shifted - sum_exp.log().unsqueeze(-1)


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, tp, start):
        logp = vocab_parallel_log_softmax(logits, tp)
        part = logits.size(-1)
        local = tokens - start
        inside = (local >= 0) & (local < part)
        local = local.clamp(0, part - 1)
        picked = torch.gather(logp, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        picked = mappings.all_reduce_sum(picked, tp)
        ctx.save_for_backward(logp, local, inside)
        return picked

    @staticmethod
    def backward(ctx, grad):
        logp, local, inside = ctx.saved_tensors
        g = -logp.exp()
        g.scatter_add_(-1, local.unsqueeze(-1), inside.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, tp: Group, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[token] per position, [b, s], differentiable w.r.t. the shard.

    ``tokens`` holds global vocabulary ids; the rank owning a token contributes its logit.
    ``temperature`` must equal the sampling temperature so that ratios against the behaviour
    log-probabilities compare the same distribution."""
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"token_log_probs: tokens {tuple(tokens.shape)} do not match logits {tuple(logits.shape)}")
    if temperature != 1.0:
        logits = logits / temperature
    return _TokenLogProb.apply(logits, tokens, tp, tp.rank * logits.size(-1))


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tp):
        logp = vocab_parallel_log_softmax(logits, tp)
        p = logp.exp()
        h = mappings.all_reduce_sum(-(p * logp).sum(-1), tp)
        ctx.save_for_backward(p, logp, h)
        return h

    @staticmethod
    def backward(ctx, grad):
        p, logp, h = ctx.saved_tensors
        return -p * (logp + h.unsqueeze(-1)) * grad.unsqueeze(-1), None


def vocab_parallel_entropy(logits: torch.Tensor, tp: Group) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary, [b, s]."""
    return _Entropy.apply(logits, tp)


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p_logits, q_logits, tp):
        logp = vocab_parallel_log_softmax(p_logits, tp)
        logq = vocab_parallel_log_softmax(q_logits, tp)
        p = logp.exp()
        diff = logp - logq
        kl = mappings.all_reduce_sum((p * diff).sum(-1), tp)
        ctx.save_for_backward(p, logq, diff, kl)
        return kl

    @staticmethod
    def backward(ctx, grad):
        p, logq, diff, kl = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        grad_p = p * (diff - kl.unsqueeze(-1)) * g if ctx.needs_input_grad[0] else None
        grad_q = (logq.exp() - p) * g if ctx.needs_input_grad[1] else None
        return grad_p, grad_q, None


def vocab_parallel_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, tp: Group) -> torch.Tensor:
    """KL(softmax(p_logits) || softmax(q_logits)) per position over the full vocabulary, [b, s].

    Reverse KL of a student against a teacher (report §5.2.4) is
    ``vocab_parallel_kl(student_logits, teacher_logits, tp)``; both shards must cover the same
    vocabulary slice (teachers share the tokenizer)."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"KL: logit shards differ in shape {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}; "
                         "both models must share the tokenizer and the tp split")
    return _KL.apply(p_logits, q_logits, tp)


class _TV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p_logits, q_logits, tp):
        p = vocab_parallel_log_softmax(p_logits, tp).exp()
        q = vocab_parallel_log_softmax(q_logits, tp).exp()
        s = torch.sign(p - q)
        tv = 0.5 * mappings.all_reduce_sum((p - q).abs().sum(-1), tp)
        sp = mappings.all_reduce_sum((p * s).sum(-1), tp)
        sq = mappings.all_reduce_sum((q * s).sum(-1), tp)
        ctx.save_for_backward(p, q, s, sp, sq)
        return tv

    @staticmethod
    def backward(ctx, grad):
        p, q, s, sp, sq = ctx.saved_tensors
        g = 0.5 * grad.unsqueeze(-1)
        grad_p = p * (s - sp.unsqueeze(-1)) * g if ctx.needs_input_grad[0] else None
        grad_q = -q * (s - sq.unsqueeze(-1)) * g if ctx.needs_input_grad[1] else None
        return grad_p, grad_q, None


def vocab_parallel_total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor, tp: Group) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_v |p_v - q_v| per position, [b, s]."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"TV: logit shards differ in shape {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    return _TV.apply(p_logits, q_logits, tp)


def vocab_parallel_overlap(p_logits: torch.Tensor, q_logits: torch.Tensor, tp: Group) -> torch.Tensor:
    """sum_v min(p_v, q_v) = 1 - TV (walkthrough Eq. 21), [b, s]."""
    return 1.0 - vocab_parallel_total_variation(p_logits, q_logits, tp)
