"""The Memory Decoder's mathematics (Intern-S2 walkthrough Ch. 2, Eq. 1-4): the walkthrough's worked
examples 4 and 5 exactly, the retrieval distribution against a float64 brute force, exact datastore
search, Eq. (2)'s two terms, and the router's loss gradients."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_s2.models.memory_decoder import (Datastore, MemoryRouter, interpolate, interpolated_log_probs,
                                               knn_distribution, memory_decoder_loss, router_loss)
from megatron_s2.models.memory_decoder.knn import DatastoreError

# Worked example 5's four-token vocabulary. The walkthrough names "promoter" and "enhancer"; the
# other two columns are recovered from its fused columns (below) and named here for readability.
PROMOTER, ENHANCER, SILENCER, OTHER = range(4)
P_BACKBONE = torch.tensor([0.35, 0.30, 0.25, 0.10], dtype=torch.float64)
P_MEMORY = torch.tensor([0.20, 0.70, 0.05, 0.05], dtype=torch.float64)


def test_worked_example_4_retrieval_vote():
    """Eq. (1) at tau = 1 with five neighbours: "enhancer" collects exp(-0.2) + exp(-0.5) + exp(-2.3)
    = 0.8187 + 0.6065 + 0.1003 = 1.5255, "promoter" exp(-0.7) = 0.4966, "silencer" exp(-1.6) =
    0.2019; total 2.2240. The distances are the ones whose exp(-d) the walkthrough prints.

    Normalised: 0.68593, 0.22328, 0.09078. The walkthrough prints 0.6860 / 0.2233 / 0.0908 ("sums to
    1.0001, which is rounding"); the exact first value rounds to 0.6859 — its 0.6860 is itself a
    rounding slip, so the check is to 1e-4."""
    distances = torch.tensor([0.2, 0.5, 0.7, 1.6, 2.3], dtype=torch.float64)
    tokens = torch.tensor([ENHANCER, ENHANCER, PROMOTER, SILENCER, ENHANCER])
    weights = torch.exp(-distances)
    assert [round(float(w), 4) for w in weights] == [0.8187, 0.6065, 0.4966, 0.2019, 0.1003]
    p = knn_distribution(distances, tokens, vocab_size=4, temperature=1.0)
    assert float(weights[tokens == ENHANCER].sum()) == pytest.approx(1.5255, abs=1e-4)
    assert float(weights.sum()) == pytest.approx(2.2240, abs=1e-4)
    assert p[ENHANCER].item() == pytest.approx(0.6860, abs=1e-4)
    assert p[PROMOTER].item() == pytest.approx(0.2233, abs=1e-4)
    assert p[SILENCER].item() == pytest.approx(0.0908, abs=1e-4)
    assert p[OTHER].item() == 0.0  # no neighbour voted for it
    assert p.sum().item() == pytest.approx(1.0, abs=1e-12)
    # a larger temperature flattens the vote, a smaller one sharpens it towards the nearest neighbour
    assert knn_distribution(distances, tokens, 4, 10.0)[ENHANCER] < p[ENHANCER]
    assert knn_distribution(distances, tokens, 4, 0.05)[ENHANCER] > 0.99


def test_worked_example_5_fused_columns():
    """Eq. (3) on the four-token table: at lambda = 0.3 the fused column is 0.420 + 0.305 + 0.190 +
    0.085 = 1.000, at lambda = 0.7 it is 0.580 + 0.245 + 0.110 + 0.065 = 1.000 (walkthrough).

    The backbone and memory columns are recovered from those: enhancer 0.7*0.30 + 0.3*0.70 = 0.420;
    promoter 0.7*0.35 + 0.3*0.20 = 0.305; the third token solves 0.7a + 0.3b = 0.190, 0.3a + 0.7b =
    0.110 -> a = 0.25, b = 0.05; the fourth is the remainder, 0.10 and 0.05."""
    fused_03 = interpolate(P_BACKBONE, P_MEMORY, 0.3)
    fused_07 = interpolate(P_BACKBONE, P_MEMORY, 0.7)
    torch.testing.assert_close(fused_03[[ENHANCER, PROMOTER, SILENCER, OTHER]],
                               torch.tensor([0.420, 0.305, 0.190, 0.085], dtype=torch.float64))
    torch.testing.assert_close(fused_07[[ENHANCER, PROMOTER, SILENCER, OTHER]],
                               torch.tensor([0.580, 0.245, 0.110, 0.065], dtype=torch.float64))
    for lam in (0.0, 0.3, 0.7, 1.0):  # a convex combination of distributions is a distribution
        assert interpolate(P_BACKBONE, P_MEMORY, lam).sum().item() == pytest.approx(1.0, abs=1e-12)
    assert int(fused_03.argmax()) == ENHANCER and int(fused_07.argmax()) == ENHANCER


def test_worked_example_5_crossover_at_one_eleventh():
    """The backbone prefers "promoter" (0.35 > 0.30), the memory "enhancer" (0.70 > 0.20). Fused:

        p(enhancer) = (1 - l) 0.30 + l 0.70 = 0.30 + 0.40 l
        p(promoter) = (1 - l) 0.35 + l 0.20 = 0.35 - 0.15 l

    equal when 0.55 l = 0.05, i.e. l* = 1/11 = 0.0909 ("9.1%"). Below l* the fused argmax is the
    backbone's "promoter", above it the memory's "enhancer" (the third token, 0.25 - 0.20 l, never
    leads)."""
    crossover = 1.0 / 11.0
    assert round(crossover, 3) == 0.091
    at = interpolate(P_BACKBONE, P_MEMORY, crossover)
    assert at[ENHANCER].item() == pytest.approx(at[PROMOTER].item(), abs=1e-15)
    assert at[ENHANCER].item() == pytest.approx(0.30 + 0.40 / 11, abs=1e-15)
    assert int(interpolate(P_BACKBONE, P_MEMORY, crossover - 1e-6).argmax()) == PROMOTER
    assert int(interpolate(P_BACKBONE, P_MEMORY, crossover + 1e-6).argmax()) == ENHANCER
    # the log-space fusion the router trains through gives the same distribution
    lam = torch.tensor(crossover, dtype=torch.float64)
    torch.testing.assert_close(interpolated_log_probs(P_BACKBONE.log(), P_MEMORY.log(), lam).exp(), at)


def _brute_force_knn(queries, keys, values, k, vocab, tau):
    """Eq. (1) written out in float64 loops: full distance matrix, sort, vote, normalise."""
    out = torch.zeros(queries.size(0), vocab, dtype=torch.float64)
    for m in range(queries.size(0)):
        d = ((keys.double() - queries[m].double()) ** 2).sum(-1)
        order = torch.argsort(d)[:k]
        votes = torch.zeros(vocab, dtype=torch.float64)
        for j in order.tolist():
            votes[values[j]] += math.exp(-float(d[j]) / tau)
        out[m] = votes / votes.sum()
    return out


@pytest.mark.parametrize("chunk", [7, 64, 65536])
def test_datastore_search_is_exact_and_matches_brute_force(chunk):
    """Exact search whatever the chunking (the running top-k merge), and Eq. (1) on it equals the
    float64 brute force; FAISS is not needed (not installed here)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(200, 16, generator=g)
    values = torch.randint(0, 11, (200,), generator=g)
    queries = torch.randn(9, 16, generator=g)
    store = Datastore(keys, values)
    d, v = store.search(queries, k=8, chunk=chunk)
    full = torch.cdist(queries.double(), keys.double()) ** 2
    ref_d, ref_i = full.topk(8, dim=1, largest=False)
    torch.testing.assert_close(d.double(), ref_d, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, values[ref_i])
    assert torch.all(d[:, 1:] >= d[:, :-1])
    for tau in (0.5, 4.0):
        got = store.distribution(queries, k=8, vocab_size=11, temperature=tau).double().exp()
        torch.testing.assert_close(got, _brute_force_knn(queries, keys, values, 8, 11, tau), rtol=1e-5, atol=1e-6)


def test_a_key_is_its_own_nearest_neighbour_and_batched_queries_keep_their_shape():
    g = torch.Generator().manual_seed(1)
    store = Datastore(torch.randn(50, 8, generator=g), torch.randint(0, 5, (50,), generator=g))
    d, v = store.search(store.keys[:6].reshape(2, 3, 8), k=4)
    assert d.shape == (2, 3, 4) and v.shape == (2, 3, 4)
    assert torch.all(d[..., 0] < 1e-6)
    assert torch.equal(v[..., 0].flatten(), store.values[:6])
    with pytest.raises(ValueError, match="k must be in"):
        store.search(store.keys[:1], k=51)


def test_datastore_roundtrip_is_safetensors_and_refuses_a_stale_cache(tmp_path):
    store = Datastore(torch.randn(10, 4), torch.arange(10), meta={"backbone": "ckpt/step-5", "seed": 3})
    path = tmp_path / "datastore.safetensors"
    store.save(path)
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    back = Datastore.load(path, expect_meta={"backbone": "ckpt/step-5", "seed": 3})
    assert torch.equal(back.keys, store.keys) and torch.equal(back.values, store.values)
    with pytest.raises(DatastoreError, match="delete it to rebuild"):
        Datastore.load(path, expect_meta={"backbone": "ckpt/step-9", "seed": 3})
    (tmp_path / "junk.safetensors").write_bytes(b"not a datastore")
    with pytest.raises(DatastoreError, match="not a readable"):
        Datastore.load(tmp_path / "junk.safetensors")
    with pytest.raises(DatastoreError, match="empty"):
        Datastore(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))


