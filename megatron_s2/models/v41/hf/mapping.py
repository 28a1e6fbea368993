"""The V4.1 backbone <-> DeepSeek-V4.1-Flash checkpoint mapping table.

Hugging Face names follow the official reference inference code (DeepSeek-V4.1-Flash
``inference/model.py``, MIT; revision dba1be0 as vendored in public repositories): module
attributes ``embed``, ``layers.{i}.attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
attn_sink}``, ``attn.compressor.{wkv, wgate, norm}``, ``attn.indexer.{wq_b, weights_proj, wk,
k_norm}``, ``ffn.gate.{weight, bias, bias_vl}``, ``ffn.experts.{j}.{w1, w2, w3}``,
``ffn.shared_experts.{w1, w2, w3}``, ``hc_{attn,ffn}_{fn, base, scale}``, ``attn_norm``,
``ffn_norm``, ``engram.{embed, wkv, q_weight, k_weight}``, ``norm``, ``head``. Every row below
marked ``confirmed`` was checked against those attribute names and shapes (e.g. ``wo_a``
``[o_groups * o_lora_rank, heads * head_dim / o_groups]`` viewed as ``(groups, rank, -1)``,
exactly our ``linear_out_a``).

Every backbone tensor has a reference name: the CED decoder's Full layer (the first decoder
layer) compresses its own normalised attention input, ``attn_norm(H_{L/2})`` (report §2.2,
Eq. 1), exactly as the reference's layer 20 does, so there is no extension tensor. Only
``ffn.gate.bias_vl`` is optional in the reference (present with vision).

The vision pathway (§2.1.1; :func:`vision_mappings`) keeps the reference's names
(``inference/vision.py`` ``ViT`` / ``Aligner`` under ``vision.*`` / ``aligner.*``, the span
delimiters ``image_start`` / ``image_end`` / ``image_newline`` of ``inference/model.py``); a
config without a vision tower skips those tensors on import and lists them in the report, like
the DSpark drafter's ``mtp.*`` without a drafter (:func:`v41_registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_s2.models.family.param_mapping import DirectMapping, GroupedExpertMapping, ImportFallback, ParamMapping
from megatron_s2.models.family.mapping_registry import MappingRegistry

__all__ = ["V41_REGISTRY", "V41_DSPARK_REGISTRY", "dspark_mappings", "v41_mappings", "vision_mappings", "v41_registry",
           "SKIPPED_HF_PREFIXES", "PaddedRowsMapping"]

L = "layers.{layer}."


@dataclass(frozen=True)
class PaddedRowsMapping(ParamMapping):
    """Our Engram table ``[padded rows, dim]`` <-> the reference's ``[rows, dim]``.

    Padding rows are never addressed and stay zero; export refuses a table whose padding is
    not zero (something wrote to it outside the model), import pads with zeros.
    """

    def to_hf(self, tensor, bindings, ctx):
        rows = ctx.engram_rows(bindings["layer"])
        if tensor[rows:].any():
            raise ValueError(f"{self.megatron_name(bindings)}: padding rows {rows}..{tensor.size(0) - 1} are not zero; "
                             "they are never addressed by the model, so the table was modified outside it")
        return {self.hf.format(**bindings): tensor[:rows]}

    def from_hf(self, tensors, bindings, ctx, full_shape):
        (tensor,) = tensors.values()
        rows = ctx.engram_rows(bindings["layer"])
        if tensor.size(0) != rows:
            raise ValueError(f"{self.hf.format(**bindings)}: {tensor.size(0)} rows, the config's Engram hashing "
                             f"addresses {rows}")
        out = tensor.new_zeros((full_shape[0], *tensor.shape[1:]))
        out[:rows] = tensor
        return out


def _always(ctx, b) -> str | None:
    return None


def v41_mappings() -> list:
    d = DirectMapping
    rows = [
        d("embedding.word_embeddings.weight", "embed.weight"),
        d("final_norm.weight", "norm.weight"),
        d("output_layer.weight", "head.weight"),
        # ---- block: norms and mHC ------------------------------------------------------------
        d(L + "attn_norm.weight", L + "attn_norm.weight"),
        d(L + "mlp_norm.weight", L + "ffn_norm.weight"),
        d(L + "attn_hc.fn", L + "hc_attn_fn", keep_fp32=True),
        d(L + "attn_hc.base", L + "hc_attn_base", keep_fp32=True),
        d(L + "attn_hc.scale", L + "hc_attn_scale", keep_fp32=True),
        d(L + "mlp_hc.fn", L + "hc_ffn_fn", keep_fp32=True),
        d(L + "mlp_hc.base", L + "hc_ffn_base", keep_fp32=True),
        d(L + "mlp_hc.scale", L + "hc_ffn_scale", keep_fp32=True),
        # ---- attention (SWA + CSA2) ------------------------------------------------------------
        d(L + "attention.attn_sink", L + "attn.attn_sink", keep_fp32=True),
        d(L + "attention.linear_q_down.weight", L + "attn.wq_a.weight"),
        d(L + "attention.q_norm.weight", L + "attn.q_norm.weight"),
        d(L + "attention.linear_q_up.weight", L + "attn.wq_b.weight"),
        d(L + "attention.linear_kv.weight", L + "attn.wkv.weight"),
        d(L + "attention.kv_norm.weight", L + "attn.kv_norm.weight"),
        d(L + "attention.linear_out_a", L + "attn.wo_a.weight"),
        d(L + "attention.linear_out_b.weight", L + "attn.wo_b.weight"),
        d(L + "attention.compressor.linear_kv.weight", L + "attn.compressor.wkv.weight"),
        d(L + "attention.compressor.linear_gate.weight", L + "attn.compressor.wgate.weight"),
        d(L + "attention.compressor.norm.weight", L + "attn.compressor.norm.weight"),
        d(L + "attention.index_key.linear.weight", L + "attn.indexer.wk.weight"),
        d(L + "attention.index_key.norm.weight", L + "attn.indexer.k_norm.weight"),
        d(L + "attention.indexer.linear_q.weight", L + "attn.indexer.wq_b.weight"),
        d(L + "attention.indexer.linear_weights.weight", L + "attn.indexer.weights_proj.weight"),
        # ---- MoE -----------------------------------------------------------------------------
        d(L + "mlp.router.weight", L + "ffn.gate.weight"),
        d(L + "mlp.router.expert_bias", L + "ffn.gate.bias", keep_fp32=True),
        d(L + "mlp.router.image_expert_bias", L + "ffn.gate.bias_vl", keep_fp32=True,
          note="present in the reference only when vision is enabled",
          fallback=ImportFallback(L + "ffn.gate.bias", _always,
                                  "without bias_vl the reference routes image tokens with bias"),
          elide_if_derivable=True),
        *(GroupedExpertMapping(L + f"mlp.experts.{w}", L + f"ffn.experts.{{expert}}.{w}.weight") for w in ("w1", "w2", "w3")),
        *(d(L + f"mlp.shared_expert.{w}", L + f"ffn.shared_experts.{w}.weight") for w in ("w1", "w2", "w3")),
        # ---- Engram ----------------------------------------------------------------------------
        PaddedRowsMapping(L + "engram.table.weight", L + "engram.embed.weight",
                          note="reference rows are unpadded; stored FP8 with engram.embed.scale"),
        d(L + "engram.linear_kv.weight", L + "engram.wkv.weight"),
        d(L + "engram.q_weight", L + "engram.q_weight", keep_fp32=True),
        d(L + "engram.k_weight", L + "engram.k_weight", keep_fp32=True),
    ]
    return rows


@dataclass(frozen=True)
class DrafterExpertMapping(GroupedExpertMapping):
    """A drafter MoE's grouped experts: its own expert count (``dspark_n_routed_experts``)."""

    def hf_names(self, bindings, ctx):
        return [self.hf.format(**bindings, expert=e) for e in range(ctx.cfg.dspark_num_routed_experts)]

    def to_hf(self, tensor, bindings, ctx):
        if tensor.size(0) != ctx.cfg.dspark_num_routed_experts:
            raise ValueError(f"{self.megatron_name(bindings)}: {tensor.size(0)} experts, the config's drafter has "
                             f"{ctx.cfg.dspark_num_routed_experts}")
        return {self.hf.format(**bindings, expert=e): tensor[e] for e in range(tensor.size(0))}


