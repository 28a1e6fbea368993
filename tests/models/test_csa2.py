"""CSA2 attention (report §2.3): cross-layer KV and index reuse (§2.3.1), the hierarchical
sparse indexer (§2.3.2), causal visibility of compressed entries, document masks, causality
in every layer mode, and gradients of the custom pieces.

The dense reference below is written from the report, not from the layer: each query attends
in one softmax (with the per-head sink logit) to its sliding window and to every causally
complete compressed entry; the compressor pools m consecutive tokens with a per-channel
softmax gate, then RMSNorm and RoPE at the entry's first token position. With top-k at least
the number of visible entries, a CSA2 layer must equal it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.v41.layer_plan import CSA2Mode, SharedStateKind as K
from megatron_s2.kernels.sparse_attention import sparse_attention_reference
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.v41.attention import csa2 as csa2_module
from megatron_s2.models.v41.attention.candidates import select_candidate_blocks
from megatron_s2.models.v41.attention.compressor import pool_groups
from megatron_s2.models.v41.attention.csa2 import CSA2Attention
from megatron_s2.models.v41.attention.indexer import Indexer
from megatron_s2.models.v41.attention.visibility import compressed_visible, window_indices
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.rope import apply_rope, rope_frequencies
from megatron_s2.parallel.groups import Group, ParallelGroups

# ---- helpers ------------------------------------------------------------------------------------
def wide_topk(cfg, **extra):
    """The tiny plan with top-k (32) >= every visible entry count at s <= 32 and a candidate pool
    (9 blocks x 4 = 36) that covers every entry: selection can no longer drop anything."""
    return cfg.replace(index_topk=32, candidate_topk_blocks=9, **extra)


class Recorder:
    """While active (``with Recorder(model) as rec``): the KV array and index list every
    attention layer of ``model`` hands to the sparse-attention kernel, the number of entries each
    indexer scores per query, and every publish / consume on the registries of the contexts
    passed through ``watch``."""

    def __init__(self, model):
        self.model, self.window = model, model.config.window_size
        self.layer = None
        self.attn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scored: dict[int, list[int]] = {}
        self.published: dict[tuple[int, K], torch.Tensor] = {}
        self.consumed: list[tuple[int, int, K, torch.Tensor]] = []

    def __enter__(self):
        self.hooks = [block.attention.register_forward_pre_hook(self._enter) for block in self.model.layers.values()]
        self.real_attention, self.real_score = csa2_module.sparse_attention, Indexer.__dict__["_score"]
        real_attention, real_score = self.real_attention, self.real_score.__func__

        def attention_spy(q, kv, indices, sink, scale, **kw):
            self.attn[self.layer] = (kv.detach(), indices)
            return real_attention(q, kv, indices, sink, scale, **kw)

        def score_spy(q, k, w):
            self.scored.setdefault(self.layer, []).append(k.size(1) if k.dim() == 3 else k.size(2))
            return real_score(q, k, w)

        csa2_module.sparse_attention = attention_spy
        Indexer._score = staticmethod(score_spy)
        return self

    def __exit__(self, *exc):
        csa2_module.sparse_attention = self.real_attention
        Indexer._score = self.real_score
        for h in self.hooks:
            h.remove()

    def _enter(self, module, args):
        self.layer = module.spec.index

    def watch(self, ctx):
        publish, consume = ctx.shared.publish, ctx.shared.consume

        def publish_spy(producer, kind, value):
            self.published[(producer, kind)] = value
            publish(producer, kind, value)

        def consume_spy(consumer, producer, kind):
            value = consume(consumer, producer, kind)
            self.consumed.append((consumer, producer, kind, value))
            return value

        ctx.shared.publish, ctx.shared.consume = publish_spy, consume_spy
        return ctx

    def compressed_indices(self, layer: int) -> torch.Tensor:
        """The compressed-entry ids (-1 = none) a layer attended to, as entry numbers."""
        _, indices = self.attn[layer]
        sel = indices[..., self.window:]  # window slots first, then the top-k slots
        return torch.where(sel >= 0, sel - indices.size(1), -1)


def run_recorded(model, cfg, ids, make_ctx, doc_ids=None):
    with Recorder(model) as rec, torch.no_grad():
        logits = model(ids, rec.watch(make_ctx(cfg, ids, doc_ids)))
    return rec, logits


def as_sets(topk: torch.Tensor) -> list[list[set[int]]]:
    return [[set(row[row >= 0].tolist()) for row in batch] for batch in topk]


# ---- hand-written dense reference (float64) -------------------------------------------------------
class F64:
    """float64 leaf copies of module parameters, looked up by the original parameter."""

    def __init__(self, *modules, requires_grad: bool = False):
        self.map = {id(p): p.detach().double().requires_grad_(requires_grad)
                    for m in modules for p in m.parameters()}

    def __call__(self, p):
        return self.map[id(p)]


def _rms(t, w, eps):
    return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * w


def _rope(t, pos, inv_freq, inverse=False):
    """Adjacent channel pairs of the trailing 2*len(inv_freq) channels, rotated as complex
    numbers by pos * inv_freq (by -pos * inv_freq with ``inverse``)."""
    rd = 2 * inv_freq.numel()
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    rot = rot.view(ang.size(0), *([1] * (t.dim() - 3)), rd // 2)
    head, tail = t[..., :-rd], t[..., -rd:]
    z = torch.view_as_complex(tail.reshape(*tail.shape[:-1], rd // 2, 2).contiguous()) * rot
    return torch.cat([head, torch.view_as_real(z).flatten(-2)], -1)


def dense_main_kv(producer, src, P):
    """Compressed main KV of a Full layer from its compressor input — the layer's own
    normalised attention input, also for the CED decoder's Full layer (float64)."""
    cfg, m = producer.config, producer.spec.compress_ratio
    comp, eps = producer.compressor, cfg.norm_eps
    c = src @ P(comp.linear_kv.weight).T
    b, s, _ = c.shape
    n = s // m
    if m > 1:
        z = src @ P(comp.linear_gate.weight).T
        c = c[:, : n * m].reshape(b, n, m, -1)
        z = z[:, : n * m].reshape(b, n, m, -1)
        c = (c * z.softmax(dim=2)).sum(2)
    latent = _rms(c, P(comp.norm.weight), eps)
    return _rope(latent, torch.arange(n) * m, producer.inv_freq)


