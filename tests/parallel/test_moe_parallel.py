"""MoE layer under EP, ETP, TP (+SP), TP x EP and CP against the single-rank layer.

Four gloo processes are spawned once for the module; every layout below is built inside
them with :func:`megatron_s2.parallel.setup.build_groups` (extra dp/edp ranks fill the world
of 4). Each process also runs the single-rank reference on the whole batch with the same
seed, so every rank checks its own shard:

* routing decisions identical (exact), output and input gradient equal;
* every parameter gradient equal to the reference slice after the project's gradient
  finaliser (``finalize_model_grads``: tp-partial params summed over tp, dense params summed
  over dp x cp, expert params over expert-dp, as their placements say), with the trainer's
  objective (token loss / global token count + aux loss / data-parallel micro-batches);
* the sequence balance loss equal (averaged over data-parallel replicas);
* the aux-loss-free bias update identical (exact);
* replaying the reference routing reproduces the reference output, and replaying the rank's
  own record reproduces its output bit for bit.

Tolerance (fp32): max |parallel - reference| <= 1e-5 * max |reference| per tensor.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.moe import MoELayer, RoutingMode, RoutingReplay
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.placement import placement_of
from megatron_s2.parallel.setup import build_groups
from megatron_s2.parallel.sharding import shard_spec, slice_of
from megatron_s2.parallel.grad_finalize import finalize_model_grads
from tests.parallel.spawn import init_gloo, spawn

WORLD = 4
RTOL = 1e-5
BATCH, SEQ, HIDDEN, EXPERTS, TOPK, FFN = 4, 8, 16, 8, 2, 8
RATE = 0.01
LAYOUTS = {
    "ep2": dict(ep=2),
    "ep4": dict(ep=4),
    "etp2_ep2": dict(ep=2, etp=2),
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2_ep2": dict(tp=2, ep=2),
    "tp2_sp_etp2": dict(tp=2, sequence_parallel=True, etp=2),
    "cp2_ep2": dict(cp=2, ep=2),
}


def model_config() -> V41Config:
    return V41Config(name="moe-parallel-test", hidden_size=HIDDEN, layer_groups=(LayerGroupSpec(modes=("swa",)),),
                       num_encoder_layers=1, engram_layers=(), num_routed_experts=EXPERTS, moe_topk=TOPK,
                       moe_ffn_hidden_size=FFN, init_std=0.3, moe_seq_aux_loss_coeff=0.05)


def make_data():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    image_mask = torch.rand(BATCH, SEQ, generator=gen) < 0.35
    upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    return x, image_mask, upstream


def run_layer(layer, x, image_mask, upstream, routing, num_replicas):
    """Forward + backward of the trainer's objective: sum of <out, upstream> over this rank's
    tokens / global token count + aux loss / data-parallel micro-batches."""
    x = x.clone().requires_grad_()
    ctx = ForwardContext.create(torch.zeros(image_mask.shape, dtype=torch.long), layer.config.plan,
                                image_mask=image_mask, routing=routing)
    out = layer(x, ctx)
    aux = ctx.aux_losses["moe_seq_balance"]
    ((out * upstream).sum() / (BATCH * SEQ) + aux / num_replicas).backward()
    return out.detach(), x.grad, aux.detach()


def reference(cfg, data):
    layer = MoELayer(cfg, 0, ParallelGroups.single())
    initialize_parameters(layer, 7, cfg.init_std)
    rec = RoutingReplay(RoutingMode.RECORD)
    out, x_grad, aux = run_layer(layer, *data, rec, 1)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.router.update_expert_bias(RATE)
    return dict(out=out, x_grad=x_grad, aux=aux, grads=grads, ids=rec.records()[0][0].long(),
                bias=layer.router.expert_bias.clone(), image_bias=layer.router.image_expert_bias.clone())


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


def check_layout(cfg, layout, groups, data, ref, rank):
    x, image_mask, upstream = data
    c = layout.coords(rank)
    rows = slice(c["dp"] * BATCH // layout.dp, (c["dp"] + 1) * BATCH // layout.dp)
    chunk = SEQ // (2 * layout.cp)  # load-balanced CP: chunks i and 2cp-1-i
    pos = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (c["cp"], 2 * layout.cp - 1 - c["cp"])])
    pos = pos.sort().values if layout.cp == 1 else pos

    def mine(t):  # this data replica's tokens, [b, s_ctx, ...]
        return t[rows][:, pos]

    def sp(t):  # what the layer holds under SP
        if not layout.sequence_parallel:
            return t
        step = t.size(1) // layout.tp
        return t[:, c["tp"] * step:(c["tp"] + 1) * step]

    layer = MoELayer(cfg, 0, groups)
    initialize_parameters(layer, 7, cfg.init_std)
    rec = RoutingReplay(RoutingMode.RECORD)
    out, x_grad, aux = run_layer(layer, sp(mine(x)), mine(image_mask), sp(mine(upstream)), rec, layout.dp)
    finalize_model_grads(list(layer.parameters()), groups)
    res = {
        "router_flag": placement_of(layer.router.weight).tp_partial == (layout.tp > 1),
        "routing": torch.equal(rec.records()[0][0].long(), mine(ref["ids"])),
        "out": rel_err(out, sp(mine(ref["out"]))),
        "x_grad": rel_err(x_grad, sp(mine(ref["x_grad"]))),
    }
    for name, p in layer.named_parameters():
        res[f"grad:{name}"] = rel_err(p.grad, slice_of(ref["grads"][name], shard_spec(p)))
    mean_aux = aux.clone()  # each cp rank holds its share of its replica's loss: sum over cp, mean over dp
    if groups.dp_cp.active:
        dist.all_reduce(mean_aux, group=groups.dp_cp.pg)
    res["aux"] = rel_err(mean_aux / layout.dp, ref["aux"])
    layer.router.update_expert_bias(RATE)
    res["bias"] = torch.equal(layer.router.expert_bias, ref["bias"]) and \
        torch.equal(layer.router.image_expert_bias, ref["image_bias"])
    res["bias_moved"] = bool(ref["bias"].abs().sum() > 0 and ref["image_bias"].abs().sum() > 0)

    layer.eval()  # replay: no counters, no aux loss
    def replay(records):
        ctx = ForwardContext.create(torch.zeros(BATCH // layout.dp, pos.numel(), dtype=torch.long), cfg.plan,
                                    image_mask=mine(image_mask), routing=RoutingReplay(RoutingMode.REPLAY, records))
        with torch.no_grad():
            return layer(sp(mine(x)), ctx)

    res["replay_ref"] = rel_err(replay({0: [mine(ref["ids"])]}), sp(mine(ref["out"])))
    res["replay_own_bitwise"] = torch.equal(replay(rec.records()), out)
    return res


def _worker(rank, store_dir, out_dir):
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, store_dir, timeout_s=120)
    results = {}
    try:
        cfg, data = model_config(), make_data()
        ref = reference(cfg, data)
        for name, sizes in LAYOUTS.items():
            layout = ParallelLayout.build(ParallelConfig(**sizes), cfg, WORLD, seq_length=SEQ)
            results[name] = check_layout(cfg, layout, build_groups(layout), data, ref, rank)
    except Exception:  # report to pytest instead of dying silently in a child
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moe_parallel")
    error = None
    try:
        spawn(_worker, WORLD, str(out_dir))
    except Exception as exc:  # the per-rank files say more
        error = exc
    per_rank = {r: torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD) if (out_dir / f"rank{r}.pt").exists()}
    errors = [v["error"] for v in per_rank.values() if "error" in v]
    if error is not None or errors:
        pytest.fail(f"worker failed: {error}\n" + "\n".join(errors[:1]))
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(results, layout):
    for rank in range(WORLD):
        res = results[rank][layout]
        exact = {k: v for k, v in res.items() if isinstance(v, bool)}
        assert all(exact.values()), f"rank {rank}: {[k for k, v in exact.items() if not v]} failed"
        errors = {k: v for k, v in res.items() if not isinstance(v, bool)}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL, f"rank {rank}: {worst} relative error {errors[worst]:.2e} > {RTOL}"
