"""Concatenated routing replay (report §5.2.1) through the real tiny model's MoE.

A sample is generated in two segments under two policy versions (the router weights change
between them, as an optimiser step would change them). Generation here is a reference
sampler — a full forward per step that records the routing of the newly fed position — since
the KV-cached engine lands with the inference issue; the record format, concatenation,
micro-batch assembly and replay are the production code paths.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.v41.moe import RoutingMode, RoutingReplay
from megatron_s2.posttrain.batch import collate
from megatron_s2.posttrain.multiturn import SessionBuilder
from megatron_s2.posttrain.routing import RoutingRecord
from tests.posttrain.tiny import tiny_config

PROMPT = [5, 17, 99, 3, 64]


def forward(model, ids: torch.Tensor, routing=None) -> torch.Tensor:
    return model(ids, ForwardContext.create(ids, model.plan, routing=routing))


@torch.no_grad()
def generate(model, tokens: list[int], records: list[RoutingRecord], n_new: int, version: int,
             gen: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample n_new tokens; route each newly fed position (prefill: the whole prompt)."""
    new, logprobs = [], []
    for _ in range(n_new):
        ids = torch.tensor([tokens])
        rec = RoutingReplay(RoutingMode.RECORD)
        logits = forward(model, ids, rec)
        start = records[-1].end if records else 0
        records.append(RoutingRecord.from_replay(rec, positions=slice(start, len(tokens)), start=start,
                                                 version=version))
        logp = torch.log_softmax(logits[0, -1].double(), -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
        tokens.append(tok)
        new.append(tok)
        logprobs.append(float(logp[tok]))
    return new, logprobs


def perturb_routers(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.routers():
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * 0.5)


def capture_routing(model):
    """Forward hooks recording every router call's selected experts, per MoE layer."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.router"):
            layer = int(name.split(".")[1])
            handles.append(module.register_forward_hook(
                lambda mod, args, out, layer=layer: seen.setdefault(layer, []).append(out.indices.detach().clone())))
    return seen, handles


@pytest.fixture(scope="module")
def two_version_sample():
    model = build_model(tiny_config(), seed=0).eval()
    v0 = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    tokens, records = list(PROMPT), []
    seg1, lp1 = generate(model, tokens, records, 4, version=0, gen=gen)
    perturb_routers(model, seed=1)  # the policy update between the two segments
    v1 = copy.deepcopy(model)
    seg2, lp2 = generate(model, tokens, records, 4, version=1, gen=gen)
    session = SessionBuilder(sample_id=0)
    session.add_model_call(PROMPT, seg1 + seg2, lp1 + lp2, [0] * 4 + [1] * 4,
                           routing=RoutingRecord.concatenate(records))
    (sample,) = session.build(reward=1.0)
    return sample, v0, v1


def test_sample_carries_both_versions_and_a_concatenated_record(two_version_sample):
    sample, v0, v1 = two_version_sample
    assert sample.tokens[:5] == PROMPT and sample.policy_versions == [0] * 4 + [1] * 4
    rec = sample.routing
    assert rec.start == 0 and len(rec) == len(sample.tokens) - 1 == 12
    # prompt (prefill) + 3 fed tokens under v0; the 4th v0 token is fed after the update
    assert rec.versions.tolist() == [0] * 8 + [1] * 4
    ids = torch.tensor([sample.tokens[:-1]])
    fresh = {}
    for name, model in (("v0", v0), ("v1", v1)):
        r = RoutingReplay(RoutingMode.RECORD)
        with torch.no_grad():
            forward(model, ids, r)
        fresh[name] = RoutingRecord.from_replay(r)
    chosen = lambda t: t.sort(-1).values  # noqa: E731  the expert set (top-k order may differ in near-ties)
    for layer in rec.layer_ids:  # by causality each segment selects what its version's full forward selects
        assert torch.equal(chosen(rec.layers[layer][:8]), chosen(fresh["v0"].layers[layer][:8]))
        assert torch.equal(chosen(rec.layers[layer][8:]), chosen(fresh["v1"].layers[layer][8:]))
    differs = sum(int((chosen(rec.layers[k][:8]) != chosen(fresh["v1"].layers[k][:8])).any()) for k in rec.layer_ids)
    assert differs > 0  # recomputing with the new weights would have changed the routing


def test_training_forward_replays_the_record_bit_for_bit(two_version_sample):
    sample, _, v1 = two_version_sample
    model = copy.deepcopy(v1).train()
    model.set_recompute("full")
    perturb_routers(model, seed=2)  # the learner has moved on again (version 2)
    other = dataclasses.replace(  # a shorter second row: padding in the micro-batch
        sample, sample_id=1, tokens=sample.tokens[:9], policy_mask=sample.policy_mask[:9],
        logprobs=sample.logprobs[:9], versions=sample.versions[:9], spans=[(5, 9)],
        routing=sample.routing.slice(0, 8))
    batch = collate([sample, other], [0.5, -0.5], seq_length=14)
    assert batch.loss_mask[0].tolist() == [False] * 4 + [True] * 8 + [False] * 2
    seen, handles = capture_routing(model)
    try:
        ctx = ForwardContext.create(batch.tokens, model.plan, routing=batch.routing)
        logits = model(batch.tokens, ctx)
        (logits.float().sum() + ctx.total_aux_loss()).backward()
    finally:
        for h in handles:
            h.remove()
    for layer in sample.routing.layer_ids:
        calls = seen[layer]
        assert len(calls) == 2  # forward + recomputed forward, both replayed
        for ids in calls:
            ids = ids.view(2, 14, -1)
            assert torch.equal(ids[0, :12], sample.routing.layers[layer].long())
            assert torch.equal(ids[1, :8], other.routing.layers[layer].long())
            assert torch.equal(ids[:, 12:], torch.arange(2).expand(2, 2, 2))  # padding: experts 0..k-1


def test_replayed_padding_does_not_count_toward_the_expert_loads(two_version_sample):
    """The aux-loss-free bias update (§2.1.2) counts each router's selections in training; a
    packed RL micro-batch replays its padding to experts 0..k-1, which must not be counted
    (it would push those experts' biases down in proportion to the padding)."""
    sample, _, v1 = two_version_sample
    model = copy.deepcopy(v1).train()
    other = dataclasses.replace(
        sample, sample_id=1, tokens=sample.tokens[:9], policy_mask=sample.policy_mask[:9],
        logprobs=sample.logprobs[:9], versions=sample.versions[:9], spans=[(5, 9)],
        routing=sample.routing.slice(0, 8))
    batch = collate([sample, other], [0.5, -0.5], seq_length=20)  # 8 + 12 padded positions
    assert batch.routing.counted.sum(1).tolist() == [12, 8]
    routers = {int(n.split(".")[1]): m for n, m in model.named_modules() if n.endswith(".mlp.router")}
    for r in routers.values():
        r.tokens_per_expert.zero_()
    with torch.no_grad():
        model(batch.tokens, ForwardContext.create(batch.tokens, model.plan, routing=batch.routing))
    for layer, router in routers.items():
        real = torch.cat([sample.routing.layers[layer], other.routing.layers[layer]]).long().reshape(-1)
        expected = torch.bincount(real, minlength=router.num_experts)
        assert torch.equal(router.tokens_per_expert.sum(0), expected), layer


def test_single_version_concatenation_is_lossless():
    """Two segments under one version: the concatenated record selects the experts an
    unconstrained forward selects, and replaying it gives that forward's logits (equal up to
    the summation order of near-tied experts, which prefix and full forwards may list differently)."""
    model = build_model(tiny_config(), seed=4).eval()
    gen = torch.Generator().manual_seed(5)
    tokens, records = list(PROMPT), []
    generate(model, tokens, records, 3, version=0, gen=gen)
    generate(model, tokens, records, 3, version=0, gen=gen)
    joined = RoutingRecord.concatenate(records)
    ids = torch.tensor([tokens[:-1]])
    rec = RoutingReplay(RoutingMode.RECORD)
    with torch.no_grad():
        free = forward(model, ids, rec)
        replayed = forward(model, ids, joined.to_replay())
    whole = RoutingRecord.from_replay(rec)
    for layer in joined.layer_ids:
        assert torch.equal(joined.layers[layer].sort(-1).values, whole.layers[layer].sort(-1).values)
    torch.testing.assert_close(replayed, free, rtol=0, atol=1e-6)


def test_record_serialisation_and_validation():
    layers = {2: torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)}
    rec = RoutingRecord(layers, start=0, versions=torch.tensor([0, 0, 1]))
    assert RoutingRecord.from_state_dict(rec.state_dict()) == rec
    a, b = rec.slice(0, 2), rec.slice(2, 3)
    assert RoutingRecord.concatenate([a, b]) == rec
    with pytest.raises(ValueError, match="does not continue"):
        RoutingRecord.concatenate([a, a])
    arr = torch.arange(12).view(3, 2, 2)
    from_engine = RoutingRecord.from_array(arr, [4, 6], start=5, version=3)
    assert from_engine.layer_ids == [4, 6] and torch.equal(from_engine.layers[6], arr[:, 1].int())
    assert from_engine.start == 5 and from_engine.versions.tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="more than seq_length"):
        RoutingRecord.batch([[rec]], seq_length=2)
