"""The mapping table against the official reference's naming (no checkpoint files involved).

The oracle below restates, independently of the table, which tensors the DeepSeek-V4.1-Flash
reference ``inference/model.py`` creates for a config and with which shapes (``Block``,
``Attention``, ``Compressor``, ``Indexer``, ``MoE``/``Gate``/``Expert``, ``Engram``,
``ParallelHead``). Every name the table produces for the flagship, small and tiny models must
be one of them with the same shape, and the reverse — except ``ffn.gate.bias_vl`` (vision
checkpoints only). There is no extension tensor: the CED decoder's Full layer compresses its
own ``attn_norm`` output, as the reference's does.
"""

from __future__ import annotations

import pytest

from megatron_s2.models.v41.hf.context import ConversionContext
from megatron_s2.models.family.mapping_registry import ConversionError
from megatron_s2.models.family.skeleton import skeleton_state
from megatron_s2.models.v41.hf.mapping import v41_registry
from megatron_s2.models.v41.layer_plan import CSA2Mode
from tests.hf.conftest import load_model

EXTENSIONS = ("ffn.gate.bias_vl",)


def reference_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Names and (logical, dequantised) shapes of the reference model's backbone tensors."""
    from megatron_s2.models.v41.engram.hashing import EngramHasher

    d, h, hd, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    mix, f = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.moe_ffn_hidden_size
    out = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,), "head.weight": (cfg.vocab_size, d)}
    hasher = EngramHasher.from_config(cfg) if cfg.engram_layers else None
    for s in cfg.plan:
        p = f"layers.{s.index}."
        out.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        for site in ("attn", "ffn"):
            out.update({p + f"hc_{site}_fn": (mix, cfg.hc_mult * d), p + f"hc_{site}_base": (mix,),
                        p + f"hc_{site}_scale": (3,)})
        a = p + "attn."
        out.update({a + "attn_sink": (h,), a + "wq_a.weight": (qr, d), a + "q_norm.weight": (qr,),
                    a + "wq_b.weight": (h * hd, qr), a + "wkv.weight": (hd, d), a + "kv_norm.weight": (hd,),
                    a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
                    a + "wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank)})
        if s.mode is CSA2Mode.FULL:  # kv source: Compressor, and the indexer owns its keys
            out.update({a + "compressor.wkv.weight": (hd, d), a + "compressor.norm.weight": (hd,),
                        a + "indexer.wk.weight": (cfg.index_head_dim, hd), a + "indexer.k_norm.weight": (cfg.index_head_dim,)})
            if s.compress_ratio > 1:
                out[a + "compressor.wgate.weight"] = (hd, d)
        if s.runs_indexer:  # index source
            out.update({a + "indexer.wq_b.weight": (cfg.index_num_heads * cfg.index_head_dim, qr),
                        a + "indexer.weights_proj.weight": (cfg.index_num_heads, d)})
        g = p + "ffn."
        out.update({g + "gate.weight": (cfg.num_routed_experts, d), g + "gate.bias": (cfg.num_routed_experts,)})
        for e in range(cfg.num_routed_experts):
            out.update({g + f"experts.{e}.w1.weight": (f, d), g + f"experts.{e}.w3.weight": (f, d),
                        g + f"experts.{e}.w2.weight": (d, f)})
        out.update({g + "shared_experts.w1.weight": (f, d), g + "shared_experts.w3.weight": (f, d),
                    g + "shared_experts.w2.weight": (d, f)})
        if s.has_engram:
            n_cols = (cfg.engram_max_ngram - 1) * cfg.engram_num_heads
            out.update({p + "engram.embed.weight": (hasher.num_rows(s.index), cfg.engram_head_dim),
                        p + "engram.wkv.weight": (d * (cfg.hc_mult + 1), n_cols * cfg.engram_head_dim),
                        p + "engram.q_weight": (cfg.hc_mult, d), p + "engram.k_weight": (cfg.hc_mult, d)})
    out.update(reference_drafter_tensors(cfg))
    out.update(reference_vision_tensors(cfg))
    return out


def reference_vision_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The reference's vision pathway (``inference/vision.py``: ``ViT`` under ``vision``,
    ``Aligner`` under ``aligner``; ``inference/model.py``: the span delimiters): ``PatchEmbed.proj``
    (linear over a flattened 3 x p x p patch, bias), per block ``norm1`` / ``norm2`` (RMSNorm),
    ``attn.wqkv`` (3 dim x dim, bias) / ``attn.wo`` (bias), ``mlp.w1`` (2 inter x dim) / ``mlp.w2``
    (no biases), the final ``norm``, the aligner's ``w1`` (dim r^2 -> d) / ``w2`` (d -> d) with
    biases, and ``image_start`` / ``image_end`` / ``image_newline`` of the backbone width."""
    if not cfg.vision_n_layers:
        return {}
    v, f, p, r, d = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.hidden_size
    out = {"vision.patch_embed.proj.weight": (v, 3 * p * p), "vision.patch_embed.proj.bias": (v,),
           "vision.norm.weight": (v,), "aligner.w1.weight": (d, v * r * r), "aligner.w1.bias": (d,),
           "aligner.w2.weight": (d, d), "aligner.w2.bias": (d,),
           "image_start": (d,), "image_end": (d,), "image_newline": (d,)}
    for i in range(cfg.vision_n_layers):
        b = f"vision.blocks.{i}."
        out.update({b + "norm1.weight": (v,), b + "norm2.weight": (v,), b + "attn.wqkv.weight": (3 * v, v),
                    b + "attn.wqkv.bias": (3 * v,), b + "attn.wo.weight": (v, v), b + "attn.wo.bias": (v,),
                    b + "mlp.w1.weight": (2 * f, v), b + "mlp.w2.weight": (v, f)})
    return out


def reference_drafter_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The reference's DSpark stages (``DSparkBlock`` under ``mtp.<stage>``): a sliding-window
    block with the drafter's experts; stage 0 adds ``main_proj`` / ``main_norm``, the last stage
    ``norm``, ``hc_head_*``, the Markov head (``ParallelEmbedding`` + ``ParallelHead`` of rank r)
    and the float32 confidence projection over [hidden, Markov embedding]."""
    d, h, hd, qr, r = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.dspark_markov_rank
    mix, f, n, e = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.moe_ffn_hidden_size, cfg.hc_mult, cfg.dspark_num_routed_experts
    out = {}
    for stage in range(cfg.dspark_layers):
        p = f"mtp.{stage}."
        out.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        for site in ("attn", "ffn"):
            out.update({p + f"hc_{site}_fn": (mix, n * d), p + f"hc_{site}_base": (mix,), p + f"hc_{site}_scale": (3,)})
        a = p + "attn."
        out.update({a + "attn_sink": (h,), a + "wq_a.weight": (qr, d), a + "q_norm.weight": (qr,),
                    a + "wq_b.weight": (h * hd, qr), a + "wkv.weight": (hd, d), a + "kv_norm.weight": (hd,),
                    a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
                    a + "wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank)})
        g = p + "ffn."
        out.update({g + "gate.weight": (e, d), g + "gate.bias": (e,)})
        for x in range(e):
            out.update({g + f"experts.{x}.w1.weight": (f, d), g + f"experts.{x}.w3.weight": (f, d),
                        g + f"experts.{x}.w2.weight": (d, f)})
        out.update({g + "shared_experts.w1.weight": (f, d), g + "shared_experts.w3.weight": (f, d),
                    g + "shared_experts.w2.weight": (d, f)})
    if cfg.dspark_layers:
        last = f"mtp.{cfg.dspark_layers - 1}."
        out.update({"mtp.0.main_proj.weight": (d, d * len(cfg.dspark_target_layer_ids)), "mtp.0.main_norm.weight": (d,),
                    last + "norm.weight": (d,), last + "hc_head_fn": (n, n * d), last + "hc_head_base": (n,),
                    last + "hc_head_scale": (1,), last + "markov_head.markov_w1.weight": (cfg.vocab_size, r),
                    last + "markov_head.markov_w2.weight": (cfg.vocab_size, r),
                    last + "confidence_head.proj.weight": (1, d + r)})
    return out


def table_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes the mapping table produces for the model's state."""
    ctx = ConversionContext(cfg)
    out = {}
    registry = v41_registry(bool(cfg.dspark_layers), bool(cfg.vision_n_layers))
    for name, info in skeleton_state(cfg).items():
        mapping, bindings = registry.resolve(name)
        names = mapping.hf_names(bindings, ctx)
        shape = info.full_shape
        if len(names) > 1:  # grouped experts: one per expert
            shape = shape[1:]
        elif type(mapping).__name__ == "PaddedRowsMapping":
            shape = (ctx.engram_rows(bindings["layer"]), *shape[1:])
        for n in names:
            assert n not in out, f"{n} produced twice"
            out[n] = tuple(shape)
    return out


@pytest.mark.parametrize("model", ["tiny", "small", "flagship"])
def test_names_and_shapes_match_the_reference(model):
    cfg = load_model(model)
    ours, ref = table_tensors(cfg), reference_tensors(cfg)
    extensions = {n for n in ours if n.endswith(EXTENSIONS)}
    assert set(ours) - extensions == set(ref), (sorted(set(ours) - extensions - set(ref))[:5],
                                                sorted(set(ref) - set(ours))[:5])
    for name, shape in ref.items():
        assert ours[name] == shape, f"{name}: ours {ours[name]}, reference {shape}"
    assert extensions == ({f"layers.{i}.ffn.gate.bias_vl" for i in range(cfg.num_layers)}
                          | {f"mtp.{i}.ffn.gate.bias_vl" for i in range(cfg.dspark_layers)})
    assert not any("input_norm" in n for n in ours)  # no CED extension tensor (follows the release)


def test_every_row_is_used_and_unconfirmed_rows_are_documented():
    used = set()
    for model in ("tiny", "small", "flagship"):
        cfg = load_model(model)
        registry = v41_registry(bool(cfg.dspark_layers), bool(cfg.vision_n_layers))
        for name in skeleton_state(cfg):
            used.add(registry.resolve(name)[0].megatron)
    full = v41_registry(drafter=True, vision=True)
    assert used == {m.megatron for m in full.mappings}
    for m in full.mappings:
        if not m.confirmed:
            assert m.note, f"{m.megatron}: unconfirmed rows must say why"
    assert [m.hf for m in full.mappings if not m.confirmed] == []


def test_unmapped_names_are_errors():
    with pytest.raises(ConversionError, match="no mapping for 'layers.0.attention.new_thing'"):
        v41_registry().resolve("layers.0.attention.new_thing")
