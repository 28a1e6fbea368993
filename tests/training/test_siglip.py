"""SigLIP sigmoid loss (megatron_s2/training/siglip.py) and the overlapped contrastive step
(megatron_s2/training/contrastive_schedule.py, V4.1 report §3.1.1): against a float64 hand
implementation, block decomposition over ranks, and DP2 (gloo) gradients equal to the blocking
schedule's and to the single-process full batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.parallel.groups import Group
from megatron_s2.training.contrastive_schedule import contrastive_forward_backward
from megatron_s2.training.siglip import INIT_BIAS, INIT_LOG_TEMPERATURE, siglip_block_loss, siglip_loss
from tests.parallel.spawn import run_distributed


def hand_siglip(x, y, t_prime: float, b: float) -> float:
    """Zhai et al. 2023, Algorithm 1, written out in float64 scalars."""
    n = len(x)
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            logit = math.exp(t_prime) * sum(a * c for a, c in zip(x[i], y[j])) + b
            total += math.log(1.0 / (1.0 + math.exp(-z * logit)))
    return -total / n


def features(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(torch.randn(n, d, generator=g), dim=-1)


def test_init_values_are_siglips():
    assert INIT_LOG_TEMPERATURE == pytest.approx(math.log(10.0)) and INIT_BIAS == -10.0


@pytest.mark.parametrize("t_prime,b", [(INIT_LOG_TEMPERATURE, INIT_BIAS), (0.3, 1.5)])
def test_loss_matches_float64_hand_implementation(t_prime, b):
    x, y = features(6, 5, seed=0)
    # make some pairs similar so positives are not all at the prior
    y[:3] = F.normalize(x[:3] + 0.2 * y[:3], dim=-1)
    got = siglip_loss(x, y, torch.tensor(t_prime), torch.tensor(b))
    assert float(got) == pytest.approx(hand_siglip(x.double().tolist(), y.double().tolist(), t_prime, b), rel=1e-5)


def test_blocks_of_ranks_add_up_to_the_full_loss_and_gradients():
    """Each 'rank' r: L_T(r) = all images x its texts, L_V(r) = its images x all texts. sum_r L_T = L,
    dL/dy from L_T, dL/dx from L_V, dL/dt' and dL/db from L_T alone."""
    n, dp, d = 3, 2, 4
    x, y = features(n * dp, d, seed=1)
    tp, b = torch.tensor(0.7, requires_grad=True), torch.tensor(-1.0, requires_grad=True)
    xf, yf = x.clone().requires_grad_(), y.clone().requires_grad_()
    full = siglip_loss(xf, yf, tp, b)
    full.backward()
    ref = [xf.grad, yf.grad, tp.grad.clone(), b.grad.clone()]
    tp.grad = b.grad = None
    total, gx, gy = 0.0, torch.zeros_like(x), torch.zeros_like(y)
    for r in range(dp):
        rows = slice(r * n, (r + 1) * n)
        yl = y[rows].clone().requires_grad_()
        lt = siglip_block_loss(x, yl, tp, b, image_offset=0, text_offset=r * n, batch_size=n * dp)
        lt.backward()
        xl = x[rows].clone().requires_grad_()
        lv = siglip_block_loss(xl, y, tp.detach(), b.detach(), image_offset=r * n, text_offset=0, batch_size=n * dp)
        lv.backward()
        total += float(lt.detach())
        gx[rows], gy[rows] = xl.grad, yl.grad
    assert total == pytest.approx(float(full.detach()), rel=1e-6)
    for got, want in zip([gx, gy, tp.grad, b.grad], ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_mismatched_pairs_refused():
    x, y = features(3, 4, seed=2)
    with pytest.raises(ValueError, match="3 images but 2 texts"):
        siglip_loss(x, y[:2], torch.tensor(0.0), torch.tensor(0.0))


# ---- the overlapped step under DP2 --------------------------------------------------------------
class Towers(torch.nn.Module):
    """Two small real encoders plus t' and b: enough to check the schedule's gradient flow."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.vision = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.text = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.log_temperature = torch.nn.Parameter(torch.tensor(INIT_LOG_TEMPERATURE))
        self.bias = torch.nn.Parameter(torch.tensor(-2.0))  # away from -10 so the gradients are not tiny


def batch(n: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, 12, generator=g), torch.randn(n, 10, generator=g)


def step(model: Towers, images, texts, group: Group, overlap: bool):
    model.zero_grad(set_to_none=True)
    loss = contrastive_forward_backward(lambda: F.normalize(model.vision(images), dim=-1),
                                        lambda: F.normalize(model.text(texts), dim=-1),
                                        model.log_temperature, model.bias, group, overlap=overlap)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def two_towers():
    """The contrastive phase's real model (ViT + text tower, tiny) and 8 procedural pairs."""
    from megatron_s2.config.contrastive import ContrastiveConfig
    from megatron_s2.data.procedural_images import procedural_items
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.models.family import family_of
    from megatron_s2.models.init import initialize_parameters
    from tests.vision.conftest import vision_config

    cfg = vision_config(vision_patch_size=8)
    tokenizer = CharTokenizer()
    model = family_of(cfg).build_contrastive_model(cfg, ContrastiveConfig(text_dim=16, text_heads=2, text_inter_dim=24,
                                                                          embed_dim=8), tokenizer.vocab_size)
    initialize_parameters(model, 3, 0.2)
    items = procedural_items(8, seed=5, size=32)
    images = model.prepare_images([item.image for item in items], 224)
    captions = [torch.tensor(tokenizer.encode(item.caption)) for item in items]
    return model, images, captions


def tower_step(model, images, captions, group: Group, overlap: bool):
    model.zero_grad(set_to_none=True)
    loss = contrastive_forward_backward(lambda: model.encode_images(images), lambda: model.encode_texts(captions),
                                        model.log_temperature, model.logit_bias, group, overlap=overlap)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _dp2_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    group = Group(dist.group.WORLD, world, rank, tuple(range(world)))
    rows = slice(rank * 4, (rank + 1) * 4)
    images, texts = batch(8)
    mlp = Towers()
    towers, pixels, captions = two_towers()
    results = {}
    for overlap in (True, False):
        for name, (loss, grads) in (("mlp", step(mlp, images[rows], texts[rows], group, overlap)),
                                    ("towers", tower_step(towers, pixels[rows], captions[rows], group, overlap))):
            dist.all_reduce(loss)  # global loss = sum of the ranks' L_T blocks
            for g in grads.values():
                dist.all_reduce(g)  # the trainer's SUM over data-parallel replicas
            results[name, overlap] = (loss, grads)
    if rank == 0:
        torch.save(results, out)


@pytest.mark.slow
def test_overlapped_step_dp2_equals_blocking_and_single_process(tmp_path):
    out = tmp_path / "dp2.pt"
    run_distributed(2, _dp2_worker, str(out))
    results = torch.load(out)
    images, texts = batch(8)
    towers, pixels, captions = two_towers()
    references = {"mlp": step(Towers(), images, texts, Group.single(), overlap=True),
                  "towers": tower_step(towers, pixels, captions, Group.single(), overlap=True)}
    for model, (ref_loss, ref_grads) in references.items():
        (loss_o, grads_o), (loss_b, grads_b) = results[model, True], results[model, False]
        assert torch.equal(loss_o, loss_b)  # same computation, same order: bitwise
        assert grads_o.keys() == grads_b.keys() == ref_grads.keys()
        for name in ref_grads:
            assert torch.equal(grads_o[name], grads_b[name]), name
            torch.testing.assert_close(grads_o[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{model} {name}")
        torch.testing.assert_close(loss_o, ref_loss, rtol=1e-6, atol=1e-6)
        assert ref_grads[next(n for n in ref_grads if "temperature" in n)].abs() > 0
    assert "vision.tower.blocks.0.attn.wqkv.weight" in references["towers"][1]
    assert "text.blocks.1.mlp.w1.weight" in references["towers"][1]
