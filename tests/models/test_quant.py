"""Fake quantisation for QAT (report §2.4.4) against the formats' definitions.

Bounds used below (s = the block's scale, u = |x| / s):

* E2M1 represents {0, 0.5, 1, 1.5, 2, 3, 4, 6}; the spacing is 0.5 on [0, 2], 1 on [2, 4] and
  2 on [4, 6]. Round-to-nearest therefore errs by at most half the local spacing:
  |x - q(x)| <= s * h(u) with h = 0.25 (u <= 2), 0.5 (u <= 4), 1 (u <= 6). With an E4M3 scale
  s = E4M3(amax / 6) the block maximum may exceed 6 s by the E4M3 rounding (<= 2^-4
  relative): it saturates at 6 s with an error of at most 0.375 s, still within h = 1.
  This needs s to be an E4M3 *normal* number (amax >= 6 * 2^-6 = 0.09375); below that the
  scale's spacing is 2^-9 absolute and rounding it down can saturate the block maximum by more
  (see test_fp4_subnormal_scale_saturates).
* FP8 E4M3 with a power-of-two scale: relative error <= 2^-4 for values in E4M3's normal range
  (u >= 2^-6), absolute error <= 2^-10 s below it (subnormal spacing 2^-9).
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.v41.layer_plan import SharedStateKind as K
from megatron_s2.kernels.quant_formats import E2M1_MAX, E4M3_MAX, FP4_MAIN_KV_MAX, ceil_pow2, round_e2m1
from megatron_s2.kernels.quantize import fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4
from megatron_s2.models.v41.rope import apply_rope

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_e2m1_even(v: float) -> float:
    """Reference rounding: nearest grid value, ties to the even code (code = grid index),
    saturating at 6, sign kept."""
    mag = min(abs(v), 6.0)
    dist = (GRID - mag).abs()
    best = dist.min()
    codes = [i for i in range(len(GRID)) if dist[i] == best]
    code = codes[0] if len(codes) == 1 else next(c for c in codes if c % 2 == 0)
    return float(GRID[code]) * (-1.0 if v < 0 else 1.0)


def half_spacing(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u <= 2, 0.25, torch.where(u <= 4, 0.5, 1.0))


def on_grid(values: torch.Tensor) -> torch.Tensor:
    return (values.abs().unsqueeze(-1) == GRID).any(-1)


def random_blocks(n_blocks: int, block: int, seed: int) -> torch.Tensor:
    """Blocks with magnitudes spread over many octaves (and a few exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=g)
    x = x * torch.exp2(torch.randint(-8, 8, (n_blocks, 1), generator=g).float())
    x[0, :3] = 0.0
    return x


# ---- E2M1 rounding -----------------------------------------------------------------------------
def test_round_e2m1_is_nearest_with_ties_to_even():
    values = torch.arange(-7 * 64, 7 * 64 + 1) / 64.0  # every midpoint is a multiple of 1/64
    got = round_e2m1(values)
    want = torch.tensor([nearest_e2m1_even(v) for v in values.tolist()])
    assert torch.equal(got, want)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_e2m1(torch.tensor([6.5, 100.0, -1e9])).tolist() == [6.0, 6.0, -6.0]


# ---- FP4 E2M1 + E4M3 per 16 (main KV) ------------------------------------------------------------
def test_fp4_e4m3_is_on_the_grid_and_within_half_a_step():
    x = random_blocks(256, 16, seed=0)
    q = fake_quant_fp4_e4m3(x).view(256, 16)
    amax = x.abs().amax(-1, keepdim=True)
    s = (amax / E2M1_MAX).to(torch.float8_e4m3fn).float()  # the block's E4M3 scale
    normal = (amax / E2M1_MAX >= 2.0 ** -6).squeeze(-1)
    assert normal.float().mean() > 0.7
    x, q, amax, s = x[normal], q[normal], amax[normal], s[normal]
    assert torch.equal(s.to(torch.float8_e4m3fn).float(), s) and (s > 0).all()
    assert on_grid(q / s).all()  # every stored value is an E2M1 code times the block scale
    err = (x - q).abs()
    assert (err <= s * half_spacing(x.abs() / s) + 1e-12 * amax).all()
    assert (err <= s).all()  # the per-block bound: half the largest grid step
    assert ((s - amax / 6).abs() <= 2.0 ** -4 * amax / 6).all()  # E4M3 scale rounding
    assert torch.equal(q[x == 0], torch.zeros(int((x == 0).sum())))


def test_fp4_subnormal_scale_saturates():
    """amax / 6 = 1.45 * 2^-9 casts to the subnormal scale 2^-9: the maximum (8.7 s) saturates
    at 6 s, a 31 % error. Reference semantics (scale = E4M3(amax / 6), no rounding up); it cannot
    matter for the RMS-normalised main KV unless a whole 16-channel block is below 0.094."""
    block = torch.zeros(16)
    block[0] = 6 * 1.45 * 2.0 ** -9
    q = fake_quant_fp4_e4m3(block)
    assert q[0] == 6 * 2.0 ** -9


