"""The per-layer CSA2 plan (report §2.2, §2.3.1, §2.3.2, §4.2.1) derived from V41Config.

* the flagship recipe reproduces §4.2.1 exactly, layer by layer;
* impossible plans are ConfigErrors that name the problem, never silently adjusted;
* ``LayerPlan.crossing(cut)`` lists exactly the shared states a pipeline cut must carry.
"""

from __future__ import annotations

import pytest

from megatron_s2.models.v41.layer_plan import CSA2Mode, SharedStateKind as K
from megatron_s2.models.v41.config import LayerGroupSpec
from megatron_s2.config.schema import ConfigError

FULL, REINDEX, REUSE, SWA = CSA2Mode.FULL, CSA2Mode.REINDEX, CSA2Mode.REUSE, CSA2Mode.SWA


# ---- flagship: §4.2.1 ----------------------------------------------------------------------
def test_flagship_modes_match_section_4_2_1(flagship_cfg):
    plan = flagship_cfg.plan
    assert len(plan) == 40 and plan.num_encoder_layers == 20
    expected = {}
    for i in range(40):
        expected[i] = REUSE
    expected.update({0: SWA, 1: SWA, 2: FULL, 8: FULL, 14: FULL, 20: FULL,
                     24: REINDEX, 28: REINDEX, 32: REINDEX, 36: REINDEX})
    assert {s.index: s.mode for s in plan} == expected
    # "The remaining 18 encoder layers use CSA2 with m = 2 ... the 20 decoder layers m = 1."
    for s in plan:
        assert s.is_encoder == (s.index < 20)
        assert s.compress_ratio == (0 if s.index < 2 else 2 if s.index < 20 else 1), s.index


def test_flagship_producer_links(flagship_cfg):
    plan = flagship_cfg.plan
    for s in plan:
        if s.mode is SWA:
            assert (s.kv_source, s.index_source, s.candidate_source) == (None, None, None)
            continue
        # main KV: the most recent Full layer of the same half
        full = max(f for f in (2, 8, 14, 20) if f <= s.index)
        assert s.kv_source == full, s.index
        # top-k: the most recent Full or Reindex layer
        indexer = max(f for f in (2, 8, 14, 20, 24, 28, 32, 36) if f <= s.index)
        assert s.index_source == indexer, s.index
        assert s.runs_indexer == (s.mode is not REUSE)
        assert s.computes_main_kv == (s.mode is FULL)
    # CED (§2.2, Eq. 1): only the first decoder layer is Full; its input is H_{L/2} (of layer 19).
    assert [s.index for s in plan if s.uses_encoder_output] == [20] == [plan.last_encoder_layer + 1]
    # Hierarchical indexer (§2.3.2): layer 20 is the candidate source, searched by every
    # decoder Reindex layer; encoder layers and Reuse layers never search a pool.
    assert [s.index for s in plan if s.is_candidate_source] == [20]
    assert {s.index: s.candidate_source for s in plan if s.candidate_source is not None} == {
        20: 20, 24: 20, 28: 20, 32: 20, 36: 20}
    assert [s.index for s in plan if s.has_engram] == [1, 14]  # §2.4.2


def test_flagship_sizes_match_section_4_2_1(flagship_cfg):
    c = flagship_cfg
    assert (c.num_layers, c.hidden_size, c.num_encoder_layers) == (40, 5120, 20)
    assert (c.index_num_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.num_attention_heads, c.head_dim, c.q_lora_rank) == (64, 512, 1280)
    assert (c.candidate_topk_blocks, c.candidate_block_size, c.candidate_pool_size) == (2048, 8, 16384)
    assert (c.o_groups, c.o_lora_rank, c.window_size) == (8, 1024, 128)
    assert (c.num_shared_experts, c.num_routed_experts, c.moe_ffn_hidden_size, c.moe_topk) == (1, 384, 2304, 6)
    assert c.swiglu_limit == 10.0
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.mhc_single_pass) == (4, 20, True)
    assert (c.engram_ngram_orders, c.engram_num_heads, c.engram_dim_per_order) == ((2, 3, 4), 8, 2048)
    assert c.fp4_main_kv and c.fp8_swa_kv