@dataclass(frozen=True)
class LastStageMapping(DirectMapping):
    """A tensor of the drafter's last stage (``{last}`` = ``dspark_layers - 1`` of the config)."""

    def hf_names(self, bindings, ctx):
        return [self.hf.format(**bindings, last=ctx.cfg.dspark_layers - 1)]

    def to_hf(self, tensor, bindings, ctx):
        return {self.hf_names(bindings, ctx)[0]: tensor}


D = "dspark.blocks.{stage}."
M = "mtp.{stage}."


def dspark_mappings() -> list:
    """The DSpark drafter (§2.4.3) under the release's ``mtp.<stage>.*`` names: every block is a
    backbone-style block (its rows below, without CSA2 or Engram parts); stage 0 carries
    ``main_proj`` / ``main_norm``, the last stage the final norm, ``hc_head``, the Markov and
    confidence heads. The drafter's stage count is a config value, so the last stage's tensors
    are matched by name with any stage index and checked against the config on import."""
    d = DirectMapping
    rows = []
    for m in v41_mappings():
        if not m.megatron.startswith(L) or "{expert}" in m.hf and not isinstance(m, GroupedExpertMapping):
            continue
        suffix = m.megatron[len(L):]
        if suffix.startswith(("engram.", "attention.compressor.", "attention.index")):
            continue
        hf_suffix = m.hf[len(L):]
        if m.fallback is not None:
            fb = m.fallback
            rows.append(d(D + suffix, M + hf_suffix, keep_fp32=m.keep_fp32, note=m.note,
                          fallback=ImportFallback(M + fb.hf[len(L):], fb.applicable, fb.note),
                          elide_if_derivable=m.elide_if_derivable))
        elif isinstance(m, GroupedExpertMapping):
            rows.append(DrafterExpertMapping(D + suffix, M + hf_suffix))
        else:
            rows.append(d(D + suffix, M + hf_suffix, keep_fp32=m.keep_fp32))
    rows += [
        d("dspark.main_proj.weight", "mtp.0.main_proj.weight"),
        d("dspark.main_norm.weight", "mtp.0.main_norm.weight"),
    ]
    last = LastStageMapping
    rows += [
        last("dspark.final_norm.weight", "mtp.{last}.norm.weight"),
        last("dspark.head_hc_fn", "mtp.{last}.hc_head_fn", keep_fp32=True),
        last("dspark.head_hc_base", "mtp.{last}.hc_head_base", keep_fp32=True),
        last("dspark.head_hc_scale", "mtp.{last}.hc_head_scale", keep_fp32=True),
        last("dspark.markov_w1", "mtp.{last}.markov_head.markov_w1.weight"),
        last("dspark.markov_w2", "mtp.{last}.markov_head.markov_w2.weight", keep_fp32=True),
        last("dspark.confidence", "mtp.{last}.confidence_head.proj.weight", keep_fp32=True),
    ]
    return rows


