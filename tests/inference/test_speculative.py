"""Speculative decoding arithmetic (megatron_s2/inference/speculative.py): acceptance = overlap
(walkthrough worked example 12), exact losslessness of rejection sampling (chi-square against
the target, with negative controls that show the test can fail), the classical tokens-per-round
law measured with a synthetic drafter of known acceptance, greedy verification = plain greedy
decode, prefix survival, the throughput profile, and the verification-length scheduler against
brute force (report §2.4.3)."""

from __future__ import annotations

import itertools
import json
import math
import time

import pytest
import torch

from megatron_s2.inference.sampling import SamplingParams, sample_next
from megatron_s2.inference.speculative import (
    ThroughputProfile,
    choose_verification_lengths,
    expected_tokens_per_round,
    overlap,
    prefix_survival,
    speculative_sample,
    total_variation,
    verify_greedy,
    verify_sampled,
)

F64 = torch.float64


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper incomplete gamma
    Q(df/2, statistic/2) (scipy is not a dependency of the project)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=F64), torch.tensor(statistic / 2, dtype=F64)))


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of integer ``samples`` to the distribution ``probs`` (cells
    with probability 0 must be empty, else the fit is rejected outright)."""
    counts = torch.bincount(samples, minlength=probs.numel()).to(F64)
    expected = probs.to(F64) * samples.numel()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    live = expected > 0
    statistic = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    return chi2_sf(statistic, int(live.sum()) - 1)


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(36.41502850180731, 24) == pytest.approx(0.05, abs=1e-9)
    # scipy.stats.chi2.sf's values (scipy 1.17; not imported here: it costs 2 s and is no dependency)
    assert chi2_sf(0.5, 3) == pytest.approx(0.9188914116546758, rel=1e-9)
    assert chi2_sf(20.0, 24) == pytest.approx(0.6967761463031061, rel=1e-9)
    assert chi2_sf(80.0, 24) == pytest.approx(6.084202717664003e-08, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Acceptance = overlap
# ---------------------------------------------------------------------------------------------

def test_worked_example_12_overlap_is_one_minus_total_variation():
    p = torch.tensor([0.60, 0.30, 0.10], dtype=F64)
    q = torch.tensor([0.50, 0.20, 0.30], dtype=F64)
    assert float(overlap(p, q)) == pytest.approx(0.80, abs=1e-12)
    assert float(total_variation(p, q)) == pytest.approx(0.20, abs=1e-12)
    # and the measured acceptance of drafts from q equals the overlap
    n = 40_000
    generator = torch.Generator().manual_seed(12)
    drafts = torch.multinomial(q.expand(n, 3), 1, replacement=True, generator=generator)
    accepted, _ = speculative_sample(p.expand(n, 2, 3), q.expand(n, 1, 3), drafts, generator)
    rate = float(accepted.double().mean())
    assert abs(rate - 0.80) < 4 * math.sqrt(0.8 * 0.2 / n)


def test_overlap_along_a_dimension():
    p = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(1)), -1)
    assert torch.allclose(overlap(p, q), 1 - total_variation(p, q), atol=1e-6)
    assert torch.allclose(overlap(p.T, q.T, dim=0), overlap(p, q))
    assert torch.allclose(overlap(p, p), torch.ones(4))


def test_expected_tokens_per_round_formula_and_limit():
    assert expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens_per_round(0.0, 4) == 1
    assert expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(1 - 1e-12, 4) == pytest.approx(5)
    assert expected_tokens_per_round(0.5, 0) == 1
    a = torch.tensor([0.0, 0.5, 1.0])
    assert torch.allclose(expected_tokens_per_round(a, 2), torch.tensor([1.0, 1.75, 3.0]))
    with pytest.raises(ValueError, match="k: must be >= 0"):
        expected_tokens_per_round(0.5, -1)


def known_acceptance_pair(a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q over 4 tokens with overlap exactly ``a`` (shared mass a, disjoint rest)."""
    p = torch.tensor([a / 2, a / 2, 1 - a, 0.0], dtype=F64)
    q = torch.tensor([a / 2, a / 2, 0.0, 1 - a], dtype=F64)
    return p, q


