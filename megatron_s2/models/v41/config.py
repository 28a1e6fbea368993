"""Model configuration of the V4.1-Flash-style backbone.

Every field the DeepSeek-V4.1-Flash report names (§2, §4.2.1) is a field here, with the
report's value as the flagship default in ``recipes/models/flagship.yaml``. Where the report
is silent (attention sink, RoPE thetas, score function, norm epsilon, scale formats) the
semantics follow the public reference inference implementation so that released checkpoints
can be imported. Validation happens at construction; the per-layer plan (SWA / Full /
Reindex / Reuse, compression ratio, encoder vs decoder, candidate source, Engram hosts) is
derived and validated in :mod:`megatron_s2.models.v41.layer_plan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.fp8 import FP8Config
from megatron_s2.config.model_schema import LayoutRequirements, ModelSchema
from megatron_s2.config.schema import ConfigError

__all__ = ["LayerGroupSpec", "V41Config", "CONFIG_CLASS"]

AttentionMode = Literal["swa", "full", "reindex", "reuse"]


@dataclass(frozen=True)
class LayerGroupSpec:
    """A run of identically configured layer groups (§4.2.1: "three groups of six")."""

    modes: tuple[AttentionMode, ...]
    """Attention mode of each layer in one group, e.g. [full, reuse, reuse, reuse]."""
    repeat: int = 1
    """How many times the group repeats."""
    compress_ratio: int = 0
    """CSA2 compression ratio m of every layer in the group; 0 only for pure-SWA groups."""

    def __post_init__(self) -> None:
        if not self.modes:
            raise ConfigError("modes: a layer group needs at least one layer")
        if self.repeat < 1:
            raise ConfigError(f"repeat: must be >= 1, got {self.repeat}")
        swa = [m == "swa" for m in self.modes]
        if any(swa) and not all(swa):
            raise ConfigError(f"modes: a group mixes 'swa' with CSA2 modes {list(self.modes)}; split it into two groups")
        if all(swa) and self.compress_ratio != 0:
            raise ConfigError("compress_ratio: pure sliding-window groups take compress_ratio 0")
        if not all(swa) and self.compress_ratio < 1:
            raise ConfigError(f"compress_ratio: CSA2 groups need compress_ratio >= 1, got {self.compress_ratio}")

    @property
    def num_layers(self) -> int:
        return len(self.modes) * self.repeat


@dataclass(frozen=True)
class V41Config(ModelSchema):
    """The V4.1-Flash-style Causal Encoder-Decoder MoE backbone (report §2, §4.2.1), ``family: v41``.

    ``family``, ``name``, ``params_dtype`` and ``compute_dtype`` come from :class:`ModelSchema`;
    the fields redeclared here keep their place there and take the flagship's defaults."""

    # ---- sizes -------------------------------------------------------------------------
    vocab_size: int = 129280
    """Vocabulary size of the embedding and the prediction head."""
    hidden_size: int = 5120
    """Hidden dimension d (§4.2.1)."""
    num_encoder_layers: int = 20
    """Layers of the causal encoder (§2.2); the remaining layers form the CED decoder, whose
    Full layers project global KV from the last encoder layer's hidden state (Eq. 1).
    Equal to the number of layers = no decoder (a plain causal stack)."""
    layer_groups: tuple[LayerGroupSpec, ...] = ()
    """The layer plan as runs of groups, bottom to top (§4.2.1)."""

    # ---- CSA2 attention ----------------------------------------------------------------
    num_attention_heads: int = 64
    """Query heads of every attention layer."""
    head_dim: int = 512
    """Head dimension; also the width of the single shared KV latent (main and SWA KV)."""
    rope_head_dim: int = 64
    """Trailing channels of q/k that carry RoPE (the rest is position-free)."""
    q_lora_rank: int = 1280
    """Query compression dimension (§4.2.1): x -> q_lora_rank -> heads x head_dim."""
    o_groups: int = 8
    """Groups of the low-rank output projection (§4.2.1)."""
    o_lora_rank: int = 1024
    """Intermediate attention-output dimension of each output group (§4.2.1)."""
    window_size: int = 128
    """Sliding-window size n_win of the layer-local SWA branch (§2.3, §4.2.1)."""
    attn_sink: bool = True
    """Learnable per-head sink logit in the softmax denominator (reference semantics)."""
    rope_theta: float = 10000.0
    """RoPE base of pure sliding-window layers."""
    compress_rope_theta: float = 40000.0
    """RoPE base of CSA2 layers (compressed entries stand for m tokens each)."""
    rope_scaling_original_seq_len: int = 0
    """YaRN original context; 0 disables YaRN (used only by CSA2 layers, like the reference)."""
    rope_scaling_factor: float = 40.0
    """YaRN extrapolation factor."""
    rope_beta_fast: int = 32
    """YaRN fast boundary (rotations)."""
    rope_beta_slow: int = 1
    """YaRN slow boundary (rotations)."""

    # ---- indexer -----------------------------------------------------------------------
    index_num_heads: int = 32
    """Indexer query heads (§4.2.1)."""
    index_head_dim: int = 128
    """Indexer head dimension (§4.2.1)."""
    index_topk: int = 512
    """Compressed KV entries each query selects for sparse attention (§4.2.1)."""
    candidate_topk_blocks: int = 2048
    """Hierarchical Sparse Indexer: blocks kept per query by the candidate source (§2.3.2);
    0 disables the hierarchical indexer."""
    candidate_block_size: int = 8
    """Positions per candidate block (§2.3.2: 2048 blocks x 8 = 16,384 candidates)."""
    indexer_loss_coeff: float = 0.01
    """Weight of the indexer's KL alignment loss to the (detached) main attention
    distribution; the top-k selection itself carries no gradient (DSA training recipe)."""

    # ---- MoE ---------------------------------------------------------------------------
    num_routed_experts: int = 384
    """Routed experts per MoE layer (§4.2.1)."""
    num_shared_experts: int = 1
    """Shared experts per MoE layer (§4.2.1)."""
    moe_topk: int = 6
    """Routed experts activated per token (§4.2.1)."""
    moe_ffn_hidden_size: int = 2304
    """Intermediate dimension of each expert (§4.2.1)."""
    moe_score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "sqrtsoftplus"
    """Router score function."""
    moe_norm_topk_prob: bool = True
    """Renormalise the selected experts' scores to sum to one."""
    moe_route_scale: float = 1.0
    """Scale on the combine weights."""
    swiglu_limit: float = 10.0
    """SwiGLU clamp (§4.2.1): up branch clamped to [-limit, limit], gate branch from above."""
    moe_bias_update_rate: float = 0.001
    """Auxiliary-loss-free correction-bias update speed, text and image alike (§4.2.2)."""
    moe_seq_aux_loss_coeff: float = 0.0001
    """Sequence-level balance loss weight (§4.2.2)."""
    moe_modality_biases: bool = True
    """Separate correction biases for text and image tokens (§2.1.1)."""

    # ---- mHC ---------------------------------------------------------------------------
    hc_mult: int = 4
    """mHC expansion factor n: residual streams per token (§2.4.1, §4.2.1)."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the residual mixing matrix (§4.2.1)."""
    hc_eps: float = 1.0e-6
    """Epsilon of the mixing coefficients and Sinkhorn normalisation."""
    mhc_single_pass: bool = True
    """Single-Pass mHC (§2.4.1, Eq. 6): block l mixes its input with A_{l-1}."""

    # ---- Engram ------------------------------------------------------------------------
    engram_layers: tuple[int, ...] = (1, 14)
    """Zero-indexed layers hosting an Engram module (§2.4.2)."""
    engram_ngram_orders: tuple[int, ...] = (2, 3, 4)
    """N-gram orders of every Engram module (§2.4.2); must be 2..N contiguous."""
    engram_num_heads: int = 8
    """Hash heads per n-gram order (§2.4.2)."""
    engram_dim_per_order: int = 2048
    """Total embedding dimension per n-gram order, split over the heads (§2.4.2)."""
    engram_table_size: int = 16_000_000
    """Approximate entries per hash table; each table takes the next unused prime above it."""
    engram_pad_id: int = 0
    """Token id filling n-gram slots with no history (before the document start)."""
    engram_fp8_tables: bool = True
    """Fake-quantise Engram table rows to FP8 on lookup (§2.4.2 stores them in FP8)."""

    # ---- DSpark drafter (§2.4.3; names of the released config.json) -----------------------
    dspark_layers: int = 0
    """Transformer blocks of the DSpark drafter (``n_mtp_layers``); 0 = no drafter. Trained in
    its own stage after pre-training with the backbone frozen (§2.4.3)."""
    dspark_block_size: int = 5
    """Draft positions one drafter forward proposes in parallel (``dspark_block_size``)."""
    dspark_noise_token_id: int = 0
    """Token id filling the draft block after its first position (``dspark_noise_token_id``)."""
    dspark_target_layer_ids: tuple[int, ...] = ()
    """Backbone layers whose outputs (stream mean) the drafter reads, concatenated, through
    ``main_proj`` (``dspark_target_layer_ids``)."""
    dspark_markov_rank: int = 256
    """Rank of the low-rank Markov head's previous-token bias (``dspark_markov_rank``)."""
    dspark_num_routed_experts: int = 128
    """Routed experts of each drafter MoE (``dspark_n_routed_experts``)."""
    dspark_moe_topk: int = 3
    """Routed experts activated per drafted token (``dspark_n_activated_experts``)."""

    # ---- vision pathway (§2.1.1; names of the released config.json) -----------------------
    vision_n_layers: int = 0
    """Blocks of the vision tower (DeepSeek-ViT); 0 = text only, no tower, aligner or image spans."""
    vision_dim: int = 1024
    """Hidden dimension of the vision tower."""
    vision_n_heads: int = 16
    """Attention heads of the vision tower (head dim = vision_dim / vision_n_heads, a multiple of 4
    for the 2D-RoPE's row and column halves)."""
    vision_inter_dim: int = 2816
    """Intermediate dimension of the tower's SwiGLU MLP."""
    vision_patch_size: int = 14
    """Side of the square RGB patches the linear patch embedding reads."""
    vision_downsample_ratio: int = 3
    """Side r of the aligner's r x r pixel-unshuffle (3: ninefold fewer visual tokens)."""
    vision_max_n_token: int = 1024
    """Most token positions one image's span may take (grid + newlines + start/end); larger
    images are shrunk, aspect kept, to fit."""
    vision_min_pixels: int = 295936
    """Images with fewer pixels are scaled up (aspect kept) to about this many (544 x 544)."""
    vision_max_wh_ratio: float | None = None
    """Widest width / height kept; wider images are clipped to it and stretched. None: no limit."""
    vision_rope_theta: float = 10000.0
    """RoPE base of the tower's 2D rotary embedding."""
    image_token_id: int = 129264
    """Token id every position of an image span carries (``<｜deepseek_image｜>``)."""

    # ---- precision and quantisation ----------------------------------------------------
    fp4_main_kv: bool = False
    """QAT of the main (compressed) KV: E2M1 values, one E4M3 scale per 16 channels, after
    RoPE, straight-through gradient (§2.4.4). Enabled in post-training recipes."""
    fp8_swa_kv: bool = True
    """FP8 (E4M3, one power-of-two scale per 32) fake quantisation of the SWA KV (§2.4.4)."""
    fp4_indexer: bool = True
    """MXFP4 (E2M1, E8M0 scale per 32) fake quantisation of indexer Q and K (V4 QAT)."""
    norm_eps: float = 1.0e-20
    """RMSNorm epsilon (reference value)."""
    init_std: float = 0.006
    """Standard deviation of the normal initialisation of matrices."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Provider of the leaf modules: local (pure PyTorch, CPU and GPU) or Transformer Engine
    (FP8 GEMMs on NVIDIA GPUs; must be importable)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 GEMMs: recipe and targets (:mod:`megatron_s2.config.fp8`); off by default."""

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{name}: {msg}")

        positive = [
            "vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "window_size", "index_num_heads", "index_head_dim",
            "index_topk", "num_routed_experts", "moe_topk", "moe_ffn_hidden_size", "hc_mult",
            "hc_sinkhorn_iters",
        ]
        for name in positive:
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(bool(self.layer_groups), "layer_groups", "at least one layer group is required")
        need(0 < self.num_encoder_layers <= self.num_layers, "num_encoder_layers",
             f"must be in 1..{self.num_layers} (the number of layers), got {self.num_encoder_layers}")
        need(self.rope_head_dim % 2 == 0 and 0 < self.rope_head_dim <= self.head_dim, "rope_head_dim",
             f"must be even and at most head_dim={self.head_dim}, got {self.rope_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"{self.num_attention_heads} attention heads are not divisible by o_groups={self.o_groups}")
        need(self.moe_topk <= self.num_routed_experts, "moe_topk",
             f"{self.moe_topk} exceeds num_routed_experts={self.num_routed_experts}")
        need(self.num_shared_experts in (0, 1), "num_shared_experts", "0 or 1 shared expert is supported")
        need(self.candidate_topk_blocks >= 0 and self.candidate_block_size >= 0, "candidate_topk_blocks",
             "must be non-negative")
        if self.candidate_topk_blocks:
            need(self.candidate_block_size > 0, "candidate_block_size", "must be positive when the hierarchical indexer is on")
            need(self.candidate_pool_size > self.index_topk, "candidate_topk_blocks",
                 f"the candidate pool ({self.candidate_topk_blocks} blocks x {self.candidate_block_size} = "
                 f"{self.candidate_pool_size}) must be larger than index_topk={self.index_topk} (§2.3.2)")
        if self.fp4_main_kv:
            need(self.head_dim % 16 == 0, "head_dim", f"FP4 main KV quantises blocks of 16 channels; {self.head_dim} is not a multiple")
        if self.fp8_swa_kv:
            need(self.head_dim % 32 == 0, "head_dim", f"FP8 SWA KV quantises blocks of 32 channels; {self.head_dim} is not a multiple")
        if self.fp4_indexer:
            need(self.index_head_dim % 32 == 0, "index_head_dim",
                 f"MXFP4 indexer quantisation uses blocks of 32; {self.index_head_dim} is not a multiple")
        orders = tuple(self.engram_ngram_orders)
        if self.engram_layers:
            need(orders == tuple(range(2, 2 + len(orders))) and len(orders) > 0, "engram_ngram_orders",
                 f"must be the contiguous orders 2..N, got {list(orders)}")
            need(self.engram_dim_per_order % self.engram_num_heads == 0, "engram_dim_per_order",
                 f"{self.engram_dim_per_order} is not divisible by engram_num_heads={self.engram_num_heads}")
            need(self.engram_table_size >= 2, "engram_table_size", "must be at least 2")
            need(len(set(self.engram_layers)) == len(self.engram_layers), "engram_layers", "duplicate layer ids")
            for lid in self.engram_layers:
                need(0 <= lid < self.num_layers, "engram_layers", f"layer {lid} is outside 0..{self.num_layers - 1}")
            need(0 <= self.engram_pad_id < self.vocab_size, "engram_pad_id", f"must be a token id below vocab_size={self.vocab_size}")
        if self.dspark_layers:
            need(self.dspark_layers > 0, "dspark_layers", f"must be 0 (no drafter) or positive, got {self.dspark_layers}")
            targets = tuple(self.dspark_target_layer_ids)
            need(bool(targets) and len(set(targets)) == len(targets), "dspark_target_layer_ids",
                 f"the drafter needs distinct backbone layers to read, got {list(targets)}")
            for lid in targets:
                need(0 <= lid < self.num_layers, "dspark_target_layer_ids",
                     f"layer {lid} is outside 0..{self.num_layers - 1}")
            need(self.dspark_block_size >= 1, "dspark_block_size", f"must be >= 1, got {self.dspark_block_size}")
            need(0 <= self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id",
                 f"must be a token id below vocab_size={self.vocab_size}")
            need(self.dspark_markov_rank > 0, "dspark_markov_rank", "must be positive")
            need(0 < self.dspark_moe_topk <= self.dspark_num_routed_experts, "dspark_moe_topk",
                 f"must be in 1..dspark_num_routed_experts={self.dspark_num_routed_experts}")
        elif self.dspark_layers < 0:
            need(False, "dspark_layers", f"must be 0 (no drafter) or positive, got {self.dspark_layers}")
        need(self.vision_n_layers >= 0, "vision_n_layers", f"must be 0 (text only) or positive, got {self.vision_n_layers}")
        if self.vision_n_layers:
            for name in ("vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                         "vision_downsample_ratio", "vision_rope_theta"):
                need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
            need(self.vision_dim % self.vision_n_heads == 0 and (self.vision_dim // self.vision_n_heads) % 4 == 0,
                 "vision_n_heads", f"vision_dim={self.vision_dim} / {self.vision_n_heads} heads must be a head "
                 "dimension divisible by 4 (2D-RoPE rotates half of it by rows, half by columns)")
            need(self.vision_max_n_token >= 4, "vision_max_n_token",
                 f"an image span takes at least 4 positions (start, one token, newline, end), got {self.vision_max_n_token}")
            need(self.vision_min_pixels >= 0, "vision_min_pixels", f"must be non-negative, got {self.vision_min_pixels}")
            need(self.vision_max_wh_ratio is None or self.vision_max_wh_ratio >= 1, "vision_max_wh_ratio",
                 f"must be null (no limit) or >= 1, got {self.vision_max_wh_ratio}")
            need(0 <= self.image_token_id < self.vocab_size, "image_token_id",
                 f"must be a token id below vocab_size={self.vocab_size}, got {self.image_token_id}")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(self.init_std > 0, "init_std", "must be positive")
        self.fp8.check_backend(self.transformer_impl)
        # The layer plan validates mode/ratio/producer relations; build it now so that an
        # impossible plan fails at construction, never later.
        from megatron_s2.models.v41.layer_plan import LayerPlan

        LayerPlan.from_config(self)

    # ---- derived quantities ------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.layer_groups)

    @property
    def num_decoder_layers(self) -> int:
        return self.num_layers - self.num_encoder_layers

    @property
    def has_decoder(self) -> bool:
        return self.num_decoder_layers > 0

    @property
    def candidate_pool_size(self) -> int:
        return self.candidate_topk_blocks * self.candidate_block_size

    @property
    def engram_head_dim(self) -> int:
        return self.engram_dim_per_order // self.engram_num_heads

    @property
    def engram_max_ngram(self) -> int:
        return max(self.engram_ngram_orders) if self.engram_ngram_orders else 1

    @property
    def engram_num_tables(self) -> int:
        """(n-gram order, head) pairs per Engram module: one prime-sized table each."""
        return len(self.engram_ngram_orders) * self.engram_num_heads

    @property
    def mhc_mix_dim(self) -> int:
        """(2 + n) * n coefficients per token: A (n), C (n) and B (n x n)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def plan(self):
        from megatron_s2.models.v41.layer_plan import LayerPlan

        return LayerPlan.from_config(self)

    def layout_requirements(self) -> LayoutRequirements:
        return LayoutRequirements(
            tp=((self.num_attention_heads, "query heads"), (self.index_num_heads, "indexer heads"),
                (self.o_groups, "output-projection groups"), (self.vocab_size, "vocabulary entries"),
                (self.moe_ffn_hidden_size, "shared-expert width")),
            ep=((self.num_routed_experts, "routed experts"),),
            etp=((self.moe_ffn_hidden_size, "expert width"),),
            cp_min_chunk=self.window_size, engram=bool(self.engram_layers), experts=True)

    def check_tokenizer(self, vocab_size: int, pad_id: int | None, name: str) -> None:
        if self.engram_layers and self.engram_pad_id != pad_id:
            raise ConfigError(f"model.engram_pad_id: {self.engram_pad_id} is not the pad token of the tokenizer {name} "
                              f"({pad_id}); Engram fills n-gram slots before a document with the pad token, "
                              f"set model.engram_pad_id={pad_id}")

    @property
    def uses_token_map(self) -> bool:
        """Engram hashes n-grams of the tokenizer's compressed token map (§2.4.2)."""
        return bool(self.engram_layers)

    def replace(self, **changes) -> "V41Config":
        return dataclasses.replace(self, **changes)


CONFIG_CLASS = V41Config
