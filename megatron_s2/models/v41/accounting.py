"""Parameter, KV-cache and FLOP accounting of the V4.1 backbone, from its config alone.

Used by ``megatron-s2 account`` (sizing a model before booking a cluster), by the trainer
for model TFLOP/s (sparse attention counted as sparse, not dense) and by memory planning.
Every count is derived from :class:`V41Config` and the layer plan — the same objects the
model is built from — and a test checks the parameter counts against instantiated models.

KV formats (§2.4.4, §3.2.1): the main (compressed) KV is FP4 E2M1 with one E4M3 scale per 16
channels when ``fp4_main_kv`` (else FP8 E4M3 with one E8M0 scale per 32); indexer keys are
MXFP4 (E2M1 + one E8M0 scale per 32) when ``fp4_indexer`` (else FP8); SWA KV is FP8 with one
scale per 32 when ``fp8_swa_kv`` (else BF16). Global KV (main KV + index K of every Full
layer) stays in HBM and is the persistent cache; SWA KV is per-request state that is never
persisted (recomputed by bounded replay, §3.2.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_s2.models.v41.layer_plan import CSA2Mode, LayerSpec
from megatron_s2.models.v41.config import V41Config
from megatron_s2.kernels.kv_formats import vector_format
from megatron_s2.models.v41.engram.hashing import EngramHasher
from megatron_s2.models.v41.engram.table import padded_rows

__all__ = ["ParamCounts", "count_parameters", "kv_bytes", "decode_flops_per_token", "train_flops_per_token",
           "account", "report_lines", "dspark_parameters", "vision_parameters", "image_bytes_per_token", "fp4_bytes",
           "fp8_bytes", "kv_cache_bytes"]


def fp4_bytes(channels: int, block: int) -> float:
    """E2M1 payload (half a byte per value) + one 1-byte scale per block."""
    return channels / 2 + channels / block


def fp8_bytes(channels: int, block: int = 32) -> float:
    return channels + channels / block


@dataclass
class ParamCounts:
    embedding: int
    head: int
    attention: int
    moe_routed: int
    moe_other: int
    mhc: int
    norms: int
    engram: int
    dspark: int = 0
    """The DSpark drafter (§2.4.3), counted apart from the backbone; it shares the backbone's
    embedding and head."""
    vision: int = 0
    """The vision encoder (§2.1.1: tower, aligner, image-span embeddings), counted apart from the
    backbone; it lives beside the embedding (first pipeline stage)."""

    @property
    def backbone(self) -> int:
        return self.embedding + self.head + self.attention + self.moe_routed + self.moe_other + self.mhc + self.norms

    @property
    def total(self) -> int:
        return self.backbone + self.engram + self.dspark + self.vision


def _attention_params(c: V41Config, s: LayerSpec) -> int:
    d, h, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    n = c.q_lora_rank * (d + 1) + c.q_lora_rank * h * hd + d * hd + hd
    n += h if c.attn_sink else 0
    n += c.o_lora_rank * h * hd + c.o_groups * c.o_lora_rank * d
    if s.mode is CSA2Mode.FULL:
        n += d * hd * (2 if s.compress_ratio > 1 else 1) + hd
        n += hd * c.index_head_dim + c.index_head_dim
    if s.runs_indexer:
        n += c.q_lora_rank * c.index_num_heads * c.index_head_dim + d * c.index_num_heads
    return n


def _expert_params(c: V41Config) -> int:
    return 3 * c.hidden_size * c.moe_ffn_hidden_size


def engram_rows(c: V41Config, layer: int) -> int:
    """Rows of the layer's concatenated table (all prime-sized tables, padded for partitioning)."""
    return padded_rows(EngramHasher.from_config(c).num_rows(layer))


def engram_module_params(c: V41Config, layer: int) -> int:
    rows = engram_rows(c, layer)
    n_in = c.engram_num_tables * c.engram_head_dim
    return rows * c.engram_head_dim + n_in * c.hidden_size * (c.hc_mult + 1) + 2 * c.hc_mult * c.hidden_size