V = "vision.tower."
B = "vision.tower.blocks.{layer}."


def vision_mappings() -> list:
    """The vision encoder (§2.1.1) under the reference's names: ``vision.*`` is its ``ViT``
    (``{layer}`` = tower block), ``aligner.*`` the projector, ``image_*`` the span delimiters."""
    d = DirectMapping
    rows = [d(V + "patch_embed.proj.weight", "vision.patch_embed.proj.weight"),
            d(V + "patch_embed.proj.bias", "vision.patch_embed.proj.bias"),
            d(V + "norm.weight", "vision.norm.weight")]
    for name in ("norm1.weight", "attn.wqkv.weight", "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias",
                 "norm2.weight", "mlp.w1.weight", "mlp.w2.weight"):
        rows.append(d(B + name, "vision.blocks.{layer}." + name))
    rows += [d(f"vision.aligner.{w}.{t}", f"aligner.{w}.{t}") for w in ("w1", "w2") for t in ("weight", "bias")]
    rows += [d(f"vision.{e}", e) for e in ("image_start", "image_end", "image_newline")]
    return rows


SKIPPED_HF_PREFIXES = {
    "mtp.": "DSpark drafter stages (imported when config.json describes the drafter: dspark_target_layer_ids)",
    "vision.": "vision encoder (imported when config.json describes it: vision_n_layers > 0)",
    "aligner.": "vision-language projector (imported with the vision encoder)",
    "image_start": "image-span embedding (imported with the vision encoder)",
    "image_end": "image-span embedding (imported with the vision encoder)",
    "image_newline": "image-span embedding (imported with the vision encoder)",
}
_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


@lru_cache(maxsize=None)
def v41_registry(drafter: bool = False, vision: bool = False) -> MappingRegistry:
    """The table of a backbone with / without its DSpark drafter (``mtp.*``) and vision encoder
    (``vision.*``, ``aligner.*``, ``image_*``); the absent parts are skipped on import."""
    rows = v41_mappings() + (dspark_mappings() if drafter else []) + (vision_mappings() if vision else [])
    owned = (("mtp.",) if drafter else ()) + (_VISION_PREFIXES if vision else ())
    return MappingRegistry(rows, {k: v for k, v in SKIPPED_HF_PREFIXES.items() if k not in owned})


V41_REGISTRY = v41_registry()
"""A backbone without a drafter or vision: a release's ``mtp.*`` and vision tensors are skipped (and reported)."""
V41_DSPARK_REGISTRY = v41_registry(drafter=True)
"""A backbone with its DSpark drafter (``model.dspark_layers > 0``): ``mtp.*`` import and export."""