def dense_attention(attn, x, main, P, doc_ids=None):
    """Window ∪ all visible compressed entries, one softmax with the sink, dense (float64)."""
    cfg, eps = attn.config, attn.config.norm_eps
    b, s, _ = x.shape
    h, hd = cfg.num_attention_heads, cfg.head_dim
    pos = torch.arange(s)
    qr = _rms(x @ P(attn.linear_q_down.weight).T, P(attn.q_norm.weight), eps)
    q = _rope((qr @ P(attn.linear_q_up.weight).T).view(b, s, h, hd), pos, attn.inv_freq)
    win = _rope(_rms(x @ P(attn.linear_kv.weight).T, P(attn.kv_norm.weight), eps), pos, attn.inv_freq)
    t, u = pos[:, None], pos[None, :]
    allowed = ((t - u >= 0) & (t - u < cfg.window_size)).expand(b, s, s)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    keys = win
    if main is not None:
        m = attn.spec.compress_ratio
        j = torch.arange(main.size(1))[None, :]
        visible = (j < (t + 1) // m).expand(b, s, -1)
        if doc_ids is not None:
            visible = visible & (doc_ids[:, None, : main.size(1) * m: m] == doc_ids[:, :, None])
        allowed = torch.cat([allowed, visible], -1)
        keys = torch.cat([win, main], 1)
    logits = torch.einsum("bshd,bkd->bshk", q, keys) * hd ** -0.5
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    sink = P(attn.attn_sink).view(1, 1, h, 1).expand(b, s, h, 1)
    probs = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    o = _rope(torch.einsum("bshk,bkd->bshd", probs, keys), pos, attn.inv_freq, inverse=True)
    g, r = cfg.o_groups, cfg.o_lora_rank
    o = torch.einsum("bsgi,gri->bsgr", o.reshape(b, s, g, -1), P(attn.linear_out_a).view(g, r, -1)).flatten(2)
    return o @ P(attn.linear_out_b.weight).T


def attention_stack(cfg, seed=0):
    """All attention layers of ``cfg`` as standalone modules, random sinks, eval mode."""
    layers = {}
    for spec in cfg.plan:
        attn = CSA2Attention(cfg, spec, ParallelGroups.single())
        initialize_parameters(attn, seed + spec.index, cfg.init_std)
        with torch.no_grad():
            attn.attn_sink.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(100 + spec.index))
        layers[spec.index] = attn.eval()
    return layers


