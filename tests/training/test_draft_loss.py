"""The drafter's objectives (megatron_s2/training/draft_loss.py): the hybrid LK loss and its
lambda schedule (Intern-S2 walkthrough Eq. 22-24) against a float64 hand implementation written
with loops, gradients that reach the drafter only, masks, temperature, zero-probability targets,
and the confidence-head loss (report §2.4.3)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.training.draft_loss import (
    acceptance_rates,
    confidence_loss,
    hybrid_lk_loss,
    lk_lambda,
    position_overlap,
)


def reference_lk_loss(policy, draft, mask, temperature, eta, alpha_bar=None):
    """Eq. 22-24 spelled out in float64 with Python loops. Returns (loss, acceptance, lambdas)."""
    n, k, vocab = policy.shape
    per_position, acceptance, lambdas = [], [], []
    for j in range(k):
        kls, tvs, overlaps = [], [], []
        for i in range(n):
            if not mask[i, j]:
                continue
            p = torch.softmax(policy[i, j].double() / temperature, -1).tolist()
            q = torch.softmax(draft[i, j].double() / temperature, -1).tolist()
            kls.append(sum(pv * math.log(pv / qv) for pv, qv in zip(p, q) if pv > 0))
            tvs.append(0.5 * sum(abs(pv - qv) for pv, qv in zip(p, q)))
            overlaps.append(sum(min(pv, qv) for pv, qv in zip(p, q)))
        if not kls:
            acceptance.append(0.0)
            lambdas.append(None)
            continue
        rate = sum(overlaps) / len(overlaps)
        acceptance.append(rate)
        alpha = rate if alpha_bar is None else float(alpha_bar[j])
        weight = math.exp(-eta * alpha)
        lambdas.append(weight)
        per_position.append(weight * sum(kls) / len(kls) + (1 - weight) * sum(tvs) / len(tvs))
    return sum(per_position) / len(per_position), acceptance, lambdas


def logits(seed, shape=(6, 4, 9), scale=2.0):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_lambda_schedule_values():
    assert lk_lambda(0.0) == 1.0
    assert lk_lambda(0.8) == pytest.approx(math.exp(-2.4), rel=1e-12)
    assert lk_lambda(1.0) == pytest.approx(math.exp(-3.0), rel=1e-12)
    assert lk_lambda(0.5, eta=1.0) == pytest.approx(math.exp(-0.5), rel=1e-12)
    rates = torch.tensor([0.0, 0.25, 0.8, 1.0], requires_grad=True)
    weights = lk_lambda(rates)
    assert not weights.requires_grad                 # a constant of the loss: no gradient through it
    assert torch.allclose(weights, torch.exp(-3 * torch.tensor([0.0, 0.25, 0.8, 1.0])))
    assert bool((weights[1:] < weights[:-1]).all())  # poor alignment -> KL, good -> TV


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_hybrid_lk_loss_matches_a_float64_hand_implementation(temperature):
    policy, draft = logits(0), logits(1) + 0.5 * logits(0)
    mask = torch.rand(6, 4, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[0] = True
    loss, metrics = hybrid_lk_loss(policy, draft, mask, temperature=temperature)
    expected, acceptance, lambdas = reference_lk_loss(policy, draft, mask, temperature, eta=3.0)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert metrics["acceptance"].tolist() == pytest.approx(acceptance, rel=1e-5)
    assert metrics["lambda"].tolist() == pytest.approx(lambdas, rel=1e-5)
    assert torch.allclose(metrics["acceptance"], acceptance_rates(policy, draft, mask, temperature), atol=1e-6)
    assert metrics["tokens"].tolist() == mask.sum(0).float().tolist()
    assert torch.allclose(metrics["acceptance"], 1 - metrics["tv"], atol=1e-6)


def test_temperature_changes_the_loss():
    policy, draft = logits(0), logits(1)
    mask = torch.ones(6, 4, dtype=torch.bool)
    cold, _ = hybrid_lk_loss(policy, draft, mask, temperature=0.5)
    hot, _ = hybrid_lk_loss(policy, draft, mask, temperature=2.0)
    assert float(cold) > float(hot) * 1.5  # sharper distributions, larger divergence
    with pytest.raises(ValueError, match="temperature"):
        hybrid_lk_loss(policy, draft, mask, temperature=0.0)


def test_a_given_alpha_bar_sets_lambda_and_eta_scales_it():
    policy, draft = logits(3), logits(4)
    mask = torch.ones(6, 4, dtype=torch.bool)
    alpha_bar = torch.tensor([0.0, 0.3, 0.8, 1.0])
    loss, metrics = hybrid_lk_loss(policy, draft, mask, eta=2.0, alpha_bar=alpha_bar)
    expected, _, _ = reference_lk_loss(policy, draft, mask, 1.0, eta=2.0, alpha_bar=alpha_bar)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(metrics["lambda"], torch.exp(-2.0 * alpha_bar))
    # lambda = 1: pure forward KL; lambda = 0 (eta -> inf at alpha > 0): pure TV
    kl_only, metrics = hybrid_lk_loss(policy, draft, mask, alpha_bar=torch.zeros(4))
    assert float(kl_only) == pytest.approx(float(metrics["kl"].mean()), rel=1e-6)
    tv_only, metrics = hybrid_lk_loss(policy, draft, mask, eta=1e4, alpha_bar=torch.ones(4))
    assert float(tv_only) == pytest.approx(float(metrics["tv"].mean()), rel=1e-6)
    with pytest.raises(ValueError, match="alpha_bar"):
        hybrid_lk_loss(policy, draft, mask, alpha_bar=torch.zeros(3))


def test_gradients_reach_the_draft_logits_only():
    policy = logits(5).requires_grad_()
    draft = logits(6).requires_grad_()
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[:, 3] = False                                  # a fully masked position gets no gradient
    loss, _ = hybrid_lk_loss(policy, draft, mask)
    loss.backward()
    assert policy.grad is None
    assert draft.grad is not None and bool(draft.grad[:, :3].abs().sum(-1).gt(0).all())
    assert bool((draft.grad[:, 3] == 0).all())
    # and alpha_bar measured from the batch is a constant: the gradient equals the one at a fixed
    # lambda of the same value
    fixed = draft.detach().clone().requires_grad_()
    rates = acceptance_rates(policy, fixed, mask)
    fixed_loss, _ = hybrid_lk_loss(policy, fixed, mask, alpha_bar=rates)
    fixed_loss.backward()
    assert torch.allclose(fixed.grad, draft.grad, atol=1e-7)


def test_masked_tokens_do_not_count():
    policy, draft = logits(7), logits(8)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[4:, :] = False
    mask[:, 2] = False                                   # a position with no valid token at all
    loss, metrics = hybrid_lk_loss(policy, draft, mask)
    garbage = draft.clone()
    garbage[4:] = 1e3 * torch.randn(2, 4, 9)
    garbage[:, 2] = -1e3
    assert float(hybrid_lk_loss(policy, garbage, mask)[0]) == float(loss)
    expected, _, _ = reference_lk_loss(policy, draft, mask, 1.0, eta=3.0)
    assert float(loss) == pytest.approx(expected, rel=1e-5)   # averaged over the 3 live positions
    assert metrics["tokens"].tolist() == [4.0, 4.0, 0.0, 4.0] and float(metrics["acceptance"][2]) == 0.0
    empty, _ = hybrid_lk_loss(policy, draft.requires_grad_(), torch.zeros(6, 4, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad


def test_zero_probability_target_tokens_are_safe():
    policy, draft = logits(9), logits(10)
    policy[..., :3] = float("-inf")                      # tokens the target never emits
    draft = draft.requires_grad_()
    mask = torch.ones(6, 4, dtype=torch.bool)
    loss, metrics = hybrid_lk_loss(policy, draft, mask)
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(draft.grad).all())
    expected, _, _ = reference_lk_loss(policy, draft.detach(), mask, 1.0, eta=3.0)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    same, metrics = hybrid_lk_loss(policy, policy.clone(), mask)
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(metrics["acceptance"], torch.ones(4))


def test_low_precision_logits_are_computed_in_float32():
    policy, draft = logits(11), logits(12)
    mask = torch.ones(6, 4, dtype=torch.bool)
    loss, _ = hybrid_lk_loss(policy.bfloat16(), draft.bfloat16(), mask)
    expected, _, _ = reference_lk_loss(policy.bfloat16(), draft.bfloat16(), mask, 1.0, eta=3.0)
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[N, K, V\]"):
        hybrid_lk_loss(logits(0), logits(1)[:, :3], torch.ones(6, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        hybrid_lk_loss(logits(0), logits(1), torch.ones(6, 3, dtype=torch.bool))


def test_position_overlap_is_the_walkthrough_acceptance():
    p = torch.tensor([0.6, 0.3, 0.1]).log().view(1, 1, 3)
    q = torch.tensor([0.5, 0.2, 0.3]).log().view(1, 1, 3)
    assert float(position_overlap(p, q)) == pytest.approx(0.80, abs=1e-6)   # worked example 12
    loss, metrics = hybrid_lk_loss(p, q, torch.ones(1, 1, dtype=torch.bool))
    assert float(metrics["tv"]) == pytest.approx(0.20, abs=1e-6)
    kl = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.3)
    weight = math.exp(-3 * 0.8)
    assert float(loss) == pytest.approx(weight * kl + (1 - weight) * 0.2, rel=1e-5)


def test_confidence_loss_is_masked_soft_binary_cross_entropy():
    generator = torch.Generator().manual_seed(13)
    confidence = torch.randn(5, 4, generator=generator, requires_grad=True)
    targets = torch.rand(5, 4, generator=generator, requires_grad=True)
    mask = torch.rand(5, 4, generator=generator) > 0.4
    loss = confidence_loss(confidence, targets, mask)
    expected, count = 0.0, 0
    for i in range(5):
        for j in range(4):
            if mask[i, j]:
                c, t = confidence[i, j].item(), targets[i, j].item()
                sigmoid = 1 / (1 + math.exp(-c))
                expected -= t * math.log(sigmoid) + (1 - t) * math.log(1 - sigmoid)
                count += 1
    assert loss.item() == pytest.approx(expected / count, rel=1e-5)
    loss.backward()
    assert targets.grad is None                          # the target is a measurement
    assert bool((confidence.grad[~mask] == 0).all()) and bool((confidence.grad[mask] != 0).all())
    # minimised where sigmoid(logit) equals the soft target
    at_target = confidence_loss(torch.logit(targets.detach()), targets.detach(), mask)
    assert at_target.item() < loss.item()
    assert confidence_loss(confidence, targets, torch.zeros(5, 4, dtype=torch.bool)).item() == 0.0
    with pytest.raises(ValueError, match="one shape"):
        confidence_loss(confidence, targets[:, :3], mask)
