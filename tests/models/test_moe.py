"""MoE block, single process (report §2.1.1, §4.2.1, §4.2.2, §5.2.1).

Router semantics against a hand-written loop that follows the public reference ``Gate`` /
``Expert`` / ``MoE``; modality biases and their update rule; the sequence balance loss on a
hand-computed case; SwiGLU clamping; record/replay; gradcheck of dispatch + experts + combine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.moe import (
    AllToAllTokenDispatcher,
    GroupedExperts,
    MoELayer,
    RoutingMode,
    RoutingReplay,
    expert_bias_update,
    sequence_balance_loss,
    swiglu,
    update_expert_biases,
)
from megatron_s2.parallel.token_dispatch import regroup_permutation
from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.parallel.placement import Replicas, placement_of

HIDDEN, EXPERTS, TOPK, FFN = 16, 8, 2, 8


def tiny_config(**overrides) -> V41Config:
    fields = dict(name="moe-test", hidden_size=HIDDEN, layer_groups=(LayerGroupSpec(modes=("swa",)),),
                  num_encoder_layers=1, engram_layers=(), num_routed_experts=EXPERTS, moe_topk=TOPK,
                  moe_ffn_hidden_size=FFN, init_std=0.3, moe_seq_aux_loss_coeff=0.01)
    fields.update(overrides)
    return V41Config(**fields)


def make_layer(seed: int = 0, **overrides) -> MoELayer:
    cfg = tiny_config(**overrides)
    layer = MoELayer(cfg, layer_number=3, groups=ParallelGroups.single())
    initialize_parameters(layer, seed, cfg.init_std)
    return layer


def make_ctx(layer: MoELayer, b: int, s: int, image_mask=None, routing=None) -> ForwardContext:
    return ForwardContext.create(torch.zeros(b, s, dtype=torch.long), layer.config.plan,
                                 image_mask=image_mask, routing=routing)


def reference_moe(layer: MoELayer, x: torch.Tensor, image_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-expert loop with the reference semantics (bias for selection only, weight
    before W2, shared expert added)."""
    cfg, r = layer.config, layer.router
    flat = x.reshape(-1, x.size(-1))
    logits = flat.float() @ r.weight.float().t()
    scores = {"softmax": lambda z: z.softmax(-1), "sigmoid": torch.sigmoid,
              "sqrtsoftplus": lambda z: torch.log1p(torch.exp(z)).sqrt()}[cfg.moe_score_func](logits)
    bias = r.expert_bias.expand_as(scores)
    if image_mask is not None:
        bias = torch.where(image_mask.reshape(-1, 1), r.image_expert_bias, r.expert_bias)
    idx = (scores + bias).topk(cfg.moe_topk, dim=-1).indices
    w = scores.gather(1, idx)
    if cfg.moe_norm_topk_prob and cfg.moe_topk > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.moe_route_scale

    def expert(t, w1, w3, w2, weight=None):
        gate, up = F.linear(t, w1), F.linear(t, w3)
        if cfg.swiglu_limit > 0:
            gate, up = gate.clamp(max=cfg.swiglu_limit), up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        h = F.silu(gate) * up
        return F.linear(h if weight is None else h * weight, w2)

    y = torch.zeros_like(flat)
    for e in range(cfg.num_routed_experts):
        tok, slot = torch.where(idx == e)
        if tok.numel():
            ex = layer.experts
            y[tok] += expert(flat[tok], ex.w1[e], ex.w3[e], ex.w2[e], w[tok, slot, None])
    if layer.shared_expert is not None:
        se = layer.shared_expert
        y = y + expert(flat, se.w1, se.w3, se.w2)
    return y.view_as(x), idx.view(*x.shape[:2], -1)


# ---- router ------------------------------------------------------------------------------------
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("norm", [True, False])
def test_layer_matches_reference_loop(score_func, norm):
    layer = make_layer(moe_score_func=score_func, moe_norm_topk_prob=norm, moe_route_scale=1.5)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, EXPERTS))
        layer.router.image_expert_bias.copy_(torch.linspace(0.3, -0.3, EXPERTS))
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True, True, False, False, True, False]] * 2)
    ctx = make_ctx(layer, 2, 6, image_mask=mask, routing=RoutingReplay(RoutingMode.RECORD))
    out = layer(x, ctx)
    ref, ref_idx = reference_moe(layer, x, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ctx.routing.records()[3][0].long(), ref_idx)


def test_sqrtsoftplus_values():
    layer = make_layer(moe_score_func="sqrtsoftplus")
    z = torch.tensor([[-30.0, -1.0, 0.0, 2.0, 40.0, 1.0, 0.5, -0.5]])
    scores = layer.router.score_fn(z)
    torch.testing.assert_close(scores, torch.log1p(torch.exp(z.double())).sqrt().float())
    assert torch.isfinite(scores).all() and scores[0, 4] == pytest.approx(40.0 ** 0.5)