def run_stack(cfg, layers, xs, doc_ids=None):
    """Each layer on its own input, in plan order, sharing one context."""
    b, s, _ = xs[0].shape
    ctx = ForwardContext.create(torch.zeros(b, s, dtype=torch.long), cfg.plan, doc_ids=doc_ids)
    return {i: layers[i](xs[i], ctx) for i in sorted(layers)}


def reference_stack(cfg, layers, xs, P, doc_ids=None):
    out = {}
    for spec in cfg.plan:
        main = None
        if spec.is_csa2:  # every Full layer (the CED decoder's too) compresses its own input
            main = dense_main_kv(layers[spec.kv_source], xs[spec.kv_source].double(), P)
        out[spec.index] = dense_attention(layers[spec.index], xs[spec.index].double(), main, P, doc_ids)
    return out


def stack_inputs(cfg, b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {spec.index: torch.randn(b, s, cfg.hidden_size, generator=g) for spec in cfg.plan}


# ---- §2.3.1: Reuse and Reindex ---------------------------------------------------------------------
def test_reuse_layers_attend_with_exactly_their_sources_indices(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=1).eval()
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    rec, _ = run_recorded(model, tiny_cfg, ids, make_ctx)
    reuse = [s for s in tiny_cfg.plan if s.mode is CSA2Mode.REUSE]
    assert [s.index for s in reuse] == [2, 5, 7]
    for spec in reuse:
        i = spec.index
        assert torch.equal(rec.compressed_indices(i), rec.published[(spec.index_source, K.TOPK)]), i
        kv, _ = rec.attn[i]
        assert torch.equal(kv[:, ids.size(1):], rec.published[(spec.kv_source, K.MAIN_KV)]), i
        reads = {(p, k): v for c, p, k, v in rec.consumed if c == i}
        assert set(reads) == {(spec.kv_source, K.MAIN_KV), (spec.index_source, K.TOPK)}, i
        assert reads[(spec.kv_source, K.MAIN_KV)] is rec.published[(spec.kv_source, K.MAIN_KV)]
        assert reads[(spec.index_source, K.TOPK)] is rec.published[(spec.index_source, K.TOPK)]
        assert not any(p == i for p, _ in rec.published), f"Reuse layer {i} published a state"
        attn = model.layers[str(i)].attention
        assert attn.indexer is None and attn.compressor is None and attn.index_key is None
        assert i not in rec.scored, f"Reuse layer {i} evaluated index scores"


def test_reindex_rescoring_changes_indices_but_not_kv(tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=2).eval()
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    rec, _ = run_recorded(model, tiny_cfg, ids, make_ctx)
    for i in (3, 6):
        spec = tiny_cfg.plan[i]
        assert spec.mode is CSA2Mode.REINDEX
        src = spec.kv_source
        reads = {(p, k): v for c, p, k, v in rec.consumed if c == i}
        # main KV and index K: the very tensors the Full layer published ...
        assert reads[(src, K.MAIN_KV)] is rec.published[(src, K.MAIN_KV)]
        assert reads[(src, K.INDEX_K)] is rec.published[(src, K.INDEX_K)]
        kv, _ = rec.attn[i]
        assert torch.equal(kv[:, ids.size(1):], rec.published[(src, K.MAIN_KV)])
        attn = model.layers[str(i)].attention
        assert attn.compressor is None and attn.index_key is None and attn.indexer is not None
        # ... but its own top-k: published, attended with, and different from the source's
        own = rec.published[(i, K.TOPK)]
        assert torch.equal(rec.compressed_indices(i), own)
        mine, theirs = as_sets(own), as_sets(rec.published[(src, K.TOPK)])
        differ = sum(a != b for ra, rb in zip(mine, theirs) for a, b in zip(ra, rb))
        assert differ > 0, f"Reindex layer {i} selected exactly its source's entries for every query"
        # and every pick is a causally visible entry
        m = spec.compress_ratio
        limit = (torch.arange(ids.size(1)) + 1) // m
        assert bool(((own < limit.view(1, -1, 1)) | (own < 0)).all())


# ---- dense equivalence ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_comparison(tiny_cfg):
    """Every layer of the tiny plan (top-k covering everything) and its dense reference, on
    independent inputs, without and with documents of lengths 7, 10, 7 (odd boundaries)."""
    cfg = wide_topk(tiny_cfg, init_std=0.15)
    out = {}
    for docs, seed in ((None, 0), (torch.tensor([[0] * 7 + [1] * 10 + [2] * 7] * 2), 5)):
        layers = attention_stack(cfg, seed=seed)
        xs = stack_inputs(cfg, b=2, s=24, seed=seed)
        with torch.no_grad():
            got = run_stack(cfg, layers, xs, docs)
            want = reference_stack(cfg, layers, xs, F64(*layers.values()), docs)
        out[docs is not None] = (got, want)
    return out


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "three-documents"])
@pytest.mark.parametrize("layer, what", [
    (0, "swa"), (1, "full-enc-m2"), (2, "reuse-enc"), (3, "reindex-enc"),
    (4, "full-dec-m1-from-encoder-output"), (5, "reuse-dec"), (6, "reindex-dec-candidates"), (7, "reuse-dec")])