def count_parameters(c: V41Config, layers: list[int] | None = None, *, pre_process: bool = True,
                     post_process: bool = True) -> ParamCounts:
    plan = c.plan
    ids = range(c.num_layers) if layers is None else layers
    d, n = c.hidden_size, c.hc_mult
    attn = routed = other = mhc = norms = engram = 0
    for i in ids:
        s = plan[i]
        attn += _attention_params(c, s)
        routed += c.num_routed_experts * _expert_params(c)
        other += c.num_routed_experts * d + c.num_shared_experts * _expert_params(c)
        mhc += 2 * (c.mhc_mix_dim * n * d + c.mhc_mix_dim + 3)
        norms += 2 * d
        if s.has_engram:
            engram += engram_module_params(c, i)
    return ParamCounts(
        embedding=c.vocab_size * d if pre_process else 0,
        head=c.vocab_size * d if post_process else 0,
        attention=attn, moe_routed=routed, moe_other=other, mhc=mhc,
        norms=norms + (d if post_process else 0), engram=engram,
        dspark=dspark_parameters(c)[0] if post_process else 0,
        vision=vision_parameters(c) if pre_process else 0,
    )


def vision_parameters(c: V41Config) -> int:
    """Parameters of the vision encoder: the linear patch embedding (with bias), ``vision_n_layers``
    blocks (two RMSNorms, ``wqkv`` / ``wo`` with biases, the bias-free SwiGLU), the final norm, the
    aligner's two biased layers from ``vision_dim * r^2`` to the backbone width, and the three
    span-delimiter embeddings (§2.1.1)."""
    if not c.vision_n_layers:
        return 0
    v, d, r = c.vision_dim, c.hidden_size, c.vision_downsample_ratio
    patch = 3 * c.vision_patch_size ** 2 * v + v
    block = 2 * v + (v * 3 * v + 3 * v) + (v * v + v) + 3 * v * c.vision_inter_dim
    aligner = (v * r * r * d + d) + (d * d + d)
    return patch + c.vision_n_layers * block + v + aligner + 3 * d


def image_bytes_per_token(c: V41Config) -> float:
    """Raw bytes (decoded RGB, 3 a pixel) per span token of the largest image the resize planning
    admits: ``rho`` of the report's I/O criterion (§3.1.1, :mod:`megatron_s2.planning.image_io`).
    Roughly ``3 (p r)^2``: each visual token stands for an ``r x r`` block of ``p x p`` patches."""
    from megatron_s2.models.v41.vision.processor import plan_for

    if not c.vision_n_layers:
        return 0.0
    side = c.vision_patch_size * c.vision_downsample_ratio * c.vision_max_n_token  # beyond any cap
    grid = plan_for(c, side, side)
    return 3 * grid.width * grid.height / grid.num_tokens


def dspark_parameters(c: V41Config) -> tuple[int, int]:
    """(parameters, activated per drafted token) of the DSpark drafter: ``dspark_layers``
    sliding-window mHC blocks with the drafter's own experts, ``main_proj`` / ``main_norm``,
    the final norm, ``hc_head``, the Markov head and the confidence head (§2.4.3)."""
    if not c.dspark_layers:
        return 0, 0
    from megatron_s2.models.v41.dspark.drafter import _stage_spec

    d, n, r = c.hidden_size, c.hc_mult, c.dspark_markov_rank
    e = c.dspark_num_routed_experts
    block = (_attention_params(c, _stage_spec(c, 0)) + e * d + c.num_shared_experts * _expert_params(c)
             + 2 * (c.mhc_mix_dim * n * d + c.mhc_mix_dim + 3) + 2 * d)
    heads = d * len(c.dspark_target_layer_ids) * d + d + d + (n * n * d + n + 1) + 2 * c.vocab_size * r + d + r
    total = c.dspark_layers * (block + e * _expert_params(c)) + heads
    active = c.dspark_layers * (block + c.dspark_moe_topk * _expert_params(c)) + heads
    return total, active