def test_bias_changes_selection_but_not_weights():
    layer = make_layer(moe_score_func="sigmoid")
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(2))
    plain = layer.router(x)
    with torch.no_grad():
        layer.router.expert_bias[5] = 10.0  # forces expert 5 into every selection
    biased = layer.router(x)
    assert (biased.indices == 5).any(dim=-1).all() and not (plain.indices == 5).any(dim=-1).all()
    torch.testing.assert_close(biased.scores, plain.scores)  # bias never enters the scores
    w = plain.scores.gather(1, biased.indices)
    torch.testing.assert_close(biased.probs, w / w.sum(-1, keepdim=True))
    same = (plain.indices.sort(-1).values == biased.indices.sort(-1).values).all(-1)
    for t in torch.where(same)[0]:  # unchanged selection -> identical combine weights
        order_p, order_b = plain.indices[t].argsort(), biased.indices[t].argsort()
        torch.testing.assert_close(plain.probs[t][order_p], biased.probs[t][order_b], rtol=0, atol=0)


def test_image_tokens_select_with_the_image_bias():
    layer = make_layer()
    with torch.no_grad():
        layer.router.image_expert_bias[0], layer.router.image_expert_bias[7] = 10.0, -10.0
        layer.router.expert_bias[7], layer.router.expert_bias[0] = 10.0, -10.0
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(3))
    image = torch.arange(10) % 2 == 0
    d = layer.router(x, image)
    assert (d.indices[image] == 0).any(-1).all() and not (d.indices[image] == 7).any()
    assert (d.indices[~image] == 7).any(-1).all() and not (d.indices[~image] == 0).any()


def test_single_bias_when_modality_biases_off():
    layer = make_layer(moe_modality_biases=False)
    assert not hasattr(layer.router, "image_expert_bias")
    with torch.no_grad():
        layer.router.expert_bias[2] = 10.0
    d = layer.router(torch.randn(6, HIDDEN), torch.ones(6, dtype=torch.bool))
    assert (d.indices == 2).any(-1).all()
    assert layer.router.tokens_per_expert.shape == (1, EXPERTS) and layer.router.tokens_per_expert.sum() == 6 * TOPK


# ---- aux-loss-free bias update ------------------------------------------------------------------
def test_update_rule_sign_and_empty_modality():
    bias = torch.zeros(2, 4)
    load = torch.tensor([[5, 1, 3, 3], [0, 0, 0, 0]])
    new = expert_bias_update(bias, load, 0.001)
    # overloaded expert goes down, underloaded up, at-mean unchanged; no image tokens -> unchanged
    torch.testing.assert_close(new, torch.tensor([[-0.001, 0.001, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_text_and_image_biases_update_independently():
    layer = make_layer()
    layer.train()
    x = torch.randn(1, 8, HIDDEN, generator=torch.Generator().manual_seed(4))
    layer(x, make_ctx(layer, 1, 8, image_mask=torch.ones(1, 8, dtype=torch.bool)))  # image tokens only
    counts = layer.router.tokens_per_expert.clone()
    assert counts[0].sum() == 0 and counts[1].sum() == 8 * TOPK
    loads = layer.router.update_expert_bias(0.01)
    assert torch.equal(loads, counts)
    assert torch.equal(layer.router.expert_bias, torch.zeros(EXPERTS))  # text bias untouched
    expected = 0.01 * torch.sign(counts[1].double().mean() - counts[1].double())
    torch.testing.assert_close(layer.router.image_expert_bias, expected.float())
    assert layer.router.tokens_per_expert.sum() == 0  # counters reset
    # a text-only step now moves only the text bias
    image_before = layer.router.image_expert_bias.clone()
    layer(x, make_ctx(layer, 1, 8))
    layer.router.update_expert_bias(0.01)
    assert torch.equal(layer.router.image_expert_bias, image_before)
    assert layer.router.expert_bias.abs().sum() > 0


def test_biases_are_buffers_in_state_dict_and_counters_only_in_training():
    layer = make_layer()
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"router.weight", "experts.w1", "experts.w2", "experts.w3",
                     "shared_expert.w1", "shared_expert.w2", "shared_expert.w3"}
    sd = layer.state_dict()
    assert "router.expert_bias" in sd and "router.image_expert_bias" in sd and "router.tokens_per_expert" not in sd
    assert all(placement_of(getattr(layer.experts, w)).replicas is Replicas.EXPERT_DATA for w in ("w1", "w2", "w3"))
    assert placement_of(layer.experts.w1).shard.full_shape == (EXPERTS, FFN, HIDDEN)
    layer.eval()
    ctx = make_ctx(layer, 1, 4)
    layer(torch.randn(1, 4, HIDDEN), ctx)
    assert layer.router.tokens_per_expert.sum() == 0 and not ctx.aux_losses


def test_update_expert_biases_batches_routers():
    a, b = make_layer(seed=1), make_layer(seed=2)
    x = torch.randn(1, 6, HIDDEN)
    for layer in (a, b):
        layer(x, make_ctx(layer, 1, 6))
    expected = torch.stack([a.router.tokens_per_expert, b.router.tokens_per_expert])
    loads = update_expert_biases([a.router, b.router], 0.5)
    assert torch.equal(loads, expected)
    assert a.router.expert_bias.abs().max() == 0.5 and b.router.expert_bias.abs().max() == 0.5


# ---- sequence balance loss ----------------------------------------------------------------------
def test_sequence_balance_loss_hand_computed():
    # Row 0: s' = [.4 .3 .2 .1], [.5 .1 .1 .3]; picks {0,1}, {0,3}: f = 4/(2*2) * [2,1,0,1],
    #        P = [.45 .2 .15 .2] -> sum f P = 0.9 + 0.2 + 0 + 0.2 = 1.3
    # Row 1: uniform scores, picks {0,1}, {2,3}: f = 1, P = .25 -> 1.0.   Mean 1.15.
    scores = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.1, 0.3]],
                           [[0.25] * 4, [0.25] * 4]]) * 3.0  # un-normalised on purpose
    indices = torch.tensor([[[0, 1], [0, 3]], [[0, 1], [2, 3]]])
    loss = sequence_balance_loss(scores, indices, 0.1)
    assert loss.item() == pytest.approx(0.1 * 1.15, rel=1e-6)


