"""Transformer Engine provider (model.transformer_impl: transformer_engine): with TE importable,
the model built with TE GEMMs equals our local modules in bfloat16 (same parameters, recipe
none: TE runs in the compute dtype) within a stated tolerance, and runs a forward+backward
under each FP8 recipe. Skipped, with the reason, where TE does not import (it cannot be
installed on the CPU CI machines)."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.models.v41.spec import BackendUnavailable, get_provider, transformer_engine_available


def test_requesting_te_without_it_is_a_clear_error():
    if transformer_engine_available():
        pytest.skip("Transformer Engine is importable here: the error path does not apply")
    with pytest.raises(BackendUnavailable, match="model.transformer_impl=local"):
        get_provider("transformer_engine")


def _te_or_skip():
    pytest.importorskip("transformer_engine.pytorch",
                        reason="Transformer Engine is not installed (needs CUDA; NGC containers ship it)")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine GEMMs need a CUDA device")


def _pair(tiny_cfg, fp8: FP8Config):
    from megatron_s2.models.v41.model import build_model

    cfg = tiny_cfg.replace(params_dtype="bfloat16", compute_dtype="bfloat16")
    local = build_model(cfg, seed=0).cuda()
    te_model = build_model(cfg.replace(transformer_impl="transformer_engine", fp8=fp8), seed=0).cuda()
    te_model.load_state_dict(local.state_dict())
    return cfg, local, te_model


def test_te_matches_local_in_bf16(tiny_cfg):
    """Tolerance: loss within 1% and logits within 3e-2 absolute (bf16 GEMMs, different kernels)."""
    _te_or_skip()
    cfg, local, te_model = _pair(tiny_cfg, FP8Config())
    assert any(type(m).__name__.startswith("TE") for m in te_model.modules())
    ids = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    outs = [m(ids[:, :-1]) for m in (local, te_model)]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=3e-2, rtol=3e-2)
    losses = [m.loss(o, ids[:, 1:]).float().mean() for m, o in zip((local, te_model), outs)]
    assert abs(losses[1].item() - losses[0].item()) <= 0.01 * abs(losses[0].item())


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise"])
def test_te_fp8_recipes_train(tiny_cfg, recipe):
    _te_or_skip()
    cfg, local, te_model = _pair(tiny_cfg, FP8Config(recipe=recipe, block=128))
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss = te_model.loss(te_model(ids[:, :-1]), ids[:, 1:]).float().mean()
    loss.backward()
    ref = local.loss(local(ids[:, :-1]), ids[:, 1:]).float().mean()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 0.05 * abs(ref.item())
    assert all(torch.isfinite(p.grad).all() for p in te_model.parameters() if p.grad is not None)
