"""Activation memory of one micro-batch, per layer and component, from the config alone.

Each term is what autograd *saves* for the backward pass in our implementation — derived by
reading the code and checked operator by operator against the saved-tensor hooks on `tiny`
(``tests/planning``). Units are float32 elements per token unless said otherwise; tensors are
stored in float32 throughout the local provider (matmul inputs are upcast, RoPE, norms, mHC,
router and head are float32 by the precision map). Integer indices count as int64 (2
elements), masks as bool (1/4).

Per token of the streams (``T_sp``: local tokens, / tp under sequence parallelism):

* mHC, per sublayer: the streams ``n d``, raw and scaled mixes ``2 (2+n) n``, Sinkhorn input
  and the bmm copy of comb ``2 n^2``, pre/post/collapse/expand gates ``4 n``, the sublayer
  output ``d`` and one RMS statistic;
* RMSNorm: input, normalised copy and statistic ``2 d + 1``.

Attention, per local query (``T``), with ``k = window + top-k`` (CSA2) or ``window`` (SWA),
per stream token the layer input ``d`` and the window-KV norm ``2 head_dim + 1``:

* ``recompute: none`` — the low-rank query path (``q_lora`` after the norm, ``2 q_lora + 1``
  in it), RoPE cos/sin of the query, the window KV and the output (``3 rope_dim``), the
  rotated queries and the de-rotated output (``2 h_local head_dim``), the int64 indices of
  the listed entries ``2 k`` and the grouped output ``g_local o_lora``; the KV array the keys
  are gathered from (window KV of the local tokens plus the CP halo, plus every compressed
  entry of the sequence). The sparse attention kernel saves only its inputs and recomputes
  the gathered keys and the softmax per chunk in backward
  (:mod:`megatron_s2.kernels.sparse_attention`).
* ``recompute: selective`` — the core runs in checkpointed query chunks
  (``CSA2Attention.attend``): only the checkpoints' inputs stay, the compressed query
  ``q_lora`` (its norm recomputed), the top-k ids ``2 top-k`` (CSA2), the KV array, and the
  window KV's RoPE ``rope_dim`` (its projection and norm recomputed too, so no ``2 head_dim
  + 1``); query heads, indices, outputs are recomputed per chunk.

Full layers add the compressor (softmax-gated pooling keeps ``C`` and ``softmax(Z)``: ``2
head_dim`` per token when m > 1), its norm and the index-key projection per entry (the CED
decoder Full layer compresses its own normalised input, already counted); under selective
recomputation the compressor and the index-key projection are checkpointed, so only the
latent ``head_dim`` and its RoPE ``2 rope_dim`` stay per entry. Indexer layers
(training with ``indexer_loss_coeff > 0``) add the KL alignment over the selected entries:
the head weights ``h_I``, the log-softmax, target and their masks ``2 top-k + 2 top-k / 4``
and the has-a-selection mask; the index-score kernel (:mod:`megatron_s2.kernels.indexer`)
saves its inputs only — without recomputation the rotated indexer queries
``h_I index_head_dim`` (their RoPE ``rope_dim``) and the top-k ids ``2 top-k``; under
selective recomputation its queries are recomputed per chunk from the compressed query (the
ids and ``q_lora`` are the attention checkpoint's). A Full layer's own index keys are saved
in both modes.

MoE, per token routed on this rank (``T / tp``): router input, logits and scores, top-k ids
and weights; the permutation indices of the dispatcher; per routed slot (``top-k`` per token)
the expert input ``d`` and seven ``F / etp``-wide SwiGLU intermediates; the shared expert
``6 F / tp`` per query. Under ``recompute: selective`` the attention core (above) and the
routed experts' SwiGLU are recomputed in backward: only their checkpoint inputs stay (for the
experts, the routed rows and their combine weights). Engram: hash ids, fetched rows (three
copies through lookup and FP8 fake quantisation), the projected key/value ``(n + 1) d``, the
streams and gated products.
"""

from __future__ import annotations

from megatron_s2.models.family.base import FLOAT_BYTES, LayerActivations, RankShape
from megatron_s2.models.v41.layer_plan import CSA2Mode, LayerSpec
from megatron_s2.models.v41.config import V41Config

__all__ = ["RankShape", "LayerActivations", "layer_activations", "head_activations", "transient_bytes",
           "FLOAT_BYTES"]

INT64 = 2.0   # int64 index in float32 elements
BOOL = 0.25


def _mhc_sublayer(c: V41Config) -> float:
    n, d = c.hc_mult, c.hidden_size
    return n * d + 2 * c.mhc_mix_dim + 2 * n * n + 4 * n + d + 1