def test_memory_decoder_loss_is_eq2():
    """beta = 1 is pure KL(p_kNN || p_mem) (zero when the memory matches the retrieval), beta = 0 pure
    cross-entropy on the gold token; in between the convex mix; masked positions do not count."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    knn = knn_distribution(torch.rand(2, 3, 4, generator=g, dtype=torch.float64),
                           torch.randint(0, 6, (2, 3, 4), generator=g), 6, 1.0)
    labels = torch.randint(0, 6, (2, 3), generator=g)
    log_q = torch.log_softmax(logits, -1)
    kl_ref = torch.where(knn > 0, knn * (knn.log() - log_q), torch.zeros_like(knn)).sum(-1)
    ce_ref = -log_q.gather(-1, labels[..., None])[..., 0]
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    for beta in (0.0, 0.3, 1.0):
        loss, metrics = memory_decoder_loss(logits, knn.log(), labels, mask, beta=beta)
        ref = ((beta * kl_ref + (1 - beta) * ce_ref) * mask).sum() / mask.sum()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(((kl_ref * mask).sum() / 4).item(), rel=1e-5)
    matched, _ = memory_decoder_loss(knn.clamp_min(1e-30).log(), knn.log(), labels, beta=1.0)
    assert matched.item() == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="beta"):
        memory_decoder_loss(logits, knn.log(), labels, beta=1.5)


def test_router_reads_hidden_states_and_uncertainty_and_eq4_prior_has_the_sign_of_the_corpus():
    """lambda starts at init_lambda whatever the features; d L / d lambda of the prior is -alpha on
    domain tokens and +alpha on general tokens (constant), added to the cross-entropy's."""
    router = MemoryRouter(base_hidden=5, mem_hidden=3, init_lambda=0.2, hidden=6)
    assert router.in_features == 5 + 3 + 4
    h_b, h_m = torch.randn(4, 5), torch.randn(4, 3)
    logp_b, logp_m = torch.log_softmax(torch.randn(4, 7), -1), torch.log_softmax(torch.randn(4, 7), -1)
    lam = router(h_b, h_m, logp_b, logp_m)
    torch.testing.assert_close(lam, torch.full((4,), 0.2))
    is_domain = torch.tensor([True, True, False, False])
    labels = torch.tensor([1, 2, 3, 4])
    lam_leaf = lam.detach().requires_grad_(True)
    fused = interpolated_log_probs(logp_b, logp_m, lam_leaf)
    alpha = 0.5
    loss, metrics = router_loss(fused, labels, lam_leaf, is_domain, alpha)
    loss.backward()
    ce_grad = (-(logp_m.exp() - logp_b.exp()).gather(-1, labels[:, None])[:, 0]
               / fused.exp().gather(-1, labels[:, None])[:, 0])
    expected = (ce_grad + alpha * torch.tensor([-1.0, -1.0, 1.0, 1.0])) / 4
    torch.testing.assert_close(lam_leaf.grad, expected, rtol=1e-5, atol=1e-6)
    assert metrics["lambda_domain"].item() == pytest.approx(0.2)
    # the router's weights see the features: once its output layer is non-zero (after a first
    # update), a gradient reaches every input column
    with torch.no_grad():
        router.out.weight.fill_(0.1)
    lam2 = router(h_b, h_m, logp_b, logp_m)
    loss2, _ = router_loss(interpolated_log_probs(logp_b, logp_m, lam2), labels, lam2, is_domain, alpha)
    loss2.backward()
    assert torch.all(router.inp.weight.grad.abs().sum(0) > 0)


def test_a_saturated_router_keeps_finite_gradients():
    """sigmoid saturates to exactly 1.0 (or 0.0) in float32; the log-space fusion must not turn that
    into log(0) and a NaN gradient."""
    lam = torch.tensor([1.0, 0.0], requires_grad=True)
    logp = torch.log_softmax(torch.randn(2, 5), -1)
    fused = interpolated_log_probs(logp, logp.flip(-1), lam)
    fused[:, 0].sum().backward()
    assert torch.isfinite(fused).all() and torch.isfinite(lam.grad).all()
