"""The whole tiny backbone on one process (report §2.1–§2.4): single-pass mHC wiring against a
hand-written Eq. 3–5 with the coefficient shift (Eq. 6), forward/backward of the full model
(which parameters learn from which loss), routing replay at model level, shared-state
lifetime and pipeline cuts.

MoE, the mHC predictor and Engram are tested on their own in test_moe.py, test_mhc.py and
test_engram.py; here they are only parts of the model.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay


def _ids(cfg, b=2, s=32, seed=0):
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


# ---- mHC at model level (§2.4.1) ---------------------------------------------------------------------
def _coefficients(hc, x):
    """Eq. 4 written out: one RMS over the n*d stream values applied after the projection, then
    A = sigmoid(.) + eps, C = 2 sigmoid(.), B = Sinkhorn-Knopp(softmax(.))."""
    n, eps = hc.n, hc.eps
    flat = x.flatten(-2)
    mixes = (flat @ hc.fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc.norm_eps)
    a = torch.sigmoid(mixes[..., :n] * hc.scale[0] + hc.base[:n]) + eps
    c = 2 * torch.sigmoid(mixes[..., n:2 * n] * hc.scale[1] + hc.base[n:2 * n])
    m = torch.softmax((mixes[..., 2 * n:] * hc.scale[2] + hc.base[2 * n:]).unflatten(-1, (n, n)), -1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(hc.iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return a, m, c


def hand_mhc_forward(model, ids, ctx, single_pass: bool):
    """Streams after every block and the logits, by Eq. 3–5 (Eq. 6 when ``single_pass``)."""
    cfg = model.config
    x = model.embedding["word_embeddings"](ids).unsqueeze(-2).repeat(1, 1, cfg.hc_mult, 1)
    prev_a = torch.zeros(x.shape[:-1])
    prev_a[..., 0] = 1.0  # the first sublayer reads stream 0 (there is no previous A)
    streams = {}
    for i in model.layer_ids:
        block = model.layers[str(i)]
        if block.engram is not None:
            x = block.engram(x, ctx)
        for hc, norm, sublayer in ((block.attn_hc, block.attn_norm, block.attention),
                                   (block.mlp_hc, block.mlp_norm, block.mlp)):
            a, b, c = _coefficients(hc, x)                                  # Eq. 4
            mix = prev_a if single_pass else a                              # Eq. 6 vs Eq. 5
            y = sublayer(norm(torch.einsum("bsn,bsnd->bsd", mix, x)), ctx)  # Eq. 5, F
            x = torch.einsum("bsij,bsid->bsjd", b, x) + c.unsqueeze(-1) * y.unsqueeze(-2)  # Eq. 3
            prev_a = a
        streams[i] = x
    # the model's output collapse uses the last sublayer's A in both modes (no HyperHead)
    logits = model.output_layer(model.final_norm(torch.einsum("bsn,bsnd->bsd", prev_a, x)))
    return streams, logits


def model_streams(model, ids, ctx):
    out = {}
    for i, block in model.layers.items():
        block.register_forward_hook(lambda mod, args, res, i=int(i): out.__setitem__(i, res[0]))
    logits = model(ids, ctx)
    return out, logits


@pytest.mark.parametrize("single_pass", [True, False], ids=["single-pass", "classic"])
def test_mhc_block_outputs_match_equations_3_to_6(tiny_cfg, make_model, make_ctx, single_pass):
    cfg = tiny_cfg.replace(mhc_single_pass=single_pass, init_std=0.1)
    model = make_model(cfg, seed=11).eval()
    ids = _ids(cfg)
    with torch.no_grad():
        got, logits = model_streams(model, ids, make_ctx(cfg, ids))
        want, want_logits = hand_mhc_forward(model, ids, make_ctx(cfg, ids), single_pass)
    for i in model.layer_ids:
        torch.testing.assert_close(got[i], want[i], atol=1e-5, rtol=1e-5, msg=f"block {i}")
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


def test_mhc_shift_matters(tiny_cfg, make_model, make_ctx):
    """Same weights (initialisation is by parameter name), single-pass vs A_l: different model,
    and the hand-written single-pass formula does not match the classic model."""
    cfg = tiny_cfg.replace(init_std=0.1)
    single = make_model(cfg, seed=11).eval()
    classic = make_model(cfg.replace(mhc_single_pass=False), seed=11).eval()
    for (a, pa), (b, pb) in zip(single.named_parameters(), classic.named_parameters()):
        assert a == b and torch.equal(pa, pb)
    ids = _ids(cfg)
    with torch.no_grad():
        s_logits = single(ids, make_ctx(cfg, ids))
        c_logits = classic(ids, make_ctx(cfg, ids))
        _, hand_single = hand_mhc_forward(classic, ids, make_ctx(cfg, ids), single_pass=True)
    assert (s_logits - c_logits).abs().max() > 1e-3
    torch.testing.assert_close(hand_single, s_logits, atol=1e-5, rtol=1e-5)


# ---- full model forward / backward --------------------------------------------------------------------
INDEXER_ONLY = ("attention.indexer.", "attention.index_key.")


def _backward(cfg, make_model, make_ctx, which: str):
    model = make_model(cfg, seed=12).train()
    ids = _ids(cfg, s=48, seed=1)
    labels = torch.roll(ids, -1, dims=1)
    ctx = make_ctx(cfg, ids)
    loss = model(ids, ctx, labels=labels)
    assert loss.shape == ids.shape and torch.isfinite(loss).all()
    assert set(ctx.aux_losses) == {"moe_seq_balance", "indexer_kl"}
    assert all(torch.isfinite(v) and v > 0 for v in ctx.aux_losses.values())
    total = {"lm": loss.mean(), "aux": ctx.aux_losses["indexer_kl"],
             "all": loss.mean() + ctx.total_aux_loss()}[which]
    total.backward()
    return model


def test_every_parameter_learns(tiny_cfg, make_model, make_ctx):
    model = _backward(tiny_cfg, make_model, make_ctx, "all")
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_lm_loss_does_not_reach_the_indexer(tiny_cfg, make_model, make_ctx):
    """Top-k selection is not differentiable and the indexer reads detached inputs (indexer.py):
    the LM loss trains everything but the indexers and index-key projections ..."""
    model = _backward(tiny_cfg, make_model, make_ctx, "lm")
    no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert no_grad and all(any(tag in n for tag in INDEXER_ONLY) for n in no_grad)
    indexer_params = sorted(n for n, _ in model.named_parameters() if any(t in n for t in INDEXER_ONLY))
    assert no_grad == indexer_params


def test_indexer_alignment_loss_trains_only_the_indexer(tiny_cfg, make_model, make_ctx):
    """... and the indexer's KL alignment loss trains exactly those."""
    model = _backward(tiny_cfg, make_model, make_ctx, "aux")
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0)
    indexer_params = sorted(n for n, _ in model.named_parameters() if any(t in n for t in INDEXER_ONLY))
    assert with_grad == indexer_params
    # indexer params of every Full/Reindex layer, index-key projections only on Full layers
    layers = {int(n.split(".")[1]) for n in with_grad}
    assert layers == {s.index for s in tiny_cfg.plan if s.runs_indexer}


