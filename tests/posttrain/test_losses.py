"""Losses: worked example 11 (BKL in both directions), the detached truncated weight (Eq. 10-11),
masks, aggregation and the composed objective against float64 autograd of hand implementations."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.config.posttrain import LossConfig, LossTermConfig
from megatron_s2.posttrain.losses import (
    LOSS_TERMS,
    TOKEN_MASKS,
    LossInputs,
    PosttrainObjective,
    aggregation_weights,
    binary_kl,
    bkl_mask,
    ratio_mask,
    reference_kl_token,
    staleness_mask,
    truncated_importance_weight,
    tv_mask,
)
from megatron_s2.posttrain.vocab_parallel import token_log_probs
from megatron_s2.parallel.groups import Group

LOG = lambda p: torch.log(torch.tensor(p, dtype=torch.float64))  # noqa: E731


# ---- Eq. 12-13 worked example 11 -----------------------------------------------------------------
def test_binary_kl_both_directions_worked_example_11():
    a_fwd, a_bwd = binary_kl(LOG(0.90), LOG(0.80)).item(), binary_kl(LOG(0.80), LOG(0.90)).item()
    assert a_fwd == pytest.approx(0.0367, abs=5e-5) and a_bwd == pytest.approx(0.0444, abs=5e-5)
    assert a_fwd != pytest.approx(a_bwd, abs=1e-3)  # KL is not symmetric
    b_fwd, b_bwd = binary_kl(LOG(0.05), LOG(0.60)).item(), binary_kl(LOG(0.60), LOG(0.05)).item()
    assert b_fwd == pytest.approx(0.6975, abs=5e-5) and b_bwd == pytest.approx(1.1449, abs=5e-5)
    assert b_fwd / a_fwd == pytest.approx(19.0, abs=0.05) and b_bwd / a_fwd == pytest.approx(31.2, abs=0.05)
    train, rollout = LOG([0.90, 0.05]), LOG([0.80, 0.60])
    assert bkl_mask(train, rollout, threshold=0.1).tolist() == [True, False]  # A kept, B masked


def test_bkl_mask_needs_both_directions():
    train, rollout = LOG([0.5]), LOG([0.3])
    fwd, bwd = binary_kl(train, rollout).item(), binary_kl(rollout, train).item()
    phi = (fwd + bwd) / 2  # between the two directions
    assert min(fwd, bwd) <= phi < max(fwd, bwd)
    assert bkl_mask(train, rollout, phi).tolist() == [False]


def test_binary_kl_extremes_are_finite_or_masked():
    assert binary_kl(LOG(1.0), LOG(1.0)).item() == 0.0
    assert binary_kl(LOG(1.0), LOG(0.5)).item() == pytest.approx(math.log(2.0))
    assert math.isinf(binary_kl(LOG(0.5), LOG(1.0)).item())
    assert bkl_mask(LOG([0.5]), LOG([1.0]), 10.0).tolist() == [False]
    close = binary_kl(torch.tensor([-1e-12], dtype=torch.float64), torch.tensor([-2e-12], dtype=torch.float64))
    assert 0 <= close.item() < 1e-10  # precision near p = 1 (expm1)


def test_binary_tv_ratio_and_staleness_masks():
    assert tv_mask(LOG([0.9, 0.05]), LOG([0.8, 0.6]), 0.2).tolist() == [True, False]
    assert ratio_mask(LOG([0.5, 0.5, 0.5]), LOG([0.5, 0.01, 0.99]), 0.6, 8.0).tolist() == [True, False, False]
    versions = torch.tensor([3, 4, 5, 7, 8])
    assert staleness_mask(versions, 8, 3).tolist() == [False, False, True, True, True]
    assert staleness_mask(versions, 8, -1).all()
    with pytest.raises(ValueError, match="newer"):
        staleness_mask(versions, 7, 3)


# ---- Eq. 10-11 --------------------------------------------------------------------------------------------
def test_truncated_importance_weight_is_detached_and_clipped():
    lp = torch.log(torch.tensor([0.8, 0.1, 0.5], dtype=torch.float64)).requires_grad_()
    beh = torch.log(torch.tensor([0.1, 0.8, 0.5], dtype=torch.float64))  # rho = 8, 1/8, 1
    w = truncated_importance_weight(lp, beh, 0.2, 0.2)
    assert not w.requires_grad and w.tolist() == pytest.approx([1.2, 0.8, 1.0])


def test_rho_eight_still_contributes_unlike_ppo():
    """Walkthrough Ch. 4: rho = 8, bound 1.2, A > 0 — PPO's surrogate passes no gradient,
    the detached truncated weight passes 1.2 * A * grad log pi."""
    lp = torch.log(torch.tensor([0.8], dtype=torch.float64)).requires_grad_()
    beh = torch.log(torch.tensor([0.1], dtype=torch.float64))
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = LossConfig(eps_low=0.2, eps_high=0.2, masks=())
    inputs = LossInputs(logprobs=lp, loss_mask=torch.ones(1, dtype=torch.bool), weights=torch.ones(1),
                        behaviour_logprobs=beh, advantages=adv)
    PosttrainObjective(cfg)(inputs).objective.backward()
    assert lp.grad.item() == pytest.approx(-1.2)
    lp2 = lp.detach().clone().requires_grad_()
    ratio = torch.exp(lp2 - beh)
    ppo = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ppo.sum().backward()
    assert lp2.grad.item() == 0.0


# ---- the composed objective vs a float64 hand implementation ---------------------------------------------
def _batch(seed=0, b=3, s=6, v=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s), generator=g)
    beh = torch.log_softmax(logits + 0.3 * torch.randn(b, s, v, generator=g, dtype=torch.float64), -1)
    beh = beh.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref = torch.log_softmax(logits + 0.5 * torch.randn(b, s, v, generator=g, dtype=torch.float64), -1)
    ref = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mask = torch.rand(b, s, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, s).clone()
    versions = torch.randint(4, 8, (b, s), generator=g)
    return logits, labels, beh, ref, mask, adv, versions


def test_objective_matches_hand_implementation_and_its_gradient():
    logits, labels, beh, ref, mask, adv, versions = _batch()
    cfg = LossConfig(terms=(LossTermConfig("policy_gradient"), LossTermConfig("reference_kl", coef=0.05)),
                     eps_low=0.2, eps_high=0.28, masks=("staleness",))
    x = logits.clone().requires_grad_()
    lp = token_log_probs(x, labels, Group.single())
    w = aggregation_weights(mask, "token_mean", global_tokens=float(mask.sum()))
    inputs = LossInputs(logprobs=lp, loss_mask=mask, weights=w, behaviour_logprobs=beh, advantages=adv,
                        versions=versions, current_version=7, reference_logprobs=ref)
    res = PosttrainObjective(cfg, max_staleness=2)(inputs)
    res.objective.backward()

    x2 = logits.clone().requires_grad_()
    lp2 = torch.log_softmax(x2, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    rho = torch.exp(lp2.detach() - beh).clamp(0.8, 1.28)
    keep = mask & (7 - versions <= 2)
    kl = torch.exp(ref - lp2) - (ref - lp2) - 1
    hand = ((-rho * adv * lp2 + 0.05 * kl) * keep).sum() / mask.sum()
    hand.backward()
    torch.testing.assert_close(res.objective, hand, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-14)
    assert torch.equal(res.keep, keep)
    masked, count = res.stats["masked_staleness"]
    assert masked.item() == (mask & ~keep).sum().item() and count.item() == mask.sum().item()
    assert torch.all(x.grad[~keep] == 0)  # masked tokens pass no gradient


def test_gradient_is_only_through_log_pi():
    """d objective / d log pi = -weight * rho_bar * A on kept tokens (the advantage and rho are constants)."""
    logits, labels, beh, _, mask, adv, _ = _batch(seed=1)
    lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).requires_grad_()
    w = aggregation_weights(mask, "token_mean", global_tokens=float(mask.sum()))
    res = PosttrainObjective(LossConfig(masks=()))(LossInputs(lp, mask, w, beh, adv.requires_grad_()))
    res.objective.backward()
    rho = torch.exp(lp.detach() - beh).clamp(0.8, 1.28)
    torch.testing.assert_close(lp.grad, -w * rho * adv.detach())
    assert adv.grad is None


def test_bkl_mask_scope_current_version_only():
    lp = LOG([[0.05, 0.05]])
    beh = LOG([[0.60, 0.60]])
    versions = torch.tensor([[3, 4]])
    inputs = LossInputs(lp, torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.float64), beh,
                        torch.ones(1, 2, dtype=torch.float64), versions=versions, current_version=4)
    scoped = PosttrainObjective(LossConfig(masks=("bkl",)))(inputs).keep
    everywhere = PosttrainObjective(LossConfig(masks=("bkl",), mismatch_scope="all"))(inputs).keep
    assert scoped.tolist() == [[True, False]] and everywhere.tolist() == [[False, False]]


def test_reference_kl_estimators():
    lp, ref = LOG([0.5, 0.2]), LOG([0.25, 0.4])
    x = lp - ref
    assert reference_kl_token(lp, ref, "k1").tolist() == pytest.approx(x.tolist())
    assert reference_kl_token(lp, ref, "k2").tolist() == pytest.approx((0.5 * x * x).tolist())
    k3 = reference_kl_token(lp, ref, "k3")
    assert (k3 >= 0).all() and k3.tolist() == pytest.approx((torch.exp(-x) + x - 1).tolist())


# ---- aggregation ------------------------------------------------------------------------------------------
def test_token_and_sequence_mean_and_layout_independence():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    loss = torch.tensor([[1.0, 2, 3, 4, 9], [10, 9, 9, 9, 9], [5, 7, 9, 9, 9]], dtype=torch.float64)
    tok = (aggregation_weights(mask, "token_mean", global_tokens=7.0) * loss).sum()
    assert tok.item() == pytest.approx((1 + 2 + 3 + 4 + 10 + 5 + 7) / 7)
    ids = torch.tensor([[0] * 5, [1] * 5, [2] * 5])
    seq = (aggregation_weights(mask, "sequence_mean", sequence_ids=ids, global_sequences=3.0) * loss).sum()
    assert seq.item() == pytest.approx((2.5 + 10 + 6) / 3)
    fixed = (aggregation_weights(mask, "fixed", constant=15.0) * loss).sum()
    assert fixed.item() == pytest.approx(32 / 15)
    # micro-batches of one row each, global counts: the sum equals the whole-batch value
    parts = sum((aggregation_weights(mask[i:i + 1], "sequence_mean", sequence_ids=ids[i:i + 1],
                                     global_sequences=3.0) * loss[i:i + 1]).sum() for i in range(3))
    assert parts.item() == pytest.approx(seq.item())
    # a sequence split across two ranks (context parallel) with its total count supplied
    halves = [(aggregation_weights(mask[:1, sl], "sequence_mean", sequence_ids=ids[:1, sl], global_sequences=1.0,
                                   sequence_tokens=torch.tensor([4.0])) * loss[:1, sl]).sum()
              for sl in (slice(0, 2), slice(2, 5))]
    assert sum(halves).item() == pytest.approx(2.5)
    padding_only = aggregation_weights(torch.zeros(1, 3, dtype=torch.bool), "sequence_mean",
                                       sequence_ids=torch.full((1, 3), -1), global_sequences=3.0)
    assert padding_only.abs().sum() == 0
    lam = torch.full_like(loss, 0.5)
    assert (aggregation_weights(mask, "token_mean", global_tokens=7.0, sample_weights=lam) * loss).sum().item() == \
        pytest.approx(tok.item() / 2)


def test_registries_hold_the_documented_pieces():
    assert {"policy_gradient", "reference_kl", "full_vocab_kl", "entropy"} <= set(LOSS_TERMS)
    assert {"bkl", "binary_tv", "staleness", "ratio"} <= set(TOKEN_MASKS)