def _entries(c: V41Config, spec: LayerSpec, r: RankShape) -> float:
    """Compressed entries of the whole sequence of one micro-batch (gathered over CP)."""
    return r.batch * (r.seq // spec.compress_ratio) if spec.is_csa2 else 0.0


def layer_activations(c: V41Config, spec: LayerSpec, r: RankShape, recompute: str = "none") -> LayerActivations:
    """Saved-for-backward bytes of layer ``spec`` for one micro-batch on one rank."""
    out = LayerActivations(spec.index)
    T, Tsp, Tm = r.tokens, r.stream_tokens, r.moe_tokens
    d, n, hd, rd = c.hidden_size, c.hc_mult, c.head_dim, c.rope_head_dim
    hl, gl, hil = c.num_attention_heads // r.tp, c.o_groups // r.tp, c.index_num_heads // r.tp
    q, ihd, topk = c.q_lora_rank, c.index_head_dim, c.index_topk
    if recompute == "full":  # run_block_recomputed keeps only each block's input streams and mix
        out.add("recompute inputs", Tsp * (n * d + n))
        return out
    out.add("mhc", 2 * Tsp * _mhc_sublayer(c))
    out.add("norms", 2 * Tsp * (2 * d + 1))
    # ---- attention (every layer: own query, own window KV) ------------------------------
    selective = recompute == "selective"
    k = c.window_size + (topk if spec.is_csa2 else 0)
    halo = r.batch * c.window_size if r.cp > 1 else 0.0
    kv_array = hd * (T + halo + _entries(c, spec, r))
    if selective:  # the checkpointed query chunks keep their inputs: qr, top-k ids, the KV array
        out.add("attention", Tsp * d + T * (q + rd))  # the window-KV norm is recomputed too
        core = T * INT64 * topk if spec.is_csa2 else 0.0
    else:
        out.add("attention", Tsp * (d + 2 * q + 1 + 2 * hd + 1) + T * (q + 3 * rd + 2 * hl * hd + gl * c.o_lora_rank))
        core = T * INT64 * k  # kernels/sparse_attention.py saves q, the KV array and the indices; recomputes the rest
    out.add("attention core (KV array + indices)", core + kv_array)  # keys are gathered again in backward
    # ---- CSA2 Full: compressor + index keys --------------------------------------------
    if spec.mode is CSA2Mode.FULL:
        m = spec.compress_ratio
        full_tokens = r.batch * r.seq
        entries = _entries(c, spec, r)
        if selective:  # checkpointed compressor and index-key projection: the latent and its RoPE stay
            comp = entries * (hd + 2 * rd)
        else:
            comp = (2 * hd * full_tokens if m > 1 else 0.0) + entries * (2 * hd + 1)
            comp += entries * (hd + 2 * ihd + 1 + 2 * rd)
        out.add("compressor + index keys", comp)
    if spec.runs_indexer and r.training and c.indexer_loss_coeff > 0:
        own_keys = _entries(c, spec, r) * ihd if spec.mode is CSA2Mode.FULL else 0.0
        kl = hil + 2 * topk + 2 * BOOL * topk + BOOL  # head weights, KL terms and masks
        kept = 0.0 if selective else rd + hil * ihd + INT64 * topk  # selective: recomputed / the core's ids
        out.add("indexer alignment", T * (kl + kept) + own_keys)
    # ---- MoE --------------------------------------------------------------------------
    e, ke, f = c.num_routed_experts, c.moe_topk, c.moe_ffn_hidden_size
    out.add("moe router + dispatch", Tm * (d + 2 * e + 3 * ke + 1) + Tm * (2 * INT64 * ke + 1))
    slots = Tm * ke * r.etp
    # selective: only the checkpointed experts' inputs (routed rows and their combine weights) stay
    out.add("moe routed experts", slots * (d + 1) if recompute == "selective" else slots * (d + 7 * f / r.etp + 1))
    if c.num_shared_experts:
        out.add("moe shared expert", T * 6 * f / r.tp)
    # ---- Engram -------------------------------------------------------------------------
    if spec.has_engram:
        nt, ehd = c.engram_num_tables, c.engram_head_dim
        out.add("engram", Tsp * (INT64 * nt + 4 * nt * ehd + 3 * nt + 2 * n * d + (n + 1) * d + 8 * n + BOOL * n))
    return out


def head_activations(c: V41Config, r: RankShape) -> float:
    """Final collapse, norm, LM head input and the vocabulary shard of the logits (bytes)."""
    n, d = c.hc_mult, c.hidden_size
    return FLOAT_BYTES * (r.stream_tokens * (n * d + n + 2 * d + 1) + r.tokens * (d + c.vocab_size / r.tp))


def transient_bytes(c: V41Config, r: RankShape, is_last_stage: bool) -> float:
    """Largest short-lived working set on top of the saved activations: the logits' gradient
    and softmax temporaries on the last stage, else one layer's attention scores chunk."""
    chunk = min(r.tokens, 1024)
    k = c.window_size + c.index_topk
    attention = FLOAT_BYTES * chunk * (c.num_attention_heads // r.tp) * (k + 1) * 3
    logits = FLOAT_BYTES * r.tokens * c.vocab_size / r.tp * 2 if is_last_stage else 0.0
    return max(attention, logits)