@pytest.mark.parametrize("a", [0.8, 0.55])
def test_tokens_per_round_measured_with_a_drafter_of_known_acceptance(a):
    """Every position's draft is accepted with probability a independently: a round of K = 4
    emits (1 - a^5) / (1 - a) tokens on average (Leviathan et al. 2023, Eq. 1)."""
    p, q = known_acceptance_pair(a)
    assert float(overlap(p, q)) == pytest.approx(a)
    k, n = 4, 40_000
    generator = torch.Generator().manual_seed(int(a * 100))
    drafts = torch.multinomial(q.expand(n * k, 4), 1, replacement=True, generator=generator).view(n, k)
    accepted, _ = speculative_sample(p.expand(n, k + 1, 4), q.expand(n, k, 4), drafts, generator)
    emitted = (accepted + 1).double()
    standard_error = float(emitted.std()) / math.sqrt(n)
    assert abs(float(emitted.mean()) - expected_tokens_per_round(a, k)) < 4 * standard_error
    # and per position: P(accepted >= j) = a^j
    for j in range(1, k + 1):
        assert float((accepted >= j).double().mean()) == pytest.approx(a ** j, abs=4 * math.sqrt(a ** j / n))


# ---------------------------------------------------------------------------------------------
# Losslessness of sampled verification
# ---------------------------------------------------------------------------------------------

V, K, ROUNDS = 5, 3, 30_000
X0 = 0


