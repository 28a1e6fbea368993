"""Contrastive step with the feature all-gathers overlapped (V4.1 report §3.1.1) vs blocking, side by side.

    python bench/contrastive_overlap.py                       # embed 64 and 32768, local batch 16, ~1.5 min
    python bench/contrastive_overlap.py --embed-dims 4096 65536 --local-batch 32 --repeats 9
    python bench/contrastive_overlap.py --smoke               # one small size, 2 repeats (test suite)

Two gloo ranks (spawned, one torch thread each) build the two-tower model of
``recipes/vision_contrastive_tiny.yaml`` (``contrastive.embed_dim`` set per row) from the same
seed and take the same procedural pairs (rank r: the r-th half of the global batch). Each row
runs :func:`~megatron_s2.training.contrastive_schedule.contrastive_forward_backward` on the same
inputs and weights in both modes, alternating, ``--repeats`` times after one warm-up each:

* **overlapped** — the report's schedule: AllGather(V) issued before the text forward and
  AllGather(T) before the text backward, each waited for only when its result is needed;
* **blocking** — the same computation in the same order, each all-gather waited for as soon as
  it is issued.

Step time = max over ranks of the barrier-started forward + backward wall time, median over
repeats. "wait" = time blocked in the gathers' ``wait()`` (communication *not* hidden), rank
max, median. "gather alone" = one blocking all-gather of this rank's [n, embed] float32
features (two per step). The script asserts that both modes give bitwise the same loss and
the same gradient for every parameter (same operations, same order) and exits non-zero if not.

The wide rows stand in for what makes the gathers expensive at scale (a global batch of tens of
thousands of pairs over many ranks): on two CPU ranks over loopback with the tiny towers the
64-wide features cost well under a millisecond to gather, so that row's ratio is ~1. With two
ranks on two shared cores, the gloo communication thread competes with the other rank's compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "recipes" / "vision_contrastive_tiny.yaml"


def _build(rank: int, world: int, embed_dim: int, local_batch: int):
    from fnmatch import fnmatch

    import torch

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.image_text_pairs import ProceduralPairs
    from megatron_s2.data.tokenizer import build_tokenizer
    from megatron_s2.models.family import family_of
    from megatron_s2.models.init import initialize_parameters

    recipe = load_recipe(RECIPE, [f"contrastive.embed_dim={embed_dim}"])
    c = recipe.contrastive
    tokenizer = build_tokenizer(recipe.data)
    model = family_of(recipe.model).build_contrastive_model(recipe.model, c, tokenizer.vocab_size)
    initialize_parameters(model, recipe.training.seed, recipe.model.init_std)
    for name, p in model.named_parameters():
        p.requires_grad_(not any(fnmatch(name, pattern) for pattern in model.FROZEN))
    pairs = ProceduralPairs(seed=recipe.training.seed, image_size=c.image_size, global_batch_size=local_batch * world,
                            dp_rank=rank, dp_size=world).next_step()
    images = model.prepare_images([image for image, _ in pairs], c.max_image_size)
    captions = [torch.tensor(tokenizer.encode(caption)[: c.text_max_tokens]) for _, caption in pairs]
    return model, images, captions


def _worker(rank: int, world: int, embed_dims: list[int], local_batch: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_s2.parallel.groups import Group
    from megatron_s2.training.contrastive_schedule import contrastive_forward_backward

    group = Group(dist.group.WORLD, world, rank, tuple(range(world)))
    rows = []
    for embed_dim in embed_dims:
        model, images, captions = _build(rank, world, embed_dim, local_batch)

        def step(overlap: bool):
            model.zero_grad(set_to_none=True)
            timings: dict = {}
            dist.barrier()
            start = time.perf_counter()
            loss = contrastive_forward_backward(lambda: model.encode_images(images),
                                                lambda: model.encode_texts(captions), model.log_temperature,
                                                model.logit_bias, group, overlap=overlap, timings=timings)
            took = torch.tensor([time.perf_counter() - start, timings.get("wait_s", 0.0)], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            return loss, grads, took.tolist()

        reference = {mode: step(mode) for mode in (True, False)}  # warm-up, and the values compared
        (loss_o, grads_o, _), (loss_b, grads_b, _) = reference[True], reference[False]
        identical = torch.equal(loss_o, loss_b) and grads_o.keys() == grads_b.keys() and all(
            torch.equal(grads_o[n], grads_b[n]) for n in grads_o)
        times = {True: [], False: []}
        for _ in range(repeats):
            for mode in (True, False):
                loss, grads, took = step(mode)
                identical &= torch.equal(loss, loss_o) and all(torch.equal(grads[n], grads_o[n]) for n in grads_o)
                times[mode].append(took)
        features = torch.randn(local_batch, embed_dim)
        gather = []
        for _ in range(max(repeats, 3)):
            parts = [torch.empty_like(features) for _ in range(world)]
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather(parts, features)
            gather.append(time.perf_counter() - start)
        total = loss_o.clone()
        dist.all_reduce(total)
        rows.append({"embed_dim": embed_dim, "identical": bool(identical), "loss": float(total),
                     "overlap_ms": 1e3 * statistics.median(t[0] for t in times[True]),
                     "overlap_wait_ms": 1e3 * statistics.median(t[1] for t in times[True]),
                     "blocking_ms": 1e3 * statistics.median(t[0] for t in times[False]),
                     "blocking_wait_ms": 1e3 * statistics.median(t[1] for t in times[False]),
                     "gather_ms": 1e3 * statistics.median(gather), "params": sum(p.numel() for p in model.parameters())})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embed-dims", type=int, nargs="+", default=[64, 32768],
                        help="shared-embedding widths, one row each (the gathered feature width)")
    parser.add_argument("--local-batch", type=int, default=16, help="pairs per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one 64-wide row, local batch 4, 2 repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.embed_dims, args.local_batch, args.repeats = [64], 4, 2
    from tests.parallel.spawn import run_distributed

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_distributed(world, _worker, args.embed_dims, args.local_batch, args.repeats, out)
        rows = json.loads(Path(out).read_text())
    print(f"contrastive step (SigLIP, two towers of {RECIPE.name}), {world} gloo ranks, local batch "
          f"{args.local_batch}, median of {args.repeats}")
    print(f"{'embed':>6} {'gather alone ms':>15} {'blocking ms':>12} {'wait ms':>8} {'overlapped ms':>14} "
          f"{'wait ms':>8} {'ratio blocking/overlapped':>26}  loss, grads")
    failed = False
    for r in rows:
        ratio = r["blocking_ms"] / r["overlap_ms"]
        same = "identical" if r["identical"] else "DIFFERENT"
        failed |= not r["identical"]
        print(f"{r['embed_dim']:>6} {r['gather_ms']:>15.2f} {r['blocking_ms']:>12.1f} {r['blocking_wait_ms']:>8.2f} "
              f"{r['overlap_ms']:>14.1f} {r['overlap_wait_ms']:>8.2f} {ratio:>26.3f}  {same} (loss {r['loss']:.6f})")
    if failed:
        print("error: the overlapped and blocking steps disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