def test_flagship_produces_and_consumes(flagship_cfg):
    plan = flagship_cfg.plan
    assert plan[2].produces() == [K.MAIN_KV, K.INDEX_K, K.TOPK]
    assert plan[20].produces() == [K.MAIN_KV, K.INDEX_K, K.TOPK, K.CANDIDATES]
    assert plan[24].produces() == [K.TOPK]
    assert plan[25].produces() == [] and plan[0].produces() == []
    assert plan[3].consumes() == [(2, K.MAIN_KV), (2, K.TOPK)]
    assert plan[20].consumes() == []  # H_{L/2} arrives as the block's own input streams
    assert plan[24].consumes() == [(20, K.MAIN_KV), (20, K.INDEX_K), (20, K.CANDIDATES)]
    assert plan[27].consumes() == [(20, K.MAIN_KV), (24, K.TOPK)]
    assert plan.consumers(20, K.INDEX_K) == [24, 28, 32, 36]
    assert plan.consumers(20, K.MAIN_KV) == list(range(21, 40))
    assert plan.consumers(24, K.TOPK) == [25, 26, 27]
    assert plan.last_consumer(8, K.MAIN_KV) == 13


def test_tiny_recipe_exercises_every_mode(tiny_cfg):
    plan = tiny_cfg.plan
    assert [s.mode for s in plan] == [SWA, FULL, REUSE, REINDEX, FULL, REUSE, REINDEX, REUSE]
    assert [s.compress_ratio for s in plan] == [0, 2, 2, 2, 1, 1, 1, 1]
    assert plan[4].uses_encoder_output and plan[4].is_candidate_source
    assert plan[6].candidate_source == 4 and plan[3].candidate_source is None
    assert plan[7].index_source == 6 and plan[7].kv_source == 4


# ---- impossible plans ----------------------------------------------------------------------
def _groups(*specs):
    return tuple(LayerGroupSpec(modes=tuple(m), compress_ratio=r) for m, r in specs)


def _plan(*specs, encoder: int) -> dict:
    """Overrides of the tiny config for another layer plan (Engram off: its layer ids are
    validated first and would mask the plan error)."""
    return dict(layer_groups=_groups(*specs), num_encoder_layers=encoder, engram_layers=())