def test_layer_adds_sequence_balance_loss_in_training():
    layer = make_layer(moe_seq_aux_loss_coeff=0.5)
    x = torch.randn(2, 6, HIDDEN, requires_grad=True)
    rec = RoutingReplay(RoutingMode.RECORD)
    ctx = make_ctx(layer, 2, 6, routing=rec)
    layer(x, ctx)
    loss = ctx.aux_losses["moe_seq_balance"]
    # independent per-row evaluation of coeff * sum_i f_i P_i
    scores = layer.router.score_fn(x.detach().reshape(-1, HIDDEN) @ layer.router.weight.detach().t()).view(2, 6, -1)
    ids = rec.records()[3][0].long()
    rows = []
    for r in range(2):
        f = torch.stack([(ids[r] == i).sum() for i in range(EXPERTS)]).float() * EXPERTS / (TOPK * 6)
        p = (scores[r] / scores[r].sum(-1, keepdim=True)).mean(0)
        rows.append((f * p).sum())
    assert loss.item() == pytest.approx(0.5 * torch.stack(rows).mean().item(), rel=1e-5)
    loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert layer.experts.w1.grad is None  # the balance loss only reaches the router


# ---- experts ------------------------------------------------------------------------------------
def test_swiglu_clamp():
    gate = torch.tensor([20.0, -20.0, 1.0, 12.0])
    up = torch.tensor([20.0, -20.0, 0.5, -12.0])
    out = swiglu(gate, up, limit=10.0)
    expected = F.silu(torch.tensor([10.0, -20.0, 1.0, 10.0])) * torch.tensor([10.0, -10.0, 0.5, -10.0])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(swiglu(gate, up, limit=0.0), F.silu(gate) * up, rtol=0, atol=0)
    assert swiglu(gate.bfloat16(), up.bfloat16(), 10.0).dtype == torch.float32


def test_shared_expert_is_applied_to_every_token():
    with_shared, without = make_layer(seed=5), make_layer(seed=5, num_shared_experts=0)
    x = torch.randn(2, 4, HIDDEN)
    diff = with_shared(x, make_ctx(with_shared, 2, 4)) - without(x, make_ctx(without, 2, 4))
    torch.testing.assert_close(diff, with_shared.shared_expert(x), rtol=1e-5, atol=1e-6)
    assert diff.abs().amin(dim=-1).gt(0).all()


def test_regroup_permutation():
    counts = torch.tensor([[1, 2], [3, 0]])  # rows: a0b0 | a0b1 a0b1 | a1b0 a1b0 a1b0
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    assert regroup_permutation(counts).tolist() == [0, 3, 4, 5, 1, 2]  # b0: a0 a1 | b1: a0
    assert rows[regroup_permutation(counts)].tolist() == [0, 3, 4, 5, 1, 2]


