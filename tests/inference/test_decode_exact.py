"""Exactness of incremental decode (report §2.2–2.4, §3.2): chunked prefill + one-token
decode through the KV cache gives the logits of the whole-sequence forward at every
position, for every layer mode (SWA, Full / Reindex / Reuse at m = 2 and m = 1, the CED
decoder's KV from H_{L/2}, the hierarchical candidate pool, attention sinks, Engram across
the chunk boundary, MoE), across compressor block boundaries, window wrap-around and page
boundaries, with the packed storage formats on and off, for batches of requests with
different prompt lengths joining and leaving. Tolerance: 1e-5 of the largest logit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.v41.config import LayerGroupSpec
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.models.v41.inference.runner import ForwardRow, ModelRunner
from megatron_s2.models.v41.attention.selection import topk_newest_on_ties
from megatron_s2.models.v41.model import build_model
from tests.inference.conftest import quantised

RTOL = 1e-5


def incremental(model, seqs, prompt_lens, chunk, page_tokens=8, record_topk=False):
    """Prefill each prompt in chunks, then one token per step, all requests in one batch;
    returns per request the logits of every position (and the recorded top-k)."""
    cfg = model.config
    gkv = GlobalKVStore(cfg, 64, page_tokens, torch.device("cpu"))
    swa = SWAStore(cfg, len(seqs), torch.device("cpu"))
    runner = ModelRunner(model, gkv, swa)
    states = [SequenceKV(swa.allocate()) for _ in seqs]
    done, logits, topk = [0] * len(seqs), [[] for _ in seqs], [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        rows, who = [], []
        for i, (s, d) in enumerate(zip(seqs, done)):
            if d < len(s):
                n = min(chunk, prompt_lens[i] - d) if d < prompt_lens[i] else 1
                rows.append(ForwardRow(states[i], s[d:d + n], d, s[:d], logits="all"))
                who.append(i)
        for i, row, out in zip(who, rows, runner.forward(rows, record_topk=record_topk)):
            logits[i].append(out.logits)
            topk[i].append(out.topk)
            done[i] += len(row.tokens)
    return [torch.cat(x) for x in logits], topk


def random_tokens(cfg, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def two_ratio_variant(cfg):
    """m = 4 in the encoder, m = 2 in the decoder (candidate pool over m = 2 entries), top-k 3."""
    return cfg.replace(layer_groups=(LayerGroupSpec(("swa",)), LayerGroupSpec(("full", "reuse", "reindex"), 1, 4),
                                     LayerGroupSpec(("full", "reuse", "reindex", "reuse"), 1, 2)),
                       index_topk=3, candidate_topk_blocks=2, candidate_block_size=2)


@pytest.mark.parametrize("quant", [False, True], ids=["float-kv", "packed-kv"])
@pytest.mark.parametrize("variant", ["tiny", "m4-m2"])
def test_incremental_decode_equals_the_full_forward(tiny_cfg, variant, quant):
    cfg = quantised(tiny_cfg if variant == "tiny" else two_ratio_variant(tiny_cfg), quant)
    torch.manual_seed(0)
    model = build_model(cfg, seed=3).eval()
    seqs = random_tokens(cfg, [37, 26, 15], seed=4)  # > 4 windows of 8, pages of 8, odd lengths
    got, _ = incremental(model, seqs, prompt_lens=[13, 19, 5], chunk=6)
    for s, inc in zip(seqs, got):
        with torch.no_grad():
            ref = model(torch.tensor([s]))[0]
        assert inc.shape == ref.shape
        err = (inc - ref).abs().max() / ref.abs().max()
        assert err <= RTOL, f"max |decode - forward| / max |forward| = {err:.2e}"


def test_decode_selects_the_same_entries_as_the_full_forward(tiny_cfg):
    """Top-k decisions first: every indexing layer picks the same entry set per token."""
    from tests.models.test_csa2 import Recorder

    cfg = quantised(tiny_cfg)
    model = build_model(cfg, seed=5).eval()
    seqs = random_tokens(cfg, [30], seed=6)
    _, topk = incremental(model, seqs, prompt_lens=[11], chunk=4, record_topk=True)
    with Recorder(model) as rec, torch.no_grad():
        model(torch.tensor(seqs))
    layers = sorted(topk[0][0])
    assert layers == [1, 3, 4, 6]
    for layer in layers:
        mine = torch.cat([step[layer] for step in topk[0]])
        theirs = rec.compressed_indices(layer)[0]
        for t in range(mine.size(0)):
            assert set(mine[t][mine[t] >= 0].tolist()) == set(theirs[t][theirs[t] >= 0].tolist()), (layer, t)


def test_tie_break_keeps_the_newer_entry_whatever_follows():
    scores = torch.tensor([[0.5, 0.0, 0.0, 0.7, 0.0, 0.0]])
    values, idx = topk_newest_on_ties(scores, 3)
    assert idx.tolist() == [[3, 0, 5]] and torch.equal(values, scores[:, [3, 0, 5]])
    assert topk_newest_on_ties(scores, 5)[1].tolist() == [[3, 0, 5, 4, 2]]
    longer = torch.cat([scores, torch.full((1, 5), float("-inf"))], dim=1)  # invisible entries follow
    assert torch.equal(topk_newest_on_ties(longer, 3)[1], idx)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, generator=g)  # no ties: the same set and order as torch.topk
    assert torch.equal(topk_newest_on_ties(x, 7)[1], x.topk(7).indices)
    t = (torch.randn(3, 5, 40, generator=g) * 2).round().to(torch.bfloat16)  # many ties: a stable sort
    ref = torch.sort(t.float().flip(-1), dim=-1, descending=True, stable=True).indices[..., :9]
    assert torch.equal(topk_newest_on_ties(t, 9)[1], 39 - ref)