def test_training_step_on_a_sequence_shorter_than_the_compression_ratio(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=12).train()
    ids = _ids(tiny_cfg, s=1)
    ctx = make_ctx(tiny_cfg, ids)
    loss = model(ids, ctx, labels=ids)
    (loss.mean() + ctx.total_aux_loss()).backward()
    assert torch.isfinite(loss).all()


def test_eval_mode_adds_no_indexer_loss(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=12).eval()
    ids = _ids(tiny_cfg)
    ctx = make_ctx(tiny_cfg, ids)
    with torch.no_grad():
        model(ids, ctx)
    assert ctx.aux_losses == {}


# ---- routing replay (§5.2.1) ---------------------------------------------------------------------------
def test_replayed_routing_reproduces_the_model_bit_for_bit(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=13).train()
    ids = _ids(tiny_cfg, seed=2)
    labels = torch.roll(ids, -1, dims=1)
    record = RoutingReplay(RoutingMode.RECORD)
    with torch.no_grad():
        recorded = model(ids, make_ctx(tiny_cfg, ids, routing=record), labels=labels)
    assert sorted(record.records()) == model.layer_ids
    # move the correction biases: fresh routing now differs, replay must not
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.layers.values():
            block.mlp.router.expert_bias.copy_(torch.randn(tiny_cfg.num_routed_experts, generator=g) * 10)
        fresh_record = RoutingReplay(RoutingMode.RECORD)
        fresh = model(ids, make_ctx(tiny_cfg, ids, routing=fresh_record), labels=labels)
        replayed = model(ids, make_ctx(tiny_cfg, ids, routing=record.replayer()), labels=labels)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(record.records().values(), fresh_record.records().values()))
    assert not torch.equal(fresh, recorded)
    assert torch.equal(replayed, recorded)


# ---- shared states -------------------------------------------------------------------------------------
def test_shared_states_are_released_after_their_last_consumer(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=14).eval()
    ids = _ids(tiny_cfg)
    ctx = make_ctx(tiny_cfg, ids)
    with torch.no_grad():
        model(ids, ctx)
    assert ctx.shared.held() == [] and ctx.shared.peak_bytes > 0


@pytest.mark.parametrize("cut", [2, 3, 4, 6, 7])
def test_a_pipeline_cut_needs_exactly_the_crossing_states(tiny_cfg, make_model, make_ctx, cut):
    """Two "stages" of one model with separate registries, joined by the states
    ``plan.crossing(cut)`` names, give the single-stage logits."""
    model = make_model(tiny_cfg, seed=15).eval()
    ids = _ids(tiny_cfg)
    with torch.no_grad():
        whole = model(ids, make_ctx(tiny_cfg, ids))
        first = make_ctx(tiny_cfg, ids)
        x, pre = model.run_layers(model.embed(ids), first, range(cut))
        payload = first.shared.export(tiny_cfg.plan.crossing(cut))
        second = make_ctx(tiny_cfg, ids)
        second.shared.import_states(payload, below=cut)
        x, pre = model.run_layers((x, pre), second, range(cut, tiny_cfg.num_layers))
        split = model.head(x, pre)
    assert first.shared.held() == sorted(payload, key=lambda k: (k[0], k[1].value))
    assert second.shared.held() == []
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=0)