def test_topk_covering_everything_equals_dense_attention(dense_comparison, layer, what, documents):
    got, want = (d[layer] for d in dense_comparison[documents])
    assert want.abs().max() > 0.1  # a non-trivial output
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ---- §2.3.2: hierarchical sparse indexer -------------------------------------------------------------
def test_reindex_under_the_candidate_source_scores_a_constant_number_of_positions(
        tiny_cfg, make_model, make_ctx):
    model = make_model(tiny_cfg, seed=3).eval()  # eval: no alignment loss, only selection scores
    pool = tiny_cfg.candidate_pool_size
    assert pool == 12
    counts = {}
    for s in (32, 64):
        ids = torch.randint(0, tiny_cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(s))
        rec, _ = run_recorded(model, tiny_cfg, ids, make_ctx)
        counts[s] = {i: set(v) for i, v in rec.scored.items()}
        for i in rec.scored:
            assert model.layers[str(i)].attention.last_scored_per_query in counts[s][i]
        # candidate source: pool of whole blocks over its own visible entries; Reindex picks within it
        cands, picks = rec.published[(4, K.CANDIDATES)], rec.published[(6, K.TOPK)]
        assert cands.shape == (1, s, pool)
        bs, top_blocks = tiny_cfg.candidate_block_size, tiny_cfg.candidate_topk_blocks
        for t in range(s):
            c = set(cands[0, t][cands[0, t] >= 0].tolist())
            blocks = {j // bs for j in c}
            assert len(blocks) <= top_blocks and t // bs in blocks, t  # the newest block is pinned
            # every visible entry (m = 1: positions <= t) of a chosen block, and nothing else
            assert c == {j for blk in blocks for j in range(blk * bs, blk * bs + bs) if j <= t}, t
            assert set(picks[0, t][picks[0, t] >= 0].tolist()) <= c, t
    assert counts[32] == {1: {16}, 3: {16}, 4: {32}, 6: {pool}}
    assert counts[64] == {1: {32}, 3: {32}, 4: {64}, 6: {pool}}


def test_candidate_blocks_hand_computed():
    """Block maxima [5, 1, 4]; the newest visible entry (9) pins its block; invisible -> -1."""
    inf = float("inf")
    scores = torch.tensor([[[0.1, 5.0, 0.2, 0.3, 1.0, 1.0, 1.0, 1.0, 0.5, 4.0, -inf, -inf]]])
    ids = select_candidate_blocks(scores, torch.tensor([[9]]), ratio=1, top_blocks=2, block_size=4)
    assert ids.tolist() == [[[8, 9, -1, -1, 0, 1, 2, 3]]]
    # more blocks asked for than exist: padded with -1
    ids = select_candidate_blocks(scores, torch.tensor([[9]]), ratio=1, top_blocks=4, block_size=4)
    assert ids.shape == (1, 1, 16) and sorted(ids[0, 0].tolist())[-10:] == list(range(10))


# ---- visibility -------------------------------------------------------------------------------------
def test_compressed_entry_visible_only_once_its_group_is_complete():
    vis = compressed_visible(torch.arange(10).view(1, -1), ratio=4, num_entries=3)
    assert vis.sum(-1).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    assert vis[0, 3].tolist() == [True, False, False]  # entry 0 = tokens 0..3, complete at 3
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    vis = compressed_visible(torch.arange(10).view(1, -1), 2, 5, doc, doc[:, ::2])
    # entry 1 (tokens 2, 3) starts in document 0: never visible to document 1's queries
    assert vis[0, 2].tolist() == [True, False, False, False, False]
    assert vis[0, 9].tolist() == [False, False, True, True, True]


def test_window_indices_hand_computed():
    pos = torch.arange(6).view(1, -1)
    idx = window_indices(pos, pos, 3)
    assert idx[0, 0].tolist() == [0, -1, -1] and idx[0, 4].tolist() == [4, 3, 2]
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert window_indices(pos, pos, 3, doc, doc)[0, 4].tolist() == [4, 3, -1]


@pytest.mark.parametrize("s", [24, 25])
def test_full_layer_attends_to_exactly_the_complete_groups(tiny_cfg, make_model, make_ctx, s):
    cfg = wide_topk(tiny_cfg)
    model = make_model(cfg, seed=4).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(2))
    rec, _ = run_recorded(model, cfg, ids, make_ctx)
    assert rec.published[(1, K.MAIN_KV)].size(1) == s // 2  # a trailing half group makes no entry
    for i in (1, 4):
        m = cfg.plan[i].compress_ratio
        for t, picked in enumerate(as_sets(rec.compressed_indices(i))[0]):
            assert picked == set(range((t + 1) // m)), (i, t)


# ---- document masks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("boundary", [17, 20])
def test_no_attention_across_documents(tiny_cfg, make_model, make_ctx, boundary):
    cfg = tiny_cfg
    model = make_model(cfg, seed=5).eval()
    g = torch.Generator().manual_seed(boundary)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    doc = (torch.arange(40) >= boundary).long().expand(2, 40)
    other = ids.clone()
    other[:, :boundary] = torch.randint(0, cfg.vocab_size, (2, boundary), generator=g)
    with torch.no_grad():
        a = model(ids, make_ctx(cfg, ids, doc))
        b = model(other, make_ctx(cfg, other, doc))
    assert (a[:, :boundary] - b[:, :boundary]).abs().max() > 1e-2
    torch.testing.assert_close(a[:, boundary:], b[:, boundary:], atol=1e-5, rtol=0)


# ---- causality --------------------------------------------------------------------------------------
CAUSAL_T = (7, 12, 25, 33)  # odd and even positions: last and first token of an m=2 group


def _perturbed(ids, t):
    p = ids.clone()
    p[:, t] = (p[:, t] + 1 + torch.arange(ids.size(0))) % 128
    return p


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("quant", [False, True], ids=["fp32-kv", "fp4-fp8-qat"])
def test_model_is_causal(tiny_cfg, make_model, make_ctx, mode, quant):
    cfg = tiny_cfg.replace(fp4_main_kv=True, fp8_swa_kv=True, fp4_indexer=True) if quant else tiny_cfg
    model = make_model(cfg, seed=6).train(mode == "train")
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(ids, make_ctx(cfg, ids))
        for t in CAUSAL_T:
            p = _perturbed(ids, t)
            out = model(p, make_ctx(cfg, p))
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-5, rtol=0, msg=f"token {t}")
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-3  # the perturbation does something


@pytest.fixture(scope="module")
def per_layer_outputs(tiny_cfg):
    """Attention output of every layer of the tiny model for the base ids and for each
    perturbation in CAUSAL_T (train mode, so the indexer alignment path runs too)."""
    from megatron_s2.models.v41.context import ForwardContext
    from megatron_s2.models.v41.model import build_model

    model = build_model(tiny_cfg, seed=7).train()
    seen: dict[int, torch.Tensor] = {}
    for i, block in model.layers.items():
        block.attention.register_forward_hook(lambda mod, args, out, i=int(i): seen.__setitem__(i, out))
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    runs = {}
    with torch.no_grad():
        for t in (None,) + CAUSAL_T:
            x = ids if t is None else _perturbed(ids, t)
            model(x, ForwardContext.create(x, tiny_cfg.plan))
            runs[t] = dict(seen)
    return runs


@pytest.mark.parametrize("layer, what", [
    (0, "swa"), (1, "full-enc-m2"), (2, "reuse-enc"), (3, "reindex-enc"),
    (4, "full-dec-m1"), (5, "reuse-dec"), (6, "reindex-dec-candidates"), (7, "reuse-dec")])
def test_each_attention_layer_is_causal(per_layer_outputs, layer, what):
    base = per_layer_outputs[None][layer]
    for t in CAUSAL_T:
        out = per_layer_outputs[t][layer]
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-5, rtol=0, msg=f"{what}: token {t}")
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4