def kv_bytes(c: V41Config) -> dict[str, float]:
    """Per-token global KV bytes by component and per-request SWA state bytes."""
    main_entry = fp4_bytes(c.head_dim, 16) if c.fp4_main_kv else fp8_bytes(c.head_dim)
    index_entry = fp4_bytes(c.index_head_dim, 32) if c.fp4_indexer else fp8_bytes(c.index_head_dim)
    swa_entry = fp8_bytes(c.head_dim) if c.fp8_swa_kv else 2 * c.head_dim
    main = index = 0.0
    for s in c.plan:
        if s.mode is CSA2Mode.FULL:
            main += main_entry / s.compress_ratio
            index += index_entry / s.compress_ratio
    return {
        "main_kv_bytes_per_token": main,
        "index_k_bytes_per_token": index,
        "global_kv_bytes_per_token": main + index,
        "swa_state_bytes_per_request": c.num_layers * c.window_size * swa_entry,
        "main_kv_format": "fp4-e2m1+e4m3/16" if c.fp4_main_kv else "fp8-e4m3+e8m0/32",
        "index_k_format": "mxfp4-e2m1+e8m0/32" if c.fp4_indexer else "fp8-e4m3+e8m0/32",
        "swa_kv_format": "fp8-e4m3+e8m0/32" if c.fp8_swa_kv else "bf16",
    }


def _matmul_params(c: V41Config, counts: ParamCounts, active_experts: bool) -> int:
    """Parameters that take part in a matrix product for one token (embedding rows and
    Engram tables are lookups, not products)."""
    experts = counts.moe_routed * c.moe_topk // c.num_routed_experts if active_experts else counts.moe_routed
    engram_tables = sum(engram_rows(c, i) * c.engram_head_dim for i in c.engram_layers)
    return counts.head + counts.attention + experts + counts.moe_other + counts.mhc + counts.engram - engram_tables


def _attention_flops(c: V41Config, context: int) -> float:
    """Attention + indexer FLOPs of one query at position ``context - 1``."""
    flops = 0.0
    h, hd = c.num_attention_heads, c.head_dim
    for s in c.plan:
        entries = min(c.window_size, context)
        if s.is_csa2:
            visible = context // s.compress_ratio
            entries += min(c.index_topk, visible)
            if s.runs_indexer:
                scored = visible
                if s.candidate_source is not None and not s.is_candidate_source:
                    scored = min(visible, c.candidate_pool_size)
                flops += 2 * scored * c.index_num_heads * (c.index_head_dim + 1)
        flops += 4 * h * hd * entries
    return flops


def decode_flops_per_token(c: V41Config, context: int) -> float:
    counts = count_parameters(c)
    return 2 * _matmul_params(c, counts, True) + _attention_flops(c, context)


