"""KV in the report's storage formats (§2.4.4, §3.2.1): packed bytes, not fake-quantised floats.

* Unpacking what was packed reproduces the training forward's fake quantisers bit for bit
  (main KV FP4 E2M1 + E4M3/16, index K MXFP4, SWA KV FP8 + E8M0/32).
* Bytes of global KV per token of context, measured from the allocated page buffers, equal
  ``megatron-s2 account``'s ``global_kv_bytes_per_token`` (flagship: the report's 890), and
  one request's SWA slot equals the accountant's SWA state.
* A request holds exactly its pages: ceil(tokens / page) pages of that many bytes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.kernels.kv_formats import VectorFormat
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.models.v41.inference.runner import ForwardRow, ModelRunner
from megatron_s2.models.v41.accounting import account
from megatron_s2.models.v41.model import build_model
from megatron_s2.kernels.quantize import fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4
from tests.inference.conftest import quantised
from tests.models.conftest import load_model_recipe

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, fake", [("fp4_e4m3", fake_quant_fp4_e4m3), ("mxfp4", fake_quant_mxfp4),
                                        ("fp8", fake_quant_fp8)])
def test_unpacked_values_are_the_fake_quantised_values(name, fake):
    g = torch.Generator().manual_seed(0)
    fmt = VectorFormat(name, 64)
    for scale in (1e-3, 0.02, 1.0, 30.0, 2000.0):  # subnormal scales to saturation
        x = torch.randn(2000, 64, generator=g) * scale * torch.rand(2000, 1, generator=g)
        assert torch.equal(fmt.unpack(fmt.pack(x)), fake(x)), scale
    assert fmt.bytes_per_vector == {"fp4_e4m3": 32 + 4, "mxfp4": 32 + 2, "fp8": 64 + 2}[name]


@pytest.mark.parametrize("model", ["tiny", "small", "flagship"])
def test_measured_kv_bytes_equal_the_accountant(model):
    cfg = quantised(load_model_recipe(model))
    figures = account(cfg)
    store = GlobalKVStore(cfg, num_pages=3, page_tokens=16, device=CPU)
    assert store.bytes_per_token() == figures["global_kv_bytes_per_token"]
    if model == "flagship":
        assert store.bytes_per_token() == 890  # report abstract
    swa = SWAStore(cfg, num_slots=2, device=CPU)
    assert swa.bytes_per_slot() == figures["swa_state_bytes_per_request"]


def test_unquantised_caches_store_float32(tiny_cfg):
    cfg = quantised(tiny_cfg, False)
    store = GlobalKVStore(cfg, num_pages=2, page_tokens=8, device=CPU)
    full = [s for s in cfg.plan if s.computes_main_kv]
    per_token = sum(4 * (cfg.head_dim + cfg.index_head_dim) / s.compress_ratio for s in full)
    assert store.bytes_per_token() == per_token
    assert SWAStore(cfg, 1, CPU).bytes_per_slot() == cfg.num_layers * cfg.window_size * 4 * cfg.head_dim


def test_a_request_holds_exactly_its_pages(tiny_cfg):
    cfg = quantised(tiny_cfg)
    model = build_model(cfg, seed=0).eval()
    gkv, swa = GlobalKVStore(cfg, 16, 8, CPU), SWAStore(cfg, 1, CPU)
    runner = ModelRunner(model, gkv, swa)
    seq = SequenceKV(swa.allocate())
    tokens = list(range(5, 5 + 24))
    runner.forward([ForwardRow(seq, tokens[:20], 0, [])])
    for t in range(20, 24):
        runner.forward([ForwardRow(seq, tokens[t:t + 1], t, tokens[:t])])
    assert len(seq.pages) == 3 and gkv.pool.num_free == 16 - 1 - 3
    page_bytes = gkv.buffer_bytes() / gkv.num_pages
    assert len(seq.pages) * page_bytes / len(tokens) == account(cfg)["global_kv_bytes_per_token"]


@pytest.mark.parametrize("fp4", [True, False])
def test_a_decode_step_unpacks_only_the_selected_entries(tiny_cfg, fp4):
    """PagedEntries (a decode step's main KV, left in its pages) hands back, for a top-k
    selection, exactly the rows of the whole read at those ids, in order; -1 stays -1."""
    from megatron_s2.models.v41.inference.kv_step import PagedEntries

    cfg = quantised(tiny_cfg, fp4)
    store = GlobalKVStore(cfg, num_pages=6, page_tokens=8, device=CPU)
    layer = next(iter(store.layers))
    geo = store.layers[layer]
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[1, 3, 4], [2, 5, 0]])  # the second row holds two pages, padded with page 0
    pages = torch.arange(1, 6).repeat_interleave(geo.entries_per_page)
    slots = torch.arange(geo.entries_per_page).repeat(5)
    store.write(layer, pages, slots, torch.randn(pages.numel(), cfg.head_dim, generator=g),
                torch.randn(pages.numel(), cfg.index_head_dim, generator=g))
    whole = store.read_main(layer, table)
    entries = PagedEntries(store, layer, table)
    assert entries.size(1) == whole.size(1)
    n = 2 * geo.entries_per_page
    topk = torch.stack([torch.randperm(n, generator=g)[:5], torch.randperm(n, generator=g)[:5]]).unsqueeze(1)
    topk[1, 0, 3:] = -1
    keys, ids = entries.select(topk)
    assert torch.equal(ids, torch.where(topk >= 0, torch.arange(5), -1))
    for b in range(2):
        for j in range(5):
            if topk[b, 0, j] >= 0:
                assert torch.equal(keys[b, j], whole[b, topk[b, 0, j]])
    assert entries.select(topk)[0] is keys  # a Reuse layer's same top-k: no second gather