def markov_models(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """A target P and a rather different drafter Q: next-token tables [V, V] (row = previous token)."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.rand(V, V, generator=generator, dtype=F64) + 0.3
    draft = torch.rand(V, V, generator=generator, dtype=F64) ** 3 + 0.02
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


def speculative_round(target, draft, context, generator, resample_from_target=False):
    """One round for every context token: draft K tokens from Q autoregressively, verify them
    against P's rows after each drafted prefix. Returns the emitted tokens [N, K+1] (valid up to
    ``accepted``) and ``accepted``. ``resample_from_target``: the classic bug (draw the
    replacement from p instead of the residual), a negative control."""
    drafts, draft_rows, previous = [], [], context
    for _ in range(K):
        row = draft[previous]
        previous = torch.multinomial(row, 1, generator=generator).squeeze(-1)
        draft_rows.append(row)
        drafts.append(previous)
    drafts = torch.stack(drafts, 1)
    target_rows = target[torch.cat([context.unsqueeze(1), drafts], 1)]            # [N, K+1, V]
    accepted, token = speculative_sample(target_rows, torch.stack(draft_rows, 1), drafts, generator)
    if resample_from_target:
        rows = torch.arange(len(context))
        redraw = torch.multinomial(target_rows[rows, accepted], 1, generator=generator).squeeze(-1)
        token = torch.where(accepted < K, redraw, token)
    emitted = torch.cat([drafts, drafts[:, :1]], 1)
    emitted[torch.arange(len(context)), accepted] = token
    return emitted, accepted


def first_two_tokens(target, draft, generator, resample_from_target=False):
    context = torch.full((ROUNDS,), X0, dtype=torch.long)
    emitted, accepted = speculative_round(target, draft, context, generator, resample_from_target)
    # a round that accepted nothing emitted one token: the second comes from the next round
    follow_up, _ = speculative_round(target, draft, emitted[:, 0], generator, resample_from_target)
    second = torch.where(accepted >= 1, emitted[:, 1], follow_up[:, 0])
    return emitted[:, 0], second


def test_sampled_verification_is_lossless_chi_square():
    target, draft = markov_models()
    assert 0.4 < float(overlap(target, draft).mean()) < 0.9  # drafts are rejected often
    first, second = first_two_tokens(target, draft, torch.Generator().manual_seed(2023))
    assert chi_square_pvalue(first, target[X0]) > 1e-3
    joint = target[X0].unsqueeze(1) * target                                     # P(x1) P(x2 | x1)
    assert chi_square_pvalue(first * V + second, joint.reshape(-1)) > 1e-3


def test_chi_square_rejects_a_lossy_verifier():
    """The same test has the power to fail: the drafter's own distribution, and the classic
    resample-from-p bug, are both rejected at this sample size."""
    target, draft = markov_models()
    joint = (target[X0].unsqueeze(1) * target).reshape(-1)
    context = torch.full((ROUNDS,), X0, dtype=torch.long)
    generator = torch.Generator().manual_seed(2023)
    draft_first = torch.multinomial(draft[context], 1, generator=generator).squeeze(-1)
    draft_second = torch.multinomial(draft[draft_first], 1, generator=generator).squeeze(-1)
    assert chi_square_pvalue(draft_first * V + draft_second, joint) < 1e-6
    first, second = first_two_tokens(target, draft, generator, resample_from_target=True)
    assert chi_square_pvalue(first * V + second, joint) < 1e-6


def test_verify_sampled_is_speculative_sample_of_one_request_and_reproducible():
    target, draft = markov_models()
    drafts = torch.tensor([1, 4, 2])
    target_rows = target[torch.tensor([X0, 1, 4, 2])]
    draft_rows = draft[torch.tensor([X0, 1, 4])]
    results = [verify_sampled(target_rows, draft_rows, drafts, torch.Generator().manual_seed(s)) for s in range(50)]
    again = [verify_sampled(target_rows, draft_rows, drafts, torch.Generator().manual_seed(s)) for s in range(50)]
    assert results == again
    assert len(set(results)) > 3  # the seed matters
    for seed in range(50):
        accepted, token = speculative_sample(target_rows[None], draft_rows[None], drafts[None],
                                             torch.Generator().manual_seed(seed))
        assert (int(accepted[0]), int(token[0])) == results[seed]


def test_identical_distributions_accept_everything_without_nan():
    p = torch.tensor([[0.5, 0.5, 0.0]] * 3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        accepted, token = verify_sampled(p, p[:2], torch.tensor([0, 1]), generator)
        assert accepted == 2 and token in (0, 1)


def test_rejection_draws_from_the_residual():
    # d = 1 has p = 0: always rejected; the residual max(0, p - q) is a point mass on token 0
    p = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        assert verify_sampled(p, q, torch.tensor([1]), generator) in {(0, 0), (0, 2)}
    q = torch.tensor([[0.0, 0.5, 0.5]])  # residual = (0.5, 0, 0): token 0 only
    assert {verify_sampled(p, q, torch.tensor([1]), generator) for _ in range(20)} == {(0, 0)}


def test_a_draft_the_drafter_gave_zero_probability_is_decided_by_the_target():
    q = torch.tensor([[1.0, 0.0, 0.0]])
    allowed = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    forbidden = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    assert verify_sampled(allowed, q, torch.tensor([1]), generator) == (1, 2)
    assert verify_sampled(forbidden, q, torch.tensor([1]), generator) == (0, 0)


def test_lengths_limit_each_request_and_take_the_bonus_from_its_row():
    # p row j is a point mass on token j + 10; q == p on the drafted tokens: always accepted
    vocab, k = 16, 3
    p = torch.zeros(2, k + 1, vocab)
    p[:, torch.arange(k + 1), torch.arange(k + 1) + 10] = 1.0
    drafts = torch.arange(k).expand(2, k) + 10
    q = p[:, :k].clone()
    accepted, token = speculative_sample(p, q, drafts, torch.Generator().manual_seed(0), lengths=torch.tensor([0, 2]))
    assert accepted.tolist() == [0, 2] and token.tolist() == [10, 12]
    with pytest.raises(ValueError, match="lengths"):
        speculative_sample(p, q, drafts, torch.Generator(), lengths=torch.tensor([0, 4]))


def test_zero_drafts_sample_the_target():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    assert verify_sampled(p, torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.Generator()) == (0, 2)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="target_probs"):
        verify_sampled(torch.ones(2, 3) / 3, torch.ones(2, 3) / 3, torch.tensor([0, 1]), torch.Generator())
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled(torch.ones(3, 3) / 3, torch.ones(2, 4) / 4, torch.tensor([0, 1]), torch.Generator())
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(torch.ones(2, 3), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------
# Greedy verification
# ---------------------------------------------------------------------------------------------

def test_verify_greedy_cases():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 9.0], [2.0, 0.0, 0.0]])
    assert verify_greedy(logits, torch.tensor([1, 0, 2])) == (3, 0)     # all accepted: bonus row
    assert verify_greedy(logits, torch.tensor([1, 0, 0])) == (2, 2)     # mismatch at position 2
    assert verify_greedy(logits, torch.tensor([2, 0, 2])) == (0, 1)     # mismatch at position 0
    assert verify_greedy(logits[:1], torch.zeros(0, dtype=torch.long)) == (0, 1)


def test_verify_greedy_breaks_ties_like_the_engine_sampler():
    greedy = SamplingParams(temperature=0)
    logits = torch.tensor([[1.0, 4.0, 4.0], [7.0, 7.0, 7.0], [0.0, 2.0, 2.0]]).to(torch.bfloat16)
    engine = [sample_next(row.float(), greedy, torch.Generator()).token_id for row in logits]
    assert engine == [1, 0, 1]
    assert verify_greedy(logits, torch.tensor(engine[:2])) == (2, engine[2])
    assert verify_greedy(logits, torch.tensor([2, 0])) == (0, 1)


def test_greedy_speculative_decode_equals_plain_greedy_decode():
    """A long generation from a synthetic target (next token from the last token and the
    position) with many exact ties, and an imperfect drafter: speculative greedy emits exactly
    the plain greedy tokens."""
    vocab, period, steps, k = 11, 13, 300, 4
    generator = torch.Generator().manual_seed(5)
    table = torch.randint(0, 3, (vocab, period, vocab), generator=generator).float()   # values 0..2: ties
    noisy = table + 0.6 * torch.randn(vocab, period, vocab, generator=generator)

    def target(prefix):
        return table[prefix[-1], len(prefix) % period]

    greedy = SamplingParams(temperature=0)
    plain = [3]
    while len(plain) < steps + 1:
        plain.append(sample_next(target(plain), greedy, generator).token_id)
    spec, rounds = [3], 0
    while len(spec) < steps + 1:
        drafted = list(spec)
        for _ in range(k):
            drafted.append(int(noisy[drafted[-1], len(drafted) % period].argmax()))
        drafts = torch.tensor(drafted[len(spec):])
        # the target's rows after the context and each drafted prefix: one verification forward
        target_rows = torch.stack([target(drafted[:len(spec) + i]) for i in range(k + 1)])
        accepted, token = verify_greedy(target_rows, drafts)
        spec += drafts[:accepted].tolist() + [token]
        rounds += 1
    assert spec[:steps + 1] == plain
    assert steps / k < rounds < steps * 0.8  # the drafter helped, and was also rejected


# ---------------------------------------------------------------------------------------------
# Prefix survival
# ---------------------------------------------------------------------------------------------

def test_prefix_survival_is_the_cumulative_product():
    conditional = torch.tensor([[0.9, 0.8, 0.5, 1.0], [1.0, 0.0, 0.7, 0.7]])
    expected = torch.tensor([[0.9, 0.72, 0.36, 0.36], [1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(prefix_survival(conditional), expected)
    assert prefix_survival(conditional.unsqueeze(0)).shape == (1, 2, 4)
    for bad in (torch.tensor([0.5, 1.2]), torch.tensor([-0.1]), torch.tensor([float("nan")])):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            prefix_survival(bad)


# ---------------------------------------------------------------------------------------------
# Throughput profile
# ---------------------------------------------------------------------------------------------

def test_profile_interpolates_and_extrapolates_linearly():
    profile = ThroughputProfile(((1, 1.0), (5, 1.0), (9, 3.0)))
    assert profile(1) == 1.0 and profile(3) == 1.0 and profile(5) == 1.0
    assert profile(7) == pytest.approx(2.0)
    assert profile(9) == pytest.approx(3.0)
    assert profile(13) == pytest.approx(5.0)          # the last segment's slope, 0.5 s / token
    assert profile(0) == 1.0                           # below the first point: its time
    assert torch.allclose(profile.seconds(torch.tensor([3, 7, 13])), torch.tensor([1.0, 2.0, 5.0], dtype=F64))
    assert ThroughputProfile(((4, 2.0),))(100) == 2.0  # one point: a constant


@pytest.mark.parametrize("points, match", [
    ((), "at least one"),
    (((1, 1.0), (1, 2.0)), r"points\[1\] = \(1, 2.0\): tokens must increase"),
    (((1, 1.0), (4, 2.0), (2, 3.0)), r"points\[2\] = \(2, 3.0\): tokens must increase"),
    (((1, 1.0), (4, 0.5)), r"points\[1\] = \(4, 0.5\): seconds must not decrease"),
    (((0, 1.0),), r"points\[0\] = \(0, 1.0\): tokens must be >= 1"),
    (((1, 0.0),), r"points\[0\] = \(1, 0.0\)"),
    (((1, float("nan")),), r"points\[0\]"),
])
def test_profile_refuses_bad_points(points, match):
    with pytest.raises(ValueError, match=match):
        ThroughputProfile(points)


def test_profile_json_round_trip_is_plain_json(tmp_path):
    profile = ThroughputProfile(((1, 0.010), (8, 0.011), (64, 0.030)))
    path = tmp_path / "profile.json"
    profile.to_json(path)
    assert json.loads(path.read_text()) == {"points": [[1, 0.010], [8, 0.011], [64, 0.030]]}
    assert ThroughputProfile.from_json(path) == profile


@pytest.mark.parametrize("text, match", [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    ('{"points": 3}', "expected"),
    ('{"points": [[1, 1.0], [2]]}', "expected"),
    ('{"points": [[1, 1.0], [2, 0.5]]}', r"points\[1\]"),
])
def test_profile_from_json_errors_name_the_file(tmp_path, text, match):
    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match) as error:
        ThroughputProfile.from_json(path)
    assert str(path) in str(error.value)


def test_profile_measure_interleaves_takes_minima_and_is_monotone():
    calls = []

    def forward(n_tokens):
        calls.append(n_tokens)
        # a small forward that is slower than a larger one: noise the running maximum removes
        time.sleep(0.004 if n_tokens == 1 else 0.001 * n_tokens / 2)

    profile = ThroughputProfile.measure(forward, [4, 1, 2], repeats=2, warmup=1)
    assert calls == [1, 2, 4] * 3                     # warm-up, then each repeat sweeps every count
    assert [tokens for tokens, _ in profile.points] == [1, 2, 4]
    seconds = [s for _, s in profile.points]
    assert seconds[0] >= 0.004 and seconds[1] == seconds[0] and seconds[2] >= seconds[1]
    with pytest.raises(ValueError, match="repeats"):
        ThroughputProfile.measure(forward, [1], repeats=0)


# ---------------------------------------------------------------------------------------------
# Verification-length scheduler
# ---------------------------------------------------------------------------------------------

def throughput(lengths, survival, profile, draft_seconds):
    """The objective of report §2.4.3, written out: expected tokens / seconds of the round."""
    expected = sum(1 + float(survival[r, :k].sum()) for r, k in enumerate(lengths))
    return expected / (profile(sum(k + 1 for k in lengths)) + draft_seconds)


def test_scheduler_is_optimal_against_brute_force():
    generator = torch.Generator().manual_seed(21)
    for case in range(150):
        batch = int(torch.randint(1, 4, (1,), generator=generator))
        k = int(torch.randint(1, 5, (1,), generator=generator))
        if case % 2:  # coarse values: many exact ties in and across rows
            conditional = torch.randint(0, 3, (batch, k), generator=generator).double() / 2
        else:
            conditional = torch.rand(batch, k, generator=generator, dtype=F64)
        survival = prefix_survival(conditional)
        tokens = torch.randint(1, 5, (4,), generator=generator).cumsum(0)
        seconds = (torch.rand(4, generator=generator, dtype=F64) * 0.5).cumsum(0) + 0.05
        profile = ThroughputProfile(tuple(zip(tokens.tolist(), seconds.tolist())))
        draft_seconds = float(torch.rand(1, generator=generator)) * 0.2
        max_len = None if case % 3 else int(torch.randint(0, k + 1, (1,), generator=generator))
        cap = k if max_len is None else max_len
        chosen = choose_verification_lengths(survival, profile, draft_seconds, max_len)
        assert len(chosen) == batch and all(0 <= c <= cap for c in chosen)
        best = max(throughput(lengths, survival, profile, draft_seconds)
                   for lengths in itertools.product(range(cap + 1), repeat=batch))
        assert throughput(chosen, survival, profile, draft_seconds) == pytest.approx(best, rel=1e-12), case


def test_scheduler_hand_example_spends_tokens_on_the_confident_request():
    # seconds = 1 + 0.1 * tokens; m = 0: 2/1.2, m = 1: 2.9/1.3, m = 2: 3.4/1.4 (best), m = 3: 3.6/1.5
    profile = ThroughputProfile(((1, 1.1), (100, 11.0)))
    survival = torch.tensor([[0.9, 0.5], [0.2, 0.1]])
    assert choose_verification_lengths(survival, profile) == [2, 0]


def test_scheduler_flat_profile_verifies_everything():
    survival = prefix_survival(torch.full((6, 5), 0.3))
    flat = ThroughputProfile(((1, 0.02), (1000, 0.02)))
    assert choose_verification_lengths(survival, flat) == [5] * 6
    assert choose_verification_lengths(survival, flat, max_len=2) == [2] * 6
    assert choose_verification_lengths(survival, flat, max_len=0) == [0] * 6


def test_scheduler_steep_cost_verifies_nothing():
    survival = prefix_survival(torch.full((3, 5), 0.95))
    steep = ThroughputProfile(((1, 1.0), (2, 100.0)))
    assert choose_verification_lengths(survival, steep) == [0, 0, 0]


def test_scheduler_shortens_drafts_under_load():
    """Flat while the device is latency-bound, then linear: one request verifies all of its
    drafts; 32 requests already saturate it and verify none."""
    profile = ThroughputProfile(((1, 1.0), (16, 1.0), (24, 2.0)))
    conditional = torch.full((1, 4), 0.8)
    assert choose_verification_lengths(prefix_survival(conditional), profile) == [4]
    assert choose_verification_lengths(prefix_survival(conditional.expand(32, 4)), profile) == [0] * 32


def test_scheduler_refuses_bad_inputs():
    profile = ThroughputProfile(((1, 1.0),))
    assert choose_verification_lengths(torch.zeros(0, 4), profile) == []
    with pytest.raises(ValueError, match="non-increasing"):
        choose_verification_lengths(torch.tensor([[0.5, 0.6]]), profile)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        choose_verification_lengths(torch.tensor([0.5]), profile)
    with pytest.raises(ValueError, match="max_len"):
        choose_verification_lengths(torch.tensor([[0.5]]), profile, max_len=-1)


def test_row_wise_sampling_distribution_equals_the_per_row_one():
    """The batched processed distribution used by speculative drafting / verification is the
    sampler's own, row for row (temperature, top-k, top-p, greedy)."""
    from megatron_s2.inference.sampling import SamplingParams, sampling_log_probs, sampling_log_probs_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=1.3, top_k=7), SamplingParams(temperature=1.0, top_p=0.8),
                   SamplingParams(temperature=0.5, top_k=10, top_p=0.6)):
        rows = sampling_log_probs_rows(logits, params)
        for i in range(logits.size(0)):
            torch.testing.assert_close(rows[i], sampling_log_probs(logits[i], params), rtol=0, atol=0)
