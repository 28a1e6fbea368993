"""Filler rows (:mod:`megatron_s2.posttrain.episode_rows`) bear no loss, and the losses that are
not loss-masked must not see them either: the routers' balance losses (V4.1's sequence balance
loss, Intern-S2's load-balancing loss), the DSpark drafter's co-training loss and its MoEs' balance
loss, and the routers' expert loads of the aux-loss-free bias. Each is computed on the micro-batch
``build_micro_batches`` lays out for a multi-branch episode whose last row shares its micro-batch
with a filler, and on the same real rows alone: equal values and equal gradients."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_s2.config.posttrain.loss import LossConfig
from megatron_s2.models.family.routing_replay import RoutingReplay
from megatron_s2.posttrain.orchestrator.sample import RolloutSample
from megatron_s2.posttrain.routing import RoutingRecord
from megatron_s2.posttrain.train_batch import build_micro_batches
from tests.dspark.conftest import dspark_config

ROOT = Path(__file__).resolve().parents[2]
SEQ = 24
LAYERS = list(range(8))
"""The tiny V4.1's MoE layer ids."""


def _row(sample_id: int, seed: int, prompt: int, generated: int, topk: int, experts: int,
         layers: list[int]) -> RolloutSample:
    """A row whose R3 record routes every fed position to random experts of ``layers``."""
    g = torch.Generator().manual_seed(seed)
    n = prompt + generated
    tokens = torch.randint(3, 120, (n,), generator=g).tolist()
    routing = RoutingRecord({k: torch.randint(0, experts, (n - 1, topk), generator=g, dtype=torch.int32)
                             for k in layers}, 0, torch.zeros(n - 1, dtype=torch.int64))
    return RolloutSample(sample_id=sample_id, prompt_uid=f"p{sample_id}", group_id=0, tokens=tokens,
                         policy_mask=[False] * prompt + [True] * generated, logprobs=[-1.0] * n,
                         versions=[0] * n, spans=[(prompt, n)], routing=routing)


def _micro_batches(topk: int, experts: int, layers: list[int]) -> list[dict]:
    """An episode of two branches + a one-row episode = 3 rows in micro-batches of 2: the second
    is [the one-row episode, filler] (the filler: a copy of the first episode's first row)."""
    episode = _row(0, 1, 6, 7, topk, experts, layers)
    episode.branches = [_row(0, 2, 9, 5, topk, experts, layers)]
    single = _row(1, 4, 5, 9, topk, experts, layers)
    return build_micro_batches([episode, single], [1.0, -1.0], seq_length=SEQ, micro_batch_size=2, dp_rank=0,
                               dp_size=1, pad_id=0, loss_config=LossConfig(aggregation="token_mean"))


def test_the_micro_batch_with_fillers_marks_its_real_rows_and_keeps_fillers_out_of_the_expert_loads():
    with_f = _micro_batches(topk=2, experts=8, layers=LAYERS)
    assert len(with_f) == 2 and with_f[1]["tokens"].size(0) == 2
    assert "aux_rows" not in with_f[0]  # every row bears loss: nothing changes there
    assert with_f[1]["aux_rows"].tolist() == [True, False]
    assert torch.equal(with_f[1]["tokens"][1], with_f[0]["tokens"][0])  # the filler: a copy
    counted = with_f[1]["routing"].counted
    assert counted[0].any() and not counted[1].any()


def _forward(model, mb: dict, loss_fn=None):
    """(auxiliary loss of the micro-batch [+ loss_fn's objective], gradients by name)."""
    model.zero_grad(set_to_none=True)
    routing = mb["routing"]  # a fresh cursor: each forward replays from the start
    mb = {**mb, "routing": RoutingReplay(routing.mode, routing.records(), counted=routing.counted)}
    ctx = model.make_context(mb)
    logits = model(mb["tokens"], ctx)
    aux = ctx.total_aux_loss()
    objective = aux if loss_fn is None else aux + loss_fn(model, logits, mb, ctx)[0]
    objective.backward()
    return objective.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows(mb: dict, keep: list[int]) -> dict:
    """The micro-batch restricted to rows ``keep`` (its R3 replay too)."""
    idx = torch.tensor(keep)
    out = {k: (v.index_select(0, idx) if torch.is_tensor(v) and v.dim() >= 1 and v.size(0) == mb["tokens"].size(0)
               else v) for k, v in mb.items() if k not in ("routing", "aux_rows", "domains")}
    routing = mb["routing"]
    out["routing"] = RoutingReplay(routing.mode, {k: [e.index_select(0, idx) for e in v]
                                                  for k, v in routing.records().items()},
                                   counted=routing.counted.index_select(0, idx))
    return out


def _assert_same(a, b):
    """Equal losses and gradients, up to float32 summation order (a 2-row vs a 1-row batch: the
    gradients differ by ~3e-7 of their norm; what a filler adds is ~2e-4 of the loss)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=0), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    flat_a = torch.cat([grads_a[n].flatten() for n in sorted(grads_a)])
    flat_b = torch.cat([grads_b[n].flatten() for n in sorted(grads_b)])
    assert float((flat_a - flat_b).norm()) <= 1e-5 * float(flat_b.norm())


def test_v41_balance_and_drafter_losses_do_not_see_filler_rows():
    """V4.1 with a DSpark drafter: the sequence balance loss of the backbone's and the drafter's
    MoEs, and the online draft update (RL co-training), with the filler in the micro-batch and
    without it: equal, gradients too; and different from what the fillers would have added."""
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.training.draft_objective import DraftObjective

    cfg = dspark_config(moe_seq_aux_loss_coeff=0.01)
    model = build_model(cfg, seed=4)
    model.capture_dspark = True
    model.train()

    def policy(model, logits, mb, ctx):  # the RL objective is loss-masked already: any masked term
        lp = logits.float().log_softmax(-1).gather(-1, mb["labels"][..., None]).squeeze(-1)
        return -(lp * mb["loss_mask"]).sum() / 100, None

    drafter = DraftObjective(torch.tensor([100.0]), 1, language_model=False, eta=3.0, temperature=0.7, primary=policy)
    mb = _micro_batches(cfg.moe_topk, cfg.num_routed_experts, LAYERS)[1]  # [the one-row episode, filler]
    alone = _rows(mb, [0])
    for loss_fn in (None, drafter):
        _assert_same(_forward(model, mb, loss_fn), _forward(model, alone, loss_fn))
    leaked = dict(mb)
    del leaked["aux_rows"]  # what the fillers added before: their routing counted again
    assert not torch.allclose(_forward(model, leaked)[0], _forward(model, alone)[0])


def test_intern_s2_load_balancing_loss_does_not_see_filler_rows():
    import yaml

    from megatron_s2.config.model_schema import ModelSchema
    from megatron_s2.config.schema import from_mapping
    from megatron_s2.models.family import family_of

    raw = yaml.safe_load((ROOT / "recipes" / "models" / "intern_s2_tiny.yaml").read_text())
    cfg = from_mapping(ModelSchema, {**raw, "router_aux_loss_coef": 0.01})
    model = family_of(cfg).build_model(cfg)
    model.init_weights(3)
    model.train()
    mb = _micro_batches(cfg.moe_topk, cfg.num_routed_experts, model.layer_ids)[1]
    alone = _rows(mb, [0])
    _assert_same(_forward(model, mb), _forward(model, alone))
    leaked = dict(mb)
    del leaked["aux_rows"]
    assert not torch.allclose(_forward(model, leaked)[0], _forward(model, alone)[0])