# ---- gradients -----------------------------------------------------------------------------------------
def _attention_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 2, 6, generator=g, dtype=dtype)
    kv = torch.randn(1, 5, 6, generator=g, dtype=dtype)
    sink = torch.randn(2, generator=g, dtype=dtype)
    idx = torch.tensor([[[0, -1, -1], [1, 0, -1], [2, 4, 0], [-1, 3, 1]]])
    return q, kv, sink, idx


def _attention_dense(q, kv, sink, idx, scale):
    mask = torch.zeros(*idx.shape[:2], kv.size(1), dtype=torch.bool)
    for b, s, k in (idx >= 0).nonzero().tolist():
        mask[b, s, idx[b, s, k]] = True
    logits = torch.einsum("bshd,bnd->bshn", q, kv) * scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.cat([logits, sink.view(1, 1, -1, 1).expand(*logits.shape[:3], 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("bshn,bnd->bshd", probs, kv)


def test_gradcheck_sparse_attention_with_sink():
    q, kv, sink, idx = (t.requires_grad_() if t.is_floating_point() else t for t in _attention_inputs(torch.float64))
    torch.autograd.gradcheck(lambda q, kv, s: sparse_attention_reference(q, kv, idx, s, 0.4)[0], (q, kv, sink))


def test_sparse_attention_gradients_match_dense_float64():
    """Until float64 runs in float64: float32 autograd against the dense float64 formula."""
    q, kv, sink, idx = _attention_inputs(torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    refs = [t.double().requires_grad_() for t in (q, kv, sink)]
    g = torch.randn(1, 4, 2, 6, generator=torch.Generator().manual_seed(1))
    out, _ = sparse_attention_reference(*leaves[:2], idx, leaves[2], 0.4, chunk=3)  # two chunks
    ref = _attention_dense(*refs[:2], refs[2], idx, 0.4)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    (out * g).sum().backward()
    (ref * g.double()).sum().backward()
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-6, rtol=1e-5)


def test_sparse_attention_without_sink_and_no_entries_is_zero_with_finite_grads():
    q, kv, _, idx = _attention_inputs(torch.float32)
    idx = idx.clone()
    idx[0, 0] = -1  # query 0 reads nothing
    q.requires_grad_(), kv.requires_grad_()
    out, mass = sparse_attention_reference(q, kv, idx, None, 0.4, split=1)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert mass.shape == (1, 4, 2) and not mass.requires_grad


def test_gradcheck_compressor_pooling():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(1, 7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    gate = torch.randn(1, 7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: pool_groups(a, b, 3), (kv, gate))


def test_compressor_pooling_gradients_match_float64_formula():
    g = torch.Generator().manual_seed(0)
    kv, gate = torch.randn(2, 7, 4, generator=g), torch.randn(2, 7, 4, generator=g)
    leaves = [kv.clone().requires_grad_(), gate.clone().requires_grad_()]
    refs = [kv.double().requires_grad_(), gate.double().requires_grad_()]
    out = pool_groups(*leaves, 3)
    assert out.shape == (2, 2, 4)  # 7 tokens, m=3: the trailing token forms no entry
    c, z = refs[0][:, :6].reshape(2, 2, 3, 4), refs[1][:, :6].reshape(2, 2, 3, 4)
    ref = (c * z.exp() / z.exp().sum(2, keepdim=True)).sum(2)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    w = torch.randn(2, 2, 4, generator=g)
    (out * w).sum().backward()
    (ref * w.double()).sum().backward()
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(leaves[0].grad[:, 6], torch.zeros(2, 4))  # the incomplete group gets nothing


def test_gradcheck_rope():
    inv = rope_frequencies(4, 100.0)
    x = torch.randn(1, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 5, 17]])
    torch.autograd.gradcheck(lambda x: apply_rope(x, pos, inv), (x,))


def test_rope_is_a_rotation_its_inverse_undoes_it_and_its_gradient_is_the_inverse():
    inv = rope_frequencies(8, 10000.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 12, generator=g, requires_grad=True)
    pos = torch.randint(0, 1000, (2, 5), generator=g)
    y = apply_rope(x, pos, inv)
    assert torch.equal(y[..., :4], x[..., :4])  # only the trailing rope channels rotate
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(y, pos, inv, inverse=True), x, atol=1e-5, rtol=0)
    # vjp of a rotation is the inverse rotation
    w = torch.randn_like(y)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, apply_rope(w, pos, inv, inverse=True), atol=1e-6, rtol=0)
    # against the complex-number formula (positions shared by the batch)
    p = torch.arange(5) * 7
    torch.testing.assert_close(apply_rope(x.detach(), p.expand(2, 5), inv).double(),
                               _rope(x.detach().double(), p, inv), atol=1e-5, rtol=0)


