"""Adaptive patch length (Intern-S2 report §2.2.1 Stage 2; walkthrough Ch. 1, Worked example 1)."""

from __future__ import annotations

import pytest

from megatron_s2.models.timeseries.patching import patch_length, plan_patching


def test_longest_series_fits_the_budget():
    """Walkthrough: "Take the paper's stated maximum, T = 300,000, and suppose you have budgeted
    1,024 tokens of the LLM's context for this signal. Solve for L with Q = 4" -> L = 1,172."""
    plan = plan_patching(300_000, token_budget=1024, queries_per_patch=4)
    assert plan.patch_length == 1172
    assert plan.num_patches == 256          # ceil(300,000 / 1,172)
    assert plan.num_tokens == 1024
    assert plan.padded_length - 300_000 == 32  # 256 * 1,172 = 300,032: one short last patch


def test_short_radar_burst_gets_short_patches():
    """Walkthrough: "with the same 1,024-token budget, L = 4 · 4,096 / 1,024 = 16 samples per
    patch" for a T = 4,096 radar burst."""
    plan = plan_patching(4096, token_budget=1024, queries_per_patch=4)
    assert (plan.patch_length, plan.num_patches, plan.num_tokens) == (16, 256, 1024)


def test_fixed_patch_length_squeezes_the_burst():
    """Walkthrough: "If L stayed fixed at 1,172 you would get ⌈4096/1172⌉ = 4 patches, so 16
    tokens" - the S1-Pro failure on high-frequency short signals that adaptive L removes."""
    fixed = -(-4096 // 1172)
    assert (fixed, fixed * 4) == (4, 16)


@pytest.mark.parametrize("budget,queries", [(1024, 4), (1000, 3), (64, 8), (7, 2), (5, 5)])
def test_token_count_never_exceeds_budget(budget, queries):
    """Property over every T in 1..5,000 (and a long tail): Q * ceil(T / L) <= budget, also when
    Q does not divide the budget; and at least half the budget once T fills the budget."""
    max_patches = budget // queries
    for length in [*range(1, 5001), 77_777, 300_000, 1_000_003]:
        plan = plan_patching(length, budget, queries)
        assert plan.num_tokens <= budget, (length, plan)
        assert plan.padded_length >= length > plan.padded_length - plan.patch_length
        if length >= max_patches:
            assert plan.num_patches > max_patches // 2, (length, plan)


def test_patch_length_is_monotone_in_length():
    """Property: a longer series never gets a shorter patch (the token count, by contrast,
    saw-tooths: see the module docstring and the next test)."""
    lengths = [*range(1, 20_001), 300_000, 300_001]
    patch = [patch_length(t, 1024, 4) for t in lengths]
    assert all(a <= b for a, b in zip(patch, patch[1:]))


def test_token_count_is_a_saw_tooth_not_monotone():
    """The documented caveat: T = 256 -> 256 patches of 1; T = 257 -> 129 patches of 2."""
    assert plan_patching(256, 1024, 4).num_patches == 256
    assert plan_patching(257, 1024, 4).num_patches == 129


def test_chunks_are_whole_patches():
    plan = plan_patching(300_000, 1024, 4, patches_per_chunk=64)
    assert (plan.chunk_length, plan.num_chunks) == (64 * 1172, 4)
    assert plan_patching(300_000, 1024, 4, patches_per_chunk=100).num_chunks == 3


def test_chunks_are_capped_in_samples():
    """With max_chunk_samples a chunk holds fewer patches as L grows (never fewer than one)."""
    assert plan_patching(300_000, 1024, 4, max_chunk_samples=16_384).patches_per_chunk == 13   # 16,384 // 1,172
    assert plan_patching(4096, 1024, 4, max_chunk_samples=16_384).patches_per_chunk == 64      # capped by 64
    assert plan_patching(300_000, 1024, 4, max_chunk_samples=100).patches_per_chunk == 1


def test_min_patch_length_floors_short_series():
    plan = plan_patching(10, 1024, 4, min_patch_length=4)
    assert (plan.patch_length, plan.num_patches, plan.num_tokens) == (4, 3, 12)


@pytest.mark.parametrize("kwargs,message", [
    (dict(length=0, token_budget=8, queries_per_patch=2), "series length must be a positive integer"),
    (dict(length=10, token_budget=3, queries_per_patch=4), "raise the budget to at least 4"),
    (dict(length=10, token_budget=8, queries_per_patch=0), "queries_per_patch must be a positive"),
])
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_patching(**kwargs)