def train_flops_per_token(c: V41Config, seq_length: int) -> float:
    """Forward + backward FLOPs per trained token (3x forward), attention averaged over the
    positions of a sequence of ``seq_length`` tokens."""
    counts = count_parameters(c)
    step = max(1, seq_length // 64)
    samples = list(range(1, seq_length + 1, step))
    attn = sum(_attention_flops(c, p) for p in samples) / len(samples)
    return 3 * (2 * _matmul_params(c, counts, True) + attn)


def account(c: V41Config) -> dict:
    counts = count_parameters(c)
    routed_inactive = counts.moe_routed - counts.moe_routed * c.moe_topk // c.num_routed_experts
    decode = counts.backbone - routed_inactive
    # Prefill under CED (§2.2): the encoder runs on every prompt token; the decoder only
    # projects its global KV from H_{L/2} (its Full layer's attn_norm, compressor and
    # index-key projection).
    enc_layers = [s.index for s in c.plan if s.is_encoder]
    enc = count_parameters(c, enc_layers, post_process=False)
    prefill = enc.backbone - (enc.moe_routed - enc.moe_routed * c.moe_topk // c.num_routed_experts)
    for s in c.plan:
        if not s.is_encoder and s.mode is CSA2Mode.FULL:
            prefill += c.hidden_size * c.head_dim * (2 if s.compress_ratio > 1 else 1) + c.head_dim
            prefill += c.hidden_size  # attn_norm: the compressor reads attn_norm(H_{L/2})
            prefill += c.head_dim * c.index_head_dim + c.index_head_dim
    kv = kv_bytes(c)
    return {
        "model": c.name,
        "backbone_params": counts.backbone,
        "engram_params": counts.engram,
        "activated_params_decode": decode,
        "activated_params_prefill": prefill,
        "global_kv_bytes_per_token": kv["global_kv_bytes_per_token"],
        "persistent_kv_bytes_per_token": kv["global_kv_bytes_per_token"],
        "swa_state_bytes_per_request": kv["swa_state_bytes_per_request"],
        "decode_flops_4k": decode_flops_per_token(c, 4096),
        "decode_flops_1m": decode_flops_per_token(c, 1 << 20),
        "dspark_params": counts.dspark,
        "dspark_activated_params": dspark_parameters(c)[1],
        "vision_params": counts.vision,
        "image_bytes_per_token": image_bytes_per_token(c),
        "breakdown": {"params": asdict(counts), "kv": kv},
    }


def kv_cache_bytes(config: V41Config, engine) -> int:
    """Bytes the engine's :class:`GlobalKVStore` and :class:`SWAStore` will allocate for the
    ``EngineConfig`` ``engine`` — computed without allocating, so an impossible size is refused
    before the zeroed buffers take the host down."""
    main = vector_format(config.fp4_main_kv, "fp4_e4m3", config.head_dim).bytes_per_vector
    index = vector_format(config.fp4_indexer, "mxfp4", config.index_head_dim).bytes_per_vector
    per_page = sum((engine.page_tokens // s.compress_ratio) * (main + index) for s in config.plan if s.computes_main_kv)
    swa = vector_format(config.fp8_swa_kv, "fp8", config.head_dim).bytes_per_vector
    per_slot = len(config.plan) * config.window_size * swa
    return engine.num_pages_total * per_page + (engine.max_num_seqs + engine.swa_pool_slots) * per_slot


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def report_lines(a: dict) -> list[str]:
    """``megatron-s2 account``'s lines for the figures of :func:`account`."""
    kv = a["breakdown"]["kv"]
    p = a["breakdown"]["params"]
    lines = [
        f"model: {a['model']}",
        f"backbone parameters           {a['backbone_params']:>20,}  ({_human(a['backbone_params'])})",
        f"  embedding / head            {p['embedding']:>20,} / {p['head']:,}",
        f"  attention (CSA2 + SWA)      {p['attention']:>20,}",
        f"  MoE routed experts          {p['moe_routed']:>20,}",
        f"  MoE router + shared expert  {p['moe_other']:>20,}",
        f"  mHC + norms                 {p['mhc'] + p['norms']:>20,}",
        f"Engram parameters             {a['engram_params']:>20,}  ({_human(a['engram_params'])})",
        *([f"DSpark drafter parameters     {a['dspark_params']:>20,}  ({_human(a['dspark_params'])}; "
           f"{_human(a['dspark_activated_params'])} activated per drafted token; shares embedding / head)"]
          if a.get("dspark_params") else []),
        *([f"vision encoder parameters     {a['vision_params']:>20,}  ({_human(a['vision_params'])}; tower + "
           f"aligner + image-span embeddings; runs on image tokens only, replicated beside the embedding)"]
          if a.get("vision_params") else []),
        f"activated params / token, decode   {a['activated_params_decode']:>14,}  ({_human(a['activated_params_decode'])})",
        f"activated params / token, prefill  {a['activated_params_prefill']:>14,}  ({_human(a['activated_params_prefill'])})",
        f"global KV bytes / token (HBM)      {a['global_kv_bytes_per_token']:>14,.1f}",
        f"  main KV   [{kv['main_kv_format']}]  {kv['main_kv_bytes_per_token']:>10,.1f}",
        f"  index K   [{kv['index_k_format']}]  {kv['index_k_bytes_per_token']:>8,.1f}",
        f"persistent KV bytes / token        {a['persistent_kv_bytes_per_token']:>14,.1f}  (SWA KV not persisted)",
        f"SWA state bytes / request [{kv['swa_kv_format']}]  {a['swa_state_bytes_per_request']:,.0f}",
        f"decode FLOPs / token @ 4K          {a['decode_flops_4k']:>14.4g}",
        f"decode FLOPs / token @ 1M          {a['decode_flops_1m']:>14.4g}",
    ]
    return lines
