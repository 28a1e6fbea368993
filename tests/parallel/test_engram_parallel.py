"""Engram under parallel layouts vs the single-process module (report §3.1.3).

Two gloo processes are started once for the module and run three layouts on the same seed:

* ``dp``: data parallel 2 = engram parallel 2 -- the ranks hold different sequences and the
  table rows are partitioned over them (distributed lookup + gradient return to the owners);
* ``cp``: context parallel 2 = engram parallel 2 -- the ranks hold different load-balanced
  chunks of the same sequences (hashes need the tokens of the other chunks);
* ``sp``: tensor parallel 2 with sequence parallelism -- the streams are sequence-sharded and
  the table (engram parallel 1) is replicated; parameters are placed tp-partial. The
  mHC coefficient predictor is checked in the same layout.

Each rank saves its outputs and gradients; the tests compare them with the single-process
module run on the union of the data: outputs equal, table gradients equal after gathering the
row partitions (or summing over tp), other gradients equal after summing over ranks
(fp32, max error <= 1e-6 of the largest magnitude).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.engram import Engram
from megatron_s2.models.v41.mhc import HyperConnection
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.parallel.placement import placement_of
from megatron_s2.parallel.setup import build_groups
from tests.parallel.spawn import init_gloo, spawn

WORLD = 2
SEED = 1234
LAYER = 3  # the second Engram layer: its primes follow those of layer 1
B, S = 4, 16
TOKEN_MAP = [(t * 5) % 61 for t in range(128)]
CP_CHUNKS = {0: (0, 3), 1: (1, 2)}  # 2*cp load-balanced chunks, rank r holds r and 2cp-1-r
REL_TOL = 1e-6


def config() -> V41Config:
    # table_size 509: the layer's 6 tables hold ~3.1k rows, so both partitions are addressed.
    return V41Config(vocab_size=128, hidden_size=16, num_encoder_layers=4, layer_groups=(LayerGroupSpec(modes=("swa",) * 4),),
                       num_attention_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                       window_size=8, index_num_heads=2, index_head_dim=32, index_topk=6, candidate_topk_blocks=0,
                       num_routed_experts=4, moe_topk=2, moe_ffn_hidden_size=32, hc_mult=4, engram_layers=(1, LAYER),
                       engram_ngram_orders=(2, 3), engram_num_heads=3, engram_dim_per_order=96, engram_table_size=509,
                       engram_pad_id=2, engram_fp8_tables=True, fp8_swa_kv=False, fp4_indexer=False, init_std=0.02)


def union_data(cfg: V41Config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    image = torch.rand(B, S, generator=g) < 0.1
    image[1, 5:8] = True
    return dict(ids=torch.randint(0, cfg.vocab_size, (B, S), generator=g),
                doc=(torch.rand(B, S, generator=g) < 0.15).long().cumsum(1), image=image,
                x=torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=g),
                probe=torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=g))


def cp_positions(rank: int) -> torch.Tensor:
    size = S // (2 * WORLD)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in CP_CHUNKS[rank]])


def local_view(kind: str, rank: int, data: dict, cfg: V41Config):
    """(x, probe, ctx) of ``rank`` in layout ``kind``."""
    plan = cfg.plan
    if kind == "dp":
        rows = slice(2 * rank, 2 * rank + 2)
        ctx = ForwardContext.create(data["ids"][rows], plan, doc_ids=data["doc"][rows], image_mask=data["image"][rows])
        return data["x"][rows], data["probe"][rows], ctx
    if kind == "cp":
        pos = cp_positions(rank)
        ctx = ForwardContext.create(data["ids"][:, pos], plan, positions=pos.expand(B, -1),
                                    doc_ids=data["doc"][:, pos], image_mask=data["image"][:, pos])
        ctx.full_input_ids, ctx.full_doc_ids, ctx.full_image_mask = data["ids"], data["doc"], data["image"]
        return data["x"][:, pos], data["probe"][:, pos], ctx
    # sp: the tokens of the whole (context-local) sequence, the streams of this rank's slice
    ctx = ForwardContext.create(data["ids"], plan, doc_ids=data["doc"], image_mask=data["image"])
    return data["x"].chunk(WORLD, 1)[rank], data["probe"].chunk(WORLD, 1)[rank], ctx


def run_engram(cfg: V41Config, groups: ParallelGroups, x, probe, ctx) -> dict:
    module = Engram(cfg, LAYER, groups, compressed_token_map=TOKEN_MAP)
    initialize_parameters(module, SEED, cfg.init_std)
    x = x.clone().requires_grad_(True)
    out = module(x, ctx)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    flags = {n: placement_of(p).tp_partial for n, p in module.named_parameters()}
    return dict(out=out.detach(), x_grad=x.grad, grads=grads, flags=flags)


def run_mhc(cfg: V41Config, groups: ParallelGroups, x, probe) -> dict:
    hc = HyperConnection(cfg, groups)
    initialize_parameters(hc, SEED, cfg.init_std)
    x = x.clone().requires_grad_(True)
    pre, post, comb = hc.coefficients(x)
    (pre.sum() + (post * post).sum() + (comb * comb[..., :1, :1]).sum() + hc.collapse(x, pre).sum()).backward()
    return dict(pre=pre.detach(), comb=comb.detach(), x_grad=x.grad, grads={n: p.grad.clone() for n, p in hc.named_parameters()},
                flags={n: placement_of(p).tp_partial for n, p in hc.named_parameters()})


def make_layout(tp: int, cp: int, dp: int, engram: int, sp: bool) -> ParallelLayout:
    return ParallelLayout(world_size=WORLD, tp=tp, pp=1, vpp=1, cp=cp, dp=dp, ep=1, etp=1, edp=tp * cp * dp, engram=engram,
                          sequence_parallel=sp, distributed_optimizer=False, stage_layers=(tuple(range(4)),))


LAYOUTS = {"dp": dict(tp=1, cp=1, dp=2, engram=2, sp=False),
           "cp": dict(tp=1, cp=2, dp=1, engram=2, sp=False),
           "sp": dict(tp=2, cp=1, dp=1, engram=1, sp=True)}


def _worker(rank: int, store_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, store_dir, timeout_s=60)
    try:
        cfg = config()
        data = union_data(cfg)
        results = {}
        for kind, sizes in LAYOUTS.items():
            groups = build_groups(make_layout(**sizes))
            x, probe, ctx = local_view(kind, rank, data, cfg)
            res = run_engram(cfg, groups, x, probe, ctx)
            grad = res["grads"]["table.weight"]
            parts = [torch.empty_like(grad) for _ in range(groups.engram.size)]
            if groups.engram.active:
                dist.all_gather(parts, grad.contiguous(), group=groups.engram.pg)
            else:
                parts = [grad]
            res["table_grad_full"] = torch.cat(parts)
            res["engram_size"] = groups.engram.size
            results[kind] = res
            if kind == "sp":
                results["mhc"] = run_mhc(cfg, groups, x, probe)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()



@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("engram_parallel")
    spawn(_worker, WORLD, str(out_dir))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    cfg = config()
    data = union_data(cfg)
    ctx = ForwardContext.create(data["ids"], cfg.plan, doc_ids=data["doc"], image_mask=data["image"])
    return dict(engram=run_engram(cfg, ParallelGroups.single(), data["x"], data["probe"], ctx),
                mhc=run_mhc(cfg, ParallelGroups.single(), data["x"], data["probe"]))


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= REL_TOL * max(scale, 1e-30), f"{what}: max error {err:.3e} vs max magnitude {scale:.3e}"


def token_slice(kind: str, rank: int, t: torch.Tensor) -> torch.Tensor:
    if kind == "dp":
        return t[2 * rank:2 * rank + 2]
    if kind == "cp":
        return t[:, cp_positions(rank)]
    return t.chunk(WORLD, 1)[rank]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_outputs_and_input_gradients_match(parallel_results, reference, kind):
    ref = reference["engram"]
    for rank, res in enumerate(parallel_results):
        assert_close(res[kind]["out"], token_slice(kind, rank, ref["out"]), f"{kind} rank {rank} output")
        assert_close(res[kind]["x_grad"], token_slice(kind, rank, ref["x_grad"]), f"{kind} rank {rank} input grad")
    # The gate really varies and the image tokens pass through: the comparison is not vacuous.
    assert (ref["out"] - union_data(config())["x"]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_table_gradient_matches(parallel_results, reference, kind):
    ref = reference["engram"]["grads"]["table.weight"]
    fulls = [res[kind]["table_grad_full"] for res in parallel_results]
    if kind == "sp":  # replicated table, sequence-sharded tokens: partial sums over tp
        assert_close(sum(fulls), ref, "sp table grad (summed over tp)")
        return
    assert parallel_results[0][kind]["engram_size"] == WORLD
    for rank, full in enumerate(fulls):
        assert_close(full, ref, f"{kind} table grad (gathered on rank {rank})")
    # Both partitions received gradient, i.e. rows really travelled between ranks.
    half = ref.size(0) // WORLD
    assert ref[:half].abs().sum() > 0 and ref[half:].abs().sum() > 0


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_replicated_parameter_gradients_match_after_summing(parallel_results, reference, kind):
    for name, ref in reference["engram"]["grads"].items():
        if name == "table.weight":
            continue
        assert_close(sum(res[kind]["grads"][name] for res in parallel_results), ref, f"{kind} {name}")


def test_sequence_parallel_flags(parallel_results, reference):
    assert all(parallel_results[0]["sp"]["flags"].values())
    assert not any(parallel_results[0]["dp"]["flags"].values())
    assert all(parallel_results[0]["mhc"]["flags"].values())
    assert not any(reference["mhc"]["flags"].values())


def test_mhc_under_sequence_parallelism(parallel_results, reference):
    ref = reference["mhc"]
    for rank, res in enumerate(parallel_results):
        assert_close(res["mhc"]["pre"], token_slice("sp", rank, ref["pre"]), f"mhc pre rank {rank}")
        assert_close(res["mhc"]["comb"], token_slice("sp", rank, ref["comb"]), f"mhc comb rank {rank}")
        assert_close(res["mhc"]["x_grad"], token_slice("sp", rank, ref["x_grad"]), f"mhc input grad rank {rank}")
    for name, g in ref["grads"].items():
        assert_close(sum(res["mhc"]["grads"][name] for res in parallel_results), g, f"mhc {name}")
