"""Native fine-grained FP8 (DeepSeek-V3 recipe on torch._scaled_mm, model.fp8.recipe: blockwise):
the three GEMMs against a float64 product of the dequantised FP8 operands (the exact arithmetic
the recipe specifies), parity of a whole model against its unquantised twin, the provider's
class choice, and config errors.

Tolerances: vs the float64 dequantised reference, max abs error <= 1e-5 (float32 accumulation
of the per-slice products); vs full precision, relative Frobenius error <= 6% per GEMM (E4M3
keeps 3 mantissa bits) and model loss within 2%, every matrix gradient at cosine similarity >= 0.7 (router: ~0.78) with the unquantised
one, the median matrix >= 0.98 and all gradients together >= 0.99 (tiny model, B = 16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.config.schema import ConfigError
from megatron_s2.kernels.fp8_gemm import (dequantize_blocks, dequantize_tiles, fp8_linear, quantize_blocks,
                                          quantize_tiles)
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.moe.fp8_experts import FP8GroupedExperts
from megatron_s2.models.v41.spec import get_provider
from megatron_s2.parallel.fp8_linear import FP8ColumnParallelLinear

B = 32


def operands(m=50, k=96, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)  # channels of very different size
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w, torch.randn(m, n, generator=g)


def test_gemms_equal_float64_dequantised_products():
    x, w, gy = operands()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xl, wl, B)
    y.backward(gy)
    qx, sx = quantize_tiles(x, B)
    qw, sw = quantize_blocks(w, B)
    wd = dequantize_blocks(qw, sw)
    torch.testing.assert_close(y.double(), dequantize_tiles(qx, sx) @ wd.t(), atol=1e-5, rtol=1e-5)
    qg, sg = quantize_tiles(gy, B)  # dgrad: dy in 1 x B tiles along N, W's blocks transposed
    torch.testing.assert_close(xl.grad.double(), dequantize_tiles(qg, sg) @ wd, atol=1e-5, rtol=1e-5)
    pad = (-x.size(0)) % B  # wgrad: dy and x in B x 1 tiles along the tokens
    a, sa = quantize_tiles(F.pad(gy, (0, 0, 0, pad)).t().contiguous(), B)
    b, sb = quantize_tiles(F.pad(x, (0, 0, 0, pad)).t().contiguous(), B)
    torch.testing.assert_close(wl.grad.double(), dequantize_tiles(a, sa) @ dequantize_tiles(b, sb).t(),
                               atol=1e-5, rtol=1e-5)


def test_gemms_close_to_full_precision():
    x, w, gy = operands(seed=1)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(xl, wl, B).backward(gy)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(fp8_linear(x, w, B), x @ w.t()) < 0.06
    assert rel(xl.grad, gy @ w) < 0.06
    assert rel(wl.grad, gy.t() @ x) < 0.06


def test_quantisers_tile_layout():
    x = torch.zeros(2, 64)
    x[0, 40] = 448.0 * 3
    q, s = quantize_tiles(x, B)
    assert s.shape == (2, 2) and s[0, 1] == 3.0 and q.float()[0, 40] == 448.0 and s[0, 0] == 1e-12
    w = torch.zeros(64, 64)
    w[33, 5] = -896.0
    qw, sw = quantize_blocks(w, B)
    assert sw.shape == (2, 2) and sw[1, 0] == 2.0 and qw.float()[33, 5] == -448.0


def fp8_twin(cfg, recipe_cfg):
    torch.manual_seed(0)
    ref = build_model(cfg, seed=0)
    fp8 = build_model(cfg.replace(fp8=recipe_cfg), seed=0)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def test_model_parity_vs_unquantised(tiny_cfg):
    ref, fp8 = fp8_twin(tiny_cfg, FP8Config(recipe="blockwise", block=16))
    assert any(isinstance(m, FP8GroupedExperts) for m in fp8.modules())
    assert any(isinstance(m, FP8ColumnParallelLinear) and m.fp8 for m in fp8.modules())
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (ref, fp8):
        model.train()
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) <= 0.02 * abs(losses[0])
    grads = dict(ref.named_parameters())
    cosines, flat, ref_flat = {}, [], []
    for name, p in fp8.named_parameters():
        if p.grad is None or grads[name].grad.norm() == 0:
            continue
        flat.append(p.grad.flatten().double())
        ref_flat.append(grads[name].grad.flatten().double())
        if p.dim() < 2:  # scalars and vectors with near-zero gradients: judged in the global cosine only
            continue
        cosines[name] = F.cosine_similarity(p.grad.flatten().double(), grads[name].grad.flatten().double(), dim=0)
    worst = min(cosines, key=cosines.get)
    assert cosines[worst] >= 0.7, f"{worst}: gradient cosine {cosines[worst]:.4f}"
    assert torch.stack(list(cosines.values())).median() >= 0.98
    assert F.cosine_similarity(torch.cat(flat), torch.cat(ref_flat), dim=0) >= 0.99


def test_provider_and_config_errors():
    prov = get_provider("local", FP8Config(recipe="blockwise", attention=False))
    assert prov.linears().column_parallel_linear.__name__ == "ColumnParallelLinear"
    assert issubclass(prov.experts()[0], FP8GroupedExperts)
    with pytest.raises(ConfigError, match="model.fp8.block"):
        FP8Config(recipe="blockwise", block=100)
    with pytest.raises(ConfigError, match="transformer_impl=transformer_engine"):
        FP8Config(recipe="delayed").check_backend("local")
