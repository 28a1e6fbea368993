"""Balanced image sharding across context-parallel ranks (report §3.1.1): the owner plan is greedy
largest-first, deterministic and within Graham's bound; the span exchange's backward returns each
owner exactly the summed gradient of its own spans; a CP rank's merged chunk embeddings and the
encoder's gradients (summed over the group) equal the single-rank merge, in one call and as the
disaggregated step's phases, also on a rank that owns no image."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_s2.parallel.image_sharding import image_work, plan_image_owners, rank_loads


# ---- the plan (pure) ---------------------------------------------------------------------------
def test_plan_is_largest_first_onto_the_least_loaded_rank():
    # 5 -> r0; 3 -> r1; 3 -> r1 (3 < 5); 2 -> r0 (5 < 6); 1 -> r1 (6 < 7): loads 7 | 7
    assert plan_image_owners([5, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1]
    assert plan_image_owners([1, 2, 3, 3, 5], 2) == [1, 0, 1, 1, 0]  # the same plan, whatever the order
    assert rank_loads([5, 3, 3, 2, 1], [0, 1, 1, 0, 1], 2) == [7, 7]
    assert plan_image_owners([1, 1, 1, 1], 4) == [0, 1, 2, 3]  # ties: image order, lower rank
    assert plan_image_owners([], 2) == [] and plan_image_owners([7, 2], 1) == [0, 0]
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        plan_image_owners([1], 0)


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_plan_meets_grahams_bound_and_is_deterministic(ranks):
    rng = random.Random(ranks)
    for _ in range(200):
        costs = [image_work(rng.randint(1, 9216), 1024, 2816) for _ in range(rng.randint(1, 40))]
        owners = plan_image_owners(costs, ranks)
        assert owners == plan_image_owners(list(costs), ranks)
        loads = rank_loads(costs, owners, ranks)
        assert max(loads) <= sum(costs) / ranks + (1 - 1 / ranks) * max(costs) + 1e-6 * sum(costs)
        assert max(loads) - min(loads) <= max(costs)  # greedy: the last image placed went to the lightest rank


def test_image_work_counts_attention_quadratically():
    """At the released cap (~9k patches, d=1024, f=2816) attention is more than half a layer's work."""
    n, d, f = 9216, 1024, 2816
    linear = n * (4 * d * d + 3 * d * f)
    assert image_work(n, d, f) - linear == 2 * n * n * d
    assert 0.55 < (image_work(n, d, f) - linear) / image_work(n, d, f) < 0.65


# ---- the exchange and the merge on 2 ranks ---------------------------------------------------------
def _cp_group(rank: int, world: int):
    import torch.distributed as dist

    from megatron_s2.parallel.groups import Group

    return Group(dist.new_group(list(range(world))), world, rank, tuple(range(world)))


def _exchange_and_merge(rank: int, world: int) -> None:
    from megatron_s2.data.procedural_images import procedural_item
    from megatron_s2.models.family import family_of
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.models.v41.vision.phase import encode_images, merge_encoded_images, merge_sharded_image_embeddings
    from megatron_s2.models.v41.vision.tower import merge_image_embeddings
    from megatron_s2.parallel.context_parallel import local_chunk_positions
    from megatron_s2.parallel.image_sharding import RemoteImage, ShardedImages, gather_image_spans
    from tests.vision.conftest import vision_config

    cp = _cp_group(rank, world)
    # 1. variable-length gather: rank 0 owns 3 rows, rank 1 one; every rank weighs the gathered
    # rows with its own weights, so an owner's gradient is the sum of all ranks' weights on its rows
    counts, d = [3, 1], 5
    local = torch.full((counts[rank], d), float(rank + 1), requires_grad=True)
    gathered = gather_image_spans(local, counts, cp)
    assert torch.equal(gathered, torch.cat([torch.full((n, d), float(r + 1)) for r, n in enumerate(counts)]))
    weights = [torch.randn(sum(counts), d, generator=torch.Generator().manual_seed(q)) for q in range(world)]
    (gathered * weights[rank]).sum().backward()
    first = sum(counts[:rank])
    assert torch.allclose(local.grad, sum(w[first:first + counts[rank]] for w in weights), atol=1e-6)

    # 2. the merge: two rows, spans crossing the 16-token chunk boundaries (rank 0 holds [0, 16) and
    # [48, 64), rank 1 holds [16, 48)), against the single-rank merge of the same images
    cfg = vision_config(image_token_id=120)
    processor = family_of(cfg).image_processor(cfg)
    encoder = build_model(cfg, seed=5).vision
    starts = [[1, 30], [10]]
    rows = [[processor.prepare(procedural_item(3 * i + j, size=48).image, at) for j, at in enumerate(row)]
            for i, row in enumerate(starts)]
    seq, hidden = 64, cfg.hidden_size
    h = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(7), requires_grad=True)
    probe = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(8))
    full = merge_image_embeddings(h, rows, encoder)
    (full * probe).sum().backward()
    reference = {n: p.grad.clone() for n, p in encoder.named_parameters()}
    encoder.zero_grad(set_to_none=True)

    # plans: rank 0 owns row 0's first image; rank 0 owns nothing (its encoder gradients are zeros,
    # so the replicas' all-reduce still sums the same tensors); in one call (vision inside embed)
    # and as the disaggregated step's phases (encode, merge, LLM backward, then encoder backward)
    idx = local_chunk_positions(seq, cp)
    for owners, phased in (([[0, 1], [1]], False), ([[0, 1], [1]], True), ([[1, 1], [1]], True)):
        mine = ShardedImages([[image if owner == rank else RemoteImage(image.start, image.types.numel(), owner)
                               for image, owner in zip(row, row_owners)] for row, row_owners in zip(rows, owners)],
                             idx, cp)
        encoder.zero_grad(set_to_none=True)
        h_local = h.detach()[:, idx].requires_grad_(True)
        if phased:
            encoded = encode_images(mine, encoder, h.dtype)
            merged = merge_encoded_images(h_local, encoded)
        else:
            merged = merge_sharded_image_embeddings(h_local, mine, encoder)
        assert torch.allclose(merged, full.detach()[:, idx], atol=1e-6)
        (merged * probe[:, idx]).sum().backward()
        if phased:
            assert all(p.grad is None for p in encoder.parameters())  # the LLM phase stops at the span rows
            encoded.backward()
        assert torch.allclose(h_local.grad, h.grad[:, idx], atol=1e-6)  # text positions only
        for name, p in encoder.named_parameters():
            summed = p.grad.clone()
            torch.distributed.all_reduce(summed, group=cp.pg)  # what the data x context replicas reduce does
            assert torch.allclose(summed, reference[name], rtol=1e-5, atol=1e-6), (owners, phased, name)


@pytest.mark.slow
def test_span_exchange_and_sharded_merge_equal_the_single_rank_merge():
    from tests.parallel.spawn import run_distributed

    run_distributed(2, _exchange_and_merge)