def test_expert_path_gradcheck_float64():
    cfg = tiny_config(num_routed_experts=4, moe_topk=2, hidden_size=3, moe_ffn_hidden_size=2, swiglu_limit=0.6)
    experts = GroupedExperts(cfg, Group.single(), Group.single()).double()
    dispatcher = AllToAllTokenDispatcher(4, Group.single(), Group.single())
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    probs = torch.rand(5, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.tensor([[0, 1], [1, 2], [3, 1], [0, 3], [2, 0]])  # expert 3 twice, all experts used
    weights = {n: (torch.randn(p.shape, dtype=torch.float64, generator=gen)).requires_grad_()
               for n, p in experts.named_parameters()}

    def fn(tokens, probs, w1, w2, w3):
        d = dispatcher.dispatch(tokens, probs, indices)
        out = torch.func.functional_call(experts, {"w1": w1, "w2": w2, "w3": w3},
                                         (d.tokens, d.probs, d.tokens_per_expert))
        return dispatcher.combine(out, d.state)

    pre = torch.einsum("nd,efd->nef", tokens, weights["w1"]).detach()
    assert (pre > 0.6).any() and ((pre - 0.6).abs() > 1e-3).all()  # clamp active, away from the kink
    assert torch.autograd.gradcheck(fn, (tokens, probs, weights["w1"], weights["w2"], weights["w3"]))


# ---- routing record / replay -------------------------------------------------------------------
def test_record_then_replay_is_bit_identical_and_replay_keeps_indices():
    layer = make_layer(seed=8)
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(9))
    mask = torch.rand(2, 6, generator=torch.Generator().manual_seed(10)) > 0.5
    rec = RoutingReplay(RoutingMode.RECORD)
    out = layer(x, make_ctx(layer, 2, 6, mask, rec))
    recorded = rec.records()[3][0]
    assert recorded.shape == (2, 6, TOPK) and recorded.dtype == torch.int32
    assert torch.equal(layer(x, make_ctx(layer, 2, 6, mask, rec.replayer())), out)
    # change the scores: replay keeps the recorded ids; weights come from the new scores
    with torch.no_grad():
        layer.router.weight.mul_(-1.0)
    fresh = layer.router(x.view(-1, HIDDEN))
    assert not torch.equal(fresh.indices, recorded.view(-1, TOPK).long())
    replayed = layer.router(x.view(-1, HIDDEN), None, recorded.view(-1, TOPK))
    assert torch.equal(replayed.indices, recorded.view(-1, TOPK).long())
    w = fresh.scores.gather(1, replayed.indices)
    torch.testing.assert_close(replayed.probs, w / w.sum(-1, keepdim=True))
    with pytest.raises(KeyError, match="nothing to replay"):
        replay = rec.replayer()
        layer(x, make_ctx(layer, 2, 6, mask, replay))
        layer(x, make_ctx(layer, 2, 6, mask, replay))
    with pytest.raises(ValueError, match="expected ids of shape"):
        layer(x[:, :4], make_ctx(layer, 2, 4, mask[:, :4], rec.replayer()))


def test_record_mode_reuses_slot_after_rewind():
    layer = make_layer(seed=11)
    x = torch.randn(1, 5, HIDDEN)
    rec = RoutingReplay(RoutingMode.RECORD)
    ctx = make_ctx(layer, 1, 5, routing=rec)
    first = layer(x, ctx)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.arange(EXPERTS, dtype=torch.float32) * 5)  # would change routing
    rec.rewind(3)  # recomputation of layer 3
    assert torch.equal(layer(x, ctx), first)
    assert len(rec.records()[3]) == 1


def test_concatenated_routing_replay():
    """§5.2.1: routing of consecutive rollout segments, concatenated, replays the whole sample."""
    layer = make_layer(seed=12)
    x = torch.randn(2, 8, HIDDEN)
    segments = []
    for part in (x[:, :3], x[:, 3:]):
        rec = RoutingReplay(RoutingMode.RECORD)
        layer(part, make_ctx(layer, 2, part.size(1), routing=rec))
        segments.append(rec)
    joined = RoutingReplay.concatenate(segments)
    whole = RoutingReplay(RoutingMode.RECORD)
    out = layer(x, make_ctx(layer, 2, 8, routing=whole))
    assert torch.equal(joined.records()[3][0], whole.records()[3][0])
    assert torch.equal(layer(x, make_ctx(layer, 2, 8, routing=joined)), out)


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_empty_micro_batch(shape):
    layer = make_layer(seed=13)
    x = torch.randn(*shape, HIDDEN, requires_grad=True)
    ctx = make_ctx(layer, *shape)
    out = layer(x, ctx)
    (out.sum() + ctx.total_aux_loss()).backward()
    assert out.shape == (*shape, HIDDEN) and ctx.aux_losses["moe_seq_balance"].item() == 0.0
    assert layer.experts.w1.grad is not None and layer.experts.w1.grad.abs().sum() == 0