def test_gradcheck_indexer_alignment_loss(tiny_cfg):
    indexer = Indexer(tiny_cfg, Group.single())
    g = torch.Generator().manual_seed(0)
    b, s, h, d, n, k = 1, 3, 2, 4, 5, 3
    q = torch.randn(b, s, h, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(b, s, h, dtype=torch.float64, generator=g, requires_grad=True)
    keys = torch.randn(b, n, d, dtype=torch.float64, generator=g, requires_grad=True)
    topk = torch.tensor([[[0, -1, -1], [1, 0, -1], [4, 2, 3]]])
    mass = torch.rand(b, s, k, dtype=torch.float64, generator=g)
    logits = torch.einsum("bshd,bnd->bshn", q, keys)
    assert logits.abs().min() > 1e-3  # away from the ReLU kink

    def loss(q, w, keys):
        kl, count = indexer.alignment_loss(q, w, keys, topk, mass)
        assert count.item() == 3
        return kl

    assert torch.autograd.gradcheck(loss, (q, w, keys))
    # a query with a single selected entry has KL 0 whatever its scores
    kl1, _ = indexer.alignment_loss(q[:, :1], w[:, :1], keys, topk[:, :1], mass[:, :1])
    assert kl1.abs().item() < 1e-12


def _small_layer_cfg(tiny_cfg):
    return tiny_cfg.replace(hidden_size=16, q_lora_rank=8, head_dim=16, num_attention_heads=2, o_groups=1,
                            o_lora_rank=4, window_size=3, rope_head_dim=4, index_head_dim=8, index_num_heads=2,
                            index_topk=32, candidate_topk_blocks=9, engram_layers=(), init_std=0.3)


def test_gradcheck_csa2_layer(tiny_cfg, make_attention, make_ctx):
    cfg = _small_layer_cfg(tiny_cfg)
    attn = make_attention(cfg, 1).double().eval()
    with torch.no_grad():
        attn.attn_sink.normal_()
    ids = torch.zeros(1, 4, dtype=torch.long)
    x = torch.randn(1, 4, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: attn(x, make_ctx(cfg, ids)), (x,), fast_mode=True)


@pytest.mark.parametrize("layer", [1, 4], ids=["full-enc-m2", "full-dec-m1-ced"])
def test_csa2_layer_gradients_match_dense_float64(tiny_cfg, make_attention, make_ctx, layer):
    """Whole-layer gradients (input and every weight) against autograd through the dense
    float64 formula, with FP quantisation off and top-k covering every entry. Layer 4 is the
    CED decoder's Full layer: its compressor reads its own (normalised) input, H_{L/2}."""
    cfg = _small_layer_cfg(tiny_cfg)
    attn = make_attention(cfg, layer).eval()
    with torch.no_grad():
        attn.attn_sink.normal_(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(2, 10, cfg.hidden_size, generator=g, requires_grad=True)
    ctx = make_ctx(cfg, torch.zeros(2, 10, dtype=torch.long))
    out = attn(x, ctx)
    P = F64(attn, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    main = dense_main_kv(attn, x64, P)
    ref = dense_attention(attn, x64, main, P)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)
    for name, p in attn.named_parameters():
        if name.startswith(("indexer.", "index_key.")):
            # top-k selection carries no gradient; the indexer learns from its alignment loss
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.double(), P(p).grad, atol=1e-5, rtol=1e-4, msg=name)


def test_ced_decoder_compresses_attn_norm_of_the_encoder_output(tiny_cfg, make_model):
    """CED as released (§2.2, Eq. 1): the decoder's Full layer (layer 4, the first decoder
    layer) compresses attn_norm(H_{L/2}), H_{L/2} = the encoder's final streams collapsed with
    the encoder's last mix (Single-Pass mHC) — through its own attn_norm, no other norm."""
    from megatron_s2.models.v41.mhc import collapse

    model = make_model(tiny_cfg, seed=3).eval()
    enc, dec = tiny_cfg.plan.last_encoder_layer, tiny_cfg.num_encoder_layers
    assert tiny_cfg.plan[dec].uses_encoder_output and not tiny_cfg.plan[dec].has_engram
    seen = {}
    model.layers[str(enc)].register_forward_hook(lambda m, a, out: seen.__setitem__("encoder", out))
    compressor = model.layers[str(dec)].attention.compressor
    original = compressor.project  # a method, not a module call: wrap it to see its input
    compressor.project = lambda x: (seen.__setitem__("input", x), original(x))[1]
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        x, pre = seen["encoder"]
        expected = model.layers[str(dec)].attn_norm(collapse(x, pre))
    assert torch.equal(seen["input"], expected)
    assert not any("input_norm" in name for name, _ in model.named_parameters())


# recompute mode -> (selective_recompute, attention_chunk_rows, sparse_attention calls (query rows))
RECOMPUTE_MODES = {
    "none": (False, None, [20]),                            # one pass, nothing recomputed
    "selective": (True, None, [20, 20]),                    # one chunk, recomputed in backward
    "selective-chunks3": (True, 3, [2] * 2 + [3] * 12),     # 7 chunks, each recomputed once
}


def _layer_step(cfg, make_attention, make_ctx, layer, selective, rows, x0, w, docs):
    attn = make_attention(cfg, layer).train()
    attn.selective_recompute, attn.attention_chunk_rows = selective, rows
    with torch.no_grad():
        attn.attn_sink.normal_(generator=torch.Generator().manual_seed(0))
    x = x0.clone().requires_grad_()
    ctx = make_ctx(cfg, torch.zeros(2, 20, dtype=torch.long), docs)
    calls = []
    real = csa2_module.sparse_attention

    def counting(*args, **kw):
        calls.append(args[0].size(1))
        return real(*args, **kw)

    csa2_module.sparse_attention = counting
    try:
        out = attn(x, ctx)
        aux = ctx.total_aux_loss()
        ((out * w).sum() + aux).backward()
    finally:
        csa2_module.sparse_attention = real
    grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.detach(), aux.detach(), x.grad, grads, calls


@pytest.mark.parametrize("mode", ["selective", "selective-chunks3"])
@pytest.mark.parametrize("layer", [1, 4], ids=["full-enc-m2", "full-dec-m1-ced"])
def test_selective_recompute_in_query_chunks_equals_no_recompute(tiny_cfg, make_attention, make_ctx, layer, mode):
    """``parallel.recompute: selective`` runs the attention core (and the indexer's alignment
    scores) in query chunks, each checkpointed and recomputed in backward
    (``CSA2Attention.attend``); without recomputation all queries run in one pass. Both must
    give the output, the indexer loss and every gradient, with top-k selection active and a
    document boundary inside a chunk; the call counts show which path ran."""
    cfg = _small_layer_cfg(tiny_cfg).replace(index_topk=3)
    g = torch.Generator().manual_seed(layer)
    x0 = torch.randn(2, 20, cfg.hidden_size, generator=g)
    w = torch.randn(2, 20, cfg.hidden_size, generator=g)
    docs = torch.tensor([[0] * 8 + [1] * 12, [0] * 20])
    results = {}
    for name in ("none", mode):
        selective, rows, expected_calls = RECOMPUTE_MODES[name]
        results[name] = _layer_step(cfg, make_attention, make_ctx, layer, selective, rows, x0, w, docs)
        assert sorted(results[name][4]) == expected_calls, name
    out1, aux1, gx1, gp1, _ = results["none"]
    out2, aux2, gx2, gp2, _ = results[mode]
    assert aux1.item() > 0
    torch.testing.assert_close(out2, out1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(aux2, aux1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx2, gx1, atol=1e-6, rtol=1e-5)
    assert gp2.keys() == gp1.keys() and any(n.startswith("indexer.") for n in gp1)
    for name in gp1:
        torch.testing.assert_close(gp2[name], gp1[name], atol=1e-6, rtol=1e-5, msg=name)


def test_model_selective_recompute_reaches_attention_and_matches(tiny_cfg, make_model):
    """``V41Model.set_recompute("selective")`` (what ``parallel.recompute: selective`` sets)
    switches every attention layer to the recomputed core: the whole tiny model's loss and
    gradients equal those without recomputation, and each layer's core runs twice (forward
    and its recomputation in backward) instead of once."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, tiny_cfg.vocab_size, (2, 32), generator=g)
    results = {}
    for mode in ("none", "selective"):
        model = make_model(tiny_cfg).train()
        model.set_recompute(mode)
        calls = []
        real = csa2_module.sparse_attention
        csa2_module.sparse_attention = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            loss = model(ids, labels=labels).mean()
            loss.backward()
        finally:
            csa2_module.sparse_attention = real
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (loss.detach(), grads, len(calls))
    (l1, g1, n1), (l2, g2, n2) = results["none"], results["selective"]
    assert n1 == tiny_cfg.num_layers and n2 == 2 * n1
    torch.testing.assert_close(l2, l1, atol=1e-6, rtol=1e-6)
    assert g2.keys() == g1.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-5, msg=name)
