"""``model.fp8.recipe: blockwise`` on a model whose weights are not whole 128-wide tiles (every
weight of `tiny`) trained with no FP8 GEMM at all and said nothing (the loss was bitwise the
float32 run's). The start-up line counts the GEMM weights that run in FP8 and says plainly when
none does."""

from __future__ import annotations

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.precision import describe_fp8


def test_fp8_line_counts_fp8_gemms(tiny_cfg):
    assert describe_fp8(build_model(tiny_cfg, seed=0), tiny_cfg.fp8, "local", "float32") is None
    none_fit = FP8Config(recipe="blockwise", block=128)
    line = describe_fp8(build_model(tiny_cfg.replace(fp8=none_fit), seed=0), none_fit, "local", "float32")
    assert "0 of" in line and "NO GEMM runs in FP8" in line and "model.fp8.block" in line
    small = FP8Config(recipe="blockwise", block=16)
    line = describe_fp8(build_model(tiny_cfg.replace(fp8=small), seed=0), small, "local", "float32")
    on, total = (int(x) for x in line.split(": ")[-1].split(" GEMM")[0].split(" of "))
    assert 0 < on <= total and "NO GEMM" not in line