def test_fp4_main_kv_dynamic_range_is_448_times_6_without_a_global_scale():
    assert FP4_MAIN_KV_MAX == E4M3_MAX * E2M1_MAX == 2688.0
    block = torch.tensor([2688.0, -1344.0, 896.0, 672.0, 448.0, 224.0, -1792.0, 0.0] + [0.0] * 8)
    q = fake_quant_fp4_e4m3(block)
    assert q[0] == 2688.0
    assert torch.equal(q, block)  # scale 448 (E4M3 max) x E2M1 codes: all exact
    # the report's magnitude bound (sqrt(512) ~ 22.6) and far beyond are representable
    for amax in (22.6, 100.0, 1000.0, 2600.0):
        b = torch.linspace(-amax, amax, 16)
        assert (fake_quant_fp4_e4m3(b) - b).abs().max() <= amax / 6 * (1 + 2 ** -4)
    # beyond the range it saturates (no inf / nan)
    assert fake_quant_fp4_e4m3(torch.tensor([5000.0] + [1.0] * 15))[0] == 2688.0


# ---- MXFP4 (indexer) -------------------------------------------------------------------------------
def test_mxfp4_uses_power_of_two_scales_without_saturation():
    x = random_blocks(256, 32, seed=1)
    q = fake_quant_mxfp4(x).view(256, 32)
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)))  # smallest power of two with amax / s <= 6
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert (amax / s <= 6).all() and (amax / (s / 2) > 6).all()
    assert on_grid(q / s).all()
    assert ((x - q).abs() <= s * half_spacing(x.abs() / s)).all()
    assert ceil_pow2(torch.tensor([1.0, 1.5, 3.0, 0.375])).tolist() == [1.0, 2.0, 4.0, 0.5]


# ---- FP8 E4M3 (SWA KV) ---------------------------------------------------------------------------------
def test_fp8_relative_error_is_at_most_2_to_the_minus_4():
    x = random_blocks(256, 32, seed=2)
    q = fake_quant_fp8(x).view(256, 32)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = ceil_pow2(amax / E4M3_MAX)
    normal = x.abs() / s >= 2.0 ** -6
    err = (x - q).abs()
    assert normal.float().mean() > 0.9
    assert (err[normal] <= 2.0 ** -4 * x.abs()[normal]).all()
    assert (err[~normal] <= 2.0 ** -10 * s.expand_as(x)[~normal]).all()
    assert torch.equal((q / s).to(torch.float8_e4m3fn).float(), q / s)  # E4M3 values x pow2 scale


# ---- straight-through gradients ----------------------------------------------------------------------
@pytest.mark.parametrize("fq, block", [(fake_quant_fp4_e4m3, 16), (fake_quant_mxfp4, 32), (fake_quant_fp8, 32)])
def test_straight_through_gradient_is_identity(fq, block):
    x = random_blocks(8, 2 * block, seed=3).view(2, 4, 2 * block).requires_grad_()
    g = torch.randn(2, 4, 2 * block)
    y = fq(x)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.equal(y, x)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("fq", [fake_quant_fp4_e4m3, fake_quant_mxfp4, fake_quant_fp8])
def test_quantisers_keep_bfloat16_and_reject_ragged_blocks(fq):
    x = torch.randn(3, 64).bfloat16()
    assert fq(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a multiple of the quantisation block"):
        fq(torch.randn(3, 40))


# ---- placement in the layer (§2.4.4: after RoPE; SWA stays FP8) --------------------------------------
def test_main_kv_is_fp4_quantised_after_rope(tiny_cfg, make_attention, make_ctx, monkeypatch):
    cfg = tiny_cfg.replace(fp4_main_kv=True, fp8_swa_kv=True)
    attn = make_attention(cfg, 1, seed=0).eval()
    x = torch.randn(1, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ctx = make_ctx(cfg, torch.zeros(1, 16, dtype=torch.long))
    published = {}
    real = ctx.shared.publish
    ctx.shared.publish = lambda p, k, v: (published.__setitem__((p, k), v), real(p, k, v))[1]
    with torch.no_grad():
        attn(x, ctx)
        latent = attn.compressor.pool(*attn.compressor.project(x))
        pos = (torch.arange(latent.size(1)) * 2).view(1, -1)
        roped = apply_rope(latent, pos, attn.inv_freq)
    main = published[(1, K.MAIN_KV)]
    assert torch.equal(main, fake_quant_fp4_e4m3(roped))
    assert not torch.equal(main, apply_rope(fake_quant_fp4_e4m3(latent), pos, attn.inv_freq))
    # switchable: with fp4_main_kv off the published main KV is the plain rotated latent
    plain = make_attention(tiny_cfg, 1, seed=0).eval()
    ctx = make_ctx(tiny_cfg, torch.zeros(1, 16, dtype=torch.long))
    with torch.no_grad():
        plain(x, ctx)
    torch.testing.assert_close(ctx.shared.peek(1, K.MAIN_KV), roped, atol=1e-6, rtol=0)