@pytest.mark.parametrize("change, message", [
    # Reuse / Reindex with no preceding Full layer
    (_plan((["swa"], 0), (["reuse", "full"], 2), encoder=3),
     r"layer 1 \(reuse, m=2\) has no preceding Full layer"),
    (_plan((["reindex", "reuse"], 1), encoder=2),
     r"layer 0 \(reindex, m=1\) has no preceding Full layer"),
    # a consumer whose ratio differs from the main KV it would reuse
    (_plan((["full", "reuse"], 2), (["reuse"], 1), encoder=2),
     r"layer 2 \(reuse, m=1\) would reuse the main KV of layer 0, which has compression ratio 2"),
    (_plan((["full"], 2), (["reindex"], 1), encoder=1),
     r"layer 1 \(reindex, m=1\) would reuse the main KV of layer 0"),
    # candidate pool must be larger than the top-k it is searched for (§2.3.2)
    (dict(candidate_topk_blocks=1, candidate_block_size=6, index_topk=6),
     r"candidate_topk_blocks: the candidate pool \(1 blocks x 6 = 6\) must be larger than index_topk=6"),
    (dict(candidate_topk_blocks=2, candidate_block_size=2, index_topk=6), r"candidate pool .* = 4\)"),
    # CED: a decoder Full layer other than the first decoder layer compresses decoder states
    (_plan((["full", "reuse"], 2), (["full", "reuse", "full", "reindex"], 1), encoder=2),
     r"layer 4 \(full, m=1\) is a Full layer inside the decoder; .* first decoder layer \(2\)"),
    (_plan((["full", "reuse"], 2), (["reuse", "full"], 2), encoder=2),
     r"layer 3 \(full, m=2\) is a Full layer inside the decoder"),
    (dict(num_encoder_layers=9), r"num_encoder_layers: must be in 1..8"),
    (dict(engram_layers=(1, 8)), r"engram_layers: layer 8 is outside 0..7"),
    (dict(window_size=0), r"window_size: must be positive"),
])
def test_impossible_plans_are_config_errors(tiny_cfg, change, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg.replace(**change)


@pytest.mark.parametrize("kwargs, message", [
    (dict(modes=("swa", "full"), compress_ratio=2), r"mixes 'swa' with CSA2 modes"),
    (dict(modes=("full", "reuse"), compress_ratio=0), r"compress_ratio: CSA2 groups need compress_ratio >= 1"),
    (dict(modes=("swa",), compress_ratio=2), r"compress_ratio: pure sliding-window groups take compress_ratio 0"),
    (dict(modes=(), compress_ratio=0), r"modes: a layer group needs at least one layer"),
    (dict(modes=("full",), compress_ratio=1, repeat=0), r"repeat: must be >= 1"),
])
def test_impossible_groups_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LayerGroupSpec(**kwargs)


def test_decoder_without_a_full_layer_reuses_the_encoder_kv(tiny_cfg):
    """CED allows a decoder with no Full layer at all: it attends to the encoder's compressed
    KV (same ratio). There is then no candidate source, so no decoder layer searches a pool."""
    cfg = tiny_cfg.replace(**_plan((["full", "reuse"], 1), (["reuse", "reindex", "reuse"], 1), encoder=2))
    plan = cfg.plan
    assert [s.kv_source for s in plan] == [0] * 5 and not any(s.uses_encoder_output for s in plan)
    assert not any(s.is_candidate_source or s.candidate_source is not None for s in plan)
    assert plan[4].index_source == 3


def test_hierarchical_indexer_off_has_no_candidates(tiny_cfg):
    plan = tiny_cfg.replace(candidate_topk_blocks=0).plan
    assert not any(s.is_candidate_source or s.candidate_source is not None for s in plan)
    assert all(k is not K.CANDIDATES for _, k in plan.shared_states())


# ---- pipeline cuts -------------------------------------------------------------------------
@pytest.mark.parametrize("cut, expected", [
    (0, []),
    (1, []),
    (2, [(1, K.MAIN_KV), (1, K.INDEX_K), (1, K.TOPK)]),
    (3, [(1, K.MAIN_KV), (1, K.INDEX_K)]),              # layer 2's top-k use is behind the cut
    (4, []),                                           # the CED cut: only the streams cross
    (5, [(4, K.MAIN_KV), (4, K.INDEX_K), (4, K.TOPK), (4, K.CANDIDATES)]),
    (6, [(4, K.MAIN_KV), (4, K.INDEX_K), (4, K.CANDIDATES)]),
    (7, [(4, K.MAIN_KV), (6, K.TOPK)]),
    (8, []),
])
def test_tiny_crossing(tiny_cfg, cut, expected):
    assert tiny_cfg.plan.crossing(cut) == expected


@pytest.mark.parametrize("cut, expected", [
    (10, [(8, K.MAIN_KV), (8, K.TOPK)]),
    (14, []),                                          # a group boundary: nothing crosses
    (20, []),                                          # the CED cut: H_{L/2} is the streams
    (26, [(20, K.MAIN_KV), (20, K.INDEX_K), (20, K.CANDIDATES), (24, K.TOPK)]),
    (37, [(20, K.MAIN_KV), (36, K.TOPK)]),
])
def test_flagship_crossing(flagship_cfg, cut, expected):
    assert flagship_cfg.plan.crossing(cut) == expected


def test_shared_states_are_exactly_the_consumed_pairs(tiny_cfg):
    plan = tiny_cfg.plan
    assert plan.shared_states() == [
        (1, K.MAIN_KV), (1, K.INDEX_K), (1, K.TOPK),
        (4, K.MAIN_KV), (4, K.INDEX_K), (4, K.TOPK), (4, K.CANDIDATES), (6, K.TOPK)]
    # only what some later layer reads is shared: the top-k of layers 3 (no Reuse after it)
    # is produced but never consumed
    assert plan.consumers(3, K.TOPK) == []
