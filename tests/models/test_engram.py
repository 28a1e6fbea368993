"""Engram (report §2.4.2, §3.1.3): hashing against a slow re-implementation of the rules,
distinct prime tables, FP8 rows, the gate and its gradients, single-process table behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_s2.models.v41.config import LayerGroupSpec, V41Config
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.engram import (
    Engram,
    EngramHasher,
    EngramTable,
    engram_gate,
    engram_primes,
    fake_quant_rows,
    is_prime,
)
from megatron_s2.models.v41.engram.table import padded_rows, table_init
from megatron_s2.parallel.groups import Group
from megatron_s2.parallel.sharding import ShardSpec, init_from_full, shard_spec


def tiny_config(**overrides) -> V41Config:
    base = dict(vocab_size=128, hidden_size=16, num_encoder_layers=4, layer_groups=(LayerGroupSpec(modes=("swa",) * 4),),
                num_attention_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                window_size=8, index_num_heads=2, index_head_dim=32, index_topk=6, candidate_topk_blocks=0,
                num_routed_experts=4, moe_topk=2, moe_ffn_hidden_size=32, hc_mult=4, engram_layers=(1, 3),
                engram_ngram_orders=(2, 3, 4), engram_num_heads=2, engram_dim_per_order=64, engram_table_size=97,
                engram_pad_id=3, fp8_swa_kv=False, fp4_indexer=False, init_std=0.02)
    base.update(overrides)
    return V41Config(**base)


def random_batch(b: int, s: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    doc_ids = (torch.rand(b, s, generator=g) < 0.15).long().cumsum(1)
    image = torch.rand(b, s, generator=g) < 0.1
    return ids, doc_ids, image


# ---- primes -------------------------------------------------------------------------------
def _trial_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, int(n ** 0.5) + 1))


def test_miller_rabin_is_exact():
    assert [n for n in range(5000) if is_prime(n)] == [n for n in range(5000) if _trial_prime(n)]
    # strong pseudoprimes to small bases, Carmichael numbers, 64-bit primes and composites
    for n in (561, 1105, 3215031751, 2152302898747, 3474749660383, 341550071728321, 3825123056546413051):
        assert not is_prime(n), n
    for n in ((1 << 61) - 1, 18446744073709551557, 4294967291):  # known primes (the last two: largest below 2^64, 2^32)
        assert is_prime(n), n
    for n in range(16_000_000, 16_000_400):
        assert is_prime(n) == _trial_prime(n), n
    assert not is_prime((1 << 64) - 1) and not is_prime(4294967291 * 4294967279)


def test_primes_distinct_prime_and_follow_the_start_rule():
    primes = engram_primes(2, 3, 8, 16_000_000)  # flagship: two modules, orders 2-4, 8 heads
    flat = [p for layer in primes for order in layer for p in order]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert all(_trial_prime(p) for p in flat[:3]) and all(is_prime(p) for p in flat)
    # Each order restarts at table_size - 1 and takes the next unused primes, in increasing order.
    all_primes_above = [n for n in range(16_000_000, 16_002_000) if is_prime(n)]
    assert flat == sorted(flat) and flat == all_primes_above[:48]
    assert engram_primes(1, 1, 2, 251) == (((251, 257),),)


# ---- hashing ------------------------------------------------------------------------------
def slow_hash(ids, doc_ids, dead, token_map, layer_id, layer_index, orders, heads, table_size, pad_id):
    """The addressing rules written out position by position with Python ints."""
    n_max = max(orders)
    compressed_vocab = max(token_map) + 1
    bound = (np.iinfo(np.int64).max // compressed_vocab) // 2
    mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer_id).integers(0, bound, size=n_max, dtype=np.int64)]
    used, primes = [], []
    for _ in range(layer_index + 1):
        primes = []
        for _ in orders:
            cur = table_size - 1
            for _ in range(heads):
                cur += 1
                while not _trial_prime(cur) or cur in used:
                    cur += 1
                used.append(cur)
                primes.append(cur)
    offsets = [sum(primes[:i]) for i in range(len(primes))]
    pad = token_map[pad_id]
    out = []
    for b in range(len(ids)):
        row = []
        for p in range(len(ids[b])):
            blocked, rolling, cols = False, 0, []
            for k in range(n_max):
                q = p - k
                if q < 0 or dead[b][q] or doc_ids[b][q] != doc_ids[b][p]:
                    blocked = True
                rolling ^= (pad if blocked else token_map[ids[b][q]]) * mult[k]
                if k > 0:
                    for h in range(heads):
                        t = (k - 1) * heads + h
                        cols.append(rolling % primes[t] + offsets[t])
            row.append(cols)
        out.append(row)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("layer_index", [0, 1])
def test_hash_matches_slow_reference(layer_index):
    cfg = tiny_config()
    token_map = [(t * 7) % 50 for t in range(cfg.vocab_size)]  # a many-to-one compression
    hasher = EngramHasher.from_config(cfg, token_map)
    ids, doc_ids, image = random_batch(3, 40, cfg.vocab_size, seed=layer_index)
    layer = cfg.engram_layers[layer_index]
    got = hasher(ids, layer, doc_ids, image)
    ref = slow_hash(ids.tolist(), doc_ids.tolist(), image.tolist(), token_map, layer, layer_index,
                    cfg.engram_ngram_orders, cfg.engram_num_heads, cfg.engram_table_size, cfg.engram_pad_id)
    assert torch.equal(got, ref)
    # Deterministic: a second hasher built from the same config agrees; the layers differ.
    assert torch.equal(EngramHasher.from_config(cfg, token_map)(ids, layer, doc_ids, image), got)
    other = cfg.engram_layers[1 - layer_index]
    assert not torch.equal(hasher(ids, other, doc_ids, image) - hasher.table_offsets(other)[0], got)


def test_hash_boundaries_and_dead_tokens():
    cfg = tiny_config()
    hasher = EngramHasher.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    doc = torch.tensor([[0] * 6 + [1] * 6])
    base = hasher(ids, 1)
    # A new document restarts the n-grams exactly like a new sequence does.
    split = hasher(ids, 1, doc)
    assert torch.equal(split[:, 6:], hasher(ids[:, 6:], 1))
    assert torch.equal(split[:, :6], base[:, :6])
    # Behind a dead token the history is the pad token: same as starting the sequence there.
    dead = torch.zeros(1, 12, dtype=torch.bool)
    dead[0, 4] = True
    masked = hasher(ids, 1, dead=dead)
    assert torch.equal(masked[:, 5:], hasher(ids[:, 5:], 1)[:, :])
    assert torch.equal(masked[:, :4], base[:, :4])


def test_ids_land_in_their_own_table():
    cfg = tiny_config()
    hasher = EngramHasher.from_config(cfg)
    ids, doc_ids, image = random_batch(4, 64, cfg.vocab_size, seed=7)
    for layer in cfg.engram_layers:
        got = hasher(ids, layer, doc_ids, image)
        lo = torch.tensor(hasher.table_offsets(layer))
        hi = lo + torch.tensor(hasher.table_sizes(layer))
        assert got.shape == (4, 64, cfg.engram_num_tables)
        assert ((got >= lo) & (got < hi)).all()
        assert int(hi[-1]) == hasher.num_rows(layer)


def test_compressed_token_map_validation_and_setter():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="compressed_token_map"):
        EngramHasher.from_config(cfg, [0] * 10)
    module = Engram(cfg, 1)
    ids, _, _ = random_batch(1, 10, cfg.vocab_size, seed=1)
    ctx = ForwardContext.create(ids, cfg.plan)
    plain = module.hash_ids(ctx)[0]
    token_map = [t // 2 for t in range(cfg.vocab_size)]
    module.set_compressed_token_map(token_map)
    assert torch.equal(module.hash_ids(ctx)[0], EngramHasher.from_config(cfg, token_map)(ids, 1))
    assert not torch.equal(module.hash_ids(ctx)[0], plain)


# ---- FP8 rows -----------------------------------------------------------------------------
def test_fp8_rows_error_bound_and_straight_through():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50).unsqueeze(1)
    x[:, :32] *= 100.0  # the two 32-channel blocks of a row get their own scales
    q = fake_quant_rows(x)
    blocks = x.view(50, 2, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448.0)))
    # E4M3: 3 mantissa bits -> relative error <= 2^-4 on normals, absolute <= 2^-10 * scale on subnormals.
    bound = torch.maximum(blocks.abs() * 2.0 ** -4, scale * 2.0 ** -10).view(50, 64)
    assert ((q - x).abs() <= bound).all()
    assert (q != x).any()
    # Values are E4M3 numbers times a power of two.
    vals = (q.view(50, 2, 32) / scale)
    assert torch.equal(vals.to(torch.float8_e4m3fn).float(), vals)
    # Straight-through gradient.
    xr = x.clone().requires_grad_(True)
    w = torch.randn(50, 64)
    (fake_quant_rows(xr) * w).sum().backward()
    assert torch.equal(xr.grad, w)
    # Rows narrower than a block (or not a multiple of 32) take one scale per row.
    narrow = torch.randn(6, 8)
    s = torch.exp2(torch.ceil(torch.log2(narrow.abs().amax(-1, keepdim=True) / 448.0)))
    assert torch.equal((fake_quant_rows(narrow) / s).to(torch.float8_e4m3fn).float(), fake_quant_rows(narrow) / s)


# ---- table --------------------------------------------------------------------------------
def test_table_init_is_layout_independent_and_pads_with_zeros():
    rows, width = 1000, 4
    init_full, init_shard = table_init(rows, 0.5, block_rows=96)
    full = torch.empty(padded_rows(rows), width)
    init_full(full, torch.Generator().manual_seed(11))
    assert full.shape == (1024, 4) and torch.equal(full[rows:], torch.zeros(24, 4))
    assert full[:rows].std().item() == pytest.approx(0.5, rel=0.1)
    for parts in (2, 4, 8):
        step = full.size(0) // parts
        for r in range(parts):
            local = torch.empty(step, width)
            init_shard(local, r * step, torch.Generator().manual_seed(11))
            assert torch.equal(local, full[r * step:(r + 1) * step])


def test_table_partition_metadata_and_single_process_lookup():
    table = EngramTable(1000, 8, Group(size=4, rank=2, ranks=(0, 1, 2, 3)))
    assert table.weight.shape == (256, 8) and table.first_row == 512
    spec: ShardSpec = shard_spec(table.weight)
    assert spec.full_shape == (1024, 8) and spec.splits == ((0, 2, 4),)
    assert table.num_rows == 1000
    with pytest.raises(ValueError, match="engram_parallel"):
        EngramTable(1000, 8, Group(size=3, rank=0, ranks=(0, 1, 2)))
    single = EngramTable(1000, 8)
    init_from_full(single.weight, "t", 0, lambda t, g: None)
    init_from_full(table.weight, "t", 0, lambda t, g: None)
    torch.testing.assert_close(table.weight, single.weight[512:768])
    ids = torch.randint(0, 1000, (3, 5, 2))
    torch.testing.assert_close(single(ids), F.embedding(ids, single.weight))


# ---- gate and module ----------------------------------------------------------------------
def test_gradcheck_gate():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(4, 8, generator=g, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: engram_gate(*a, 1e-20), (h, key, weight))


def make_engram(cfg: V41Config, layer: int = 1, seed: int = 0) -> Engram:
    module = Engram(cfg, layer)
    initialize_parameters(module, seed, cfg.init_std)
    return module


def test_gradcheck_module_in_float64():
    cfg = tiny_config(engram_fp8_tables=False, hidden_size=6, hc_mult=2, engram_dim_per_order=8, engram_table_size=7)
    module = make_engram(cfg).double()
    ids, doc_ids, image = random_batch(1, 5, cfg.vocab_size, seed=2)
    ctx = ForwardContext.create(ids, cfg.plan, doc_ids=doc_ids, image_mask=image)
    x = torch.randn(1, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    names = ["table.weight", "linear_kv.weight", "q_weight", "k_weight"]
    params = [dict(module.named_parameters())[n].detach().clone().requires_grad_(True) for n in names]

    def run(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, ctx))

    assert torch.autograd.gradcheck(run, (x, *params), fast_mode=True)


def test_gate_is_closed_by_the_image_mask():
    cfg = tiny_config()
    module = make_engram(cfg)
    ids, doc_ids, image = random_batch(2, 16, cfg.vocab_size, seed=5)
    image[0, :3] = True
    ctx = ForwardContext.create(ids, cfg.plan, doc_ids=doc_ids, image_mask=image)
    x = torch.randn(2, 16, cfg.hc_mult, cfg.hidden_size)
    out = module(x, ctx)
    assert torch.equal(out[image], x[image])
    assert ((out[~image] - x[~image]).abs().amax(-1) > 0).all()


def test_forward_matches_the_written_out_formula():
    cfg = tiny_config()
    module = make_engram(cfg)
    with torch.no_grad():
        module.q_weight.normal_(1.0, 0.3)
    ids, doc_ids, image = random_batch(2, 9, cfg.vocab_size, seed=6)
    ctx = ForwardContext.create(ids, cfg.plan, doc_ids=doc_ids, image_mask=image)
    x = torch.randn(2, 9, cfg.hc_mult, cfg.hidden_size)
    rows = fake_quant_rows(module.table.weight[module.hasher(ids, 1, doc_ids, image)])
    kv = rows.flatten(-2) @ module.linear_kv.weight.t()
    n, d = cfg.hc_mult, cfg.hidden_size
    key, value = kv[..., :n * d].view(2, 9, n, d), kv[..., n * d:]
    dot = (x * module.q_weight * module.k_weight * key).sum(-1)
    dot = dot / x.square().mean(-1).sqrt() / key.square().mean(-1).sqrt() / d ** 0.5
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt()) * (~image).unsqueeze(-1)
    torch.testing.assert_close(module(x, ctx), x + gate.unsqueeze(-1) * value.unsqueeze(-2))


def test_context_parallel_chunks_match_the_full_sequence():
    cfg = tiny_config()
    module = make_engram(cfg, layer=3)
    ids, doc_ids, image = random_batch(2, 16, cfg.vocab_size, seed=8)
    x = torch.randn(2, 16, cfg.hc_mult, cfg.hidden_size)
    full = module(x, ForwardContext.create(ids, cfg.plan, doc_ids=doc_ids, image_mask=image))
    pos = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]).expand(2, -1)  # a middle context-parallel chunk
    ctx = ForwardContext.create(ids.gather(1, pos), cfg.plan, positions=pos, doc_ids=doc_ids.gather(1, pos),
                                image_mask=image.gather(1, pos))
    ctx.full_input_ids, ctx.full_doc_ids = ids, doc_ids
    with pytest.raises(ValueError, match="full_image_mask"):
        module(x[:, 4:12], ctx)
    ctx.full_image_mask = image
    torch.testing.assert_close(module(x[:, 4:12], ctx), full[:, 4:12])


def test_rejects_a_layer_without_engram():
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(tiny_config(), 2)
