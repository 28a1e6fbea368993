"""The Intern-S2 family: ``FAMILY`` implements :class:`megatron_s2.models.family.base.ModelFamily`.

Accounting (``megatron-s2 account``): total and active parameters (``moe_topk`` of the routed
experts), the recurrent state a request holds (fixed, whatever its length: Gated DeltaNet conv
+ float32 delta-rule states) against the KV bytes each token adds (full-attention layers only).
"""

from __future__ import annotations

from megatron_s2.models.family.base import (AccountReport, CommVolume, LayerActivations, MemoryModel, ModelFamily,
                                            RankShape)
from megatron_s2.models.intern_s2.config import FAMILY_NAME, FULL, InternS2Config
from megatron_s2.models.intern_s2.hf import QwenMoEAdapter

__all__ = ["InternS2Family", "FAMILY", "parameter_counts"]


def _elem(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2}[dtype]


def parameter_counts(cfg: InternS2Config) -> dict[str, int]:
    """Parameters by component (full model, all experts) and the active ones per token."""
    d, e = cfg.hidden_size, cfg.num_routed_experts
    conv_channels = 2 * cfg.linear_key_dim + cfg.linear_value_dim
    linear = (d * conv_channels + conv_channels * cfg.linear_conv_kernel + 2 * d * cfg.linear_value_dim
              + 2 * d * cfg.linear_num_value_heads + 2 * cfg.linear_num_value_heads + cfg.linear_value_head_dim)
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
    full = d * 2 * heads * hd + 2 * d * kv * hd + heads * hd * d + 2 * hd
    shared = 3 * d * cfg.shared_expert_ffn_hidden_size + (d if cfg.shared_expert_ffn_hidden_size else 0)
    expert = 3 * d * cfg.moe_ffn_hidden_size
    n_lin, n_full = len(cfg.linear_layers), len(cfg.full_layers)
    counts = {"embedding": cfg.vocab_size * d, "head": cfg.vocab_size * d + d,
              "gated_deltanet": n_lin * linear, "gated_attention": n_full * full,
              "norms": cfg.layers * 2 * d, "routers": cfg.layers * e * d, "shared_experts": cfg.layers * shared,
              "routed_experts": cfg.layers * e * expert}
    counts["total"] = sum(counts.values())
    counts["active"] = counts["total"] - cfg.layers * (e - cfg.moe_topk) * expert
    return counts


class InternMemoryModel(MemoryModel):
    """Saved activations per layer (float32 elements per token of this implementation)."""

    def __init__(self, cfg: InternS2Config):
        self.cfg = cfg

    def layer_activations(self, layer: int, shape: RankShape, recompute: str) -> LayerActivations:
        c, out = self.cfg, LayerActivations(layer)
        if recompute == "full":
            out.add("block input", shape.stream_tokens * c.hidden_size)
            return out
        out.add("norms", 2 * shape.stream_tokens * c.hidden_size)
        if c.mixers[layer] == FULL:
            heads, kv = c.num_attention_heads / shape.tp, c.num_kv_heads / shape.tp
            out.add("attention", shape.tokens * (c.hidden_size + (4 * heads + 2 * kv) * c.head_dim)
                    + shape.batch * heads * shape.seq * shape.seq)
        else:  # projections, conv in/out, the chunk matrices (C per token per head) and states per chunk
            vh = c.linear_num_value_heads / shape.tp
            width = (2 * c.linear_key_dim + 3 * c.linear_value_dim) / shape.tp
            chunk = vh * (2 * c.gdn_chunk_size + c.linear_key_head_dim + c.linear_value_head_dim)
            states = vh * c.linear_key_head_dim * c.linear_value_head_dim / c.gdn_chunk_size
            out.add("gated deltanet", shape.tokens * (c.hidden_size + 2 * width + chunk + states))
        routed = shape.moe_tokens * c.moe_topk
        out.add("moe", routed * (c.hidden_size + 3 * c.moe_ffn_hidden_size / shape.etp)
                + shape.tokens * 3 * c.shared_expert_ffn_hidden_size / shape.tp)
        return out

    def head_activations(self, shape: RankShape) -> float:
        return 4 * shape.tokens * (self.cfg.hidden_size + self.cfg.vocab_size / shape.tp)

    def transient_bytes(self, shape: RankShape, last_stage: bool) -> float:
        c = self.cfg
        scores = 4 * shape.batch * c.num_attention_heads / shape.tp * shape.seq * shape.seq * 2 if c.full_layers else 0
        return max(scores, 8 * shape.tokens * c.vocab_size / shape.tp if last_stage else 0.0)

    def comm_volume(self, recipe, layout, pp_rank: int, grad_bytes: float, expert_grad_bytes: float = 0.0):
        t, d = recipe.training, self.cfg.hidden_size
        micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
        tokens, out = t.micro_batch_size * t.seq_length, CommVolume()
        layers = sum(len(layout.stage_layers[s]) for s in layout.stages_of_rank(pp_rank))
        ring = lambda g: 2 * (g - 1) / g if g > 1 else 0.0  # noqa: E731
        out.add("tp", 4 * micro * layers * 3 * tokens * d * ring(layout.tp))  # mixer, shared expert, routed gather
        if layout.ep > 1:  # dispatch + combine, forward and backward, of the routed copies
            out.add("ep", 4 * micro * layers * tokens * self.cfg.moe_topk * d * 4 * (layout.ep - 1) / layout.ep)
        out.add("dp", ring(layout.dp) * grad_bytes)
        if layout.pp > 1:
            out.add("pp", 4 * micro * 2 * tokens * d)
        return out


class InternS2Family(ModelFamily):
    name = FAMILY_NAME
    config_class = InternS2Config

    def build_model(self, cfg, groups=None, *, layers=None, pre_process=True, post_process=True, portable=False):
        from megatron_s2.models.intern_s2.model import InternS2Model

        return InternS2Model(cfg, groups, layers=layers, pre_process=pre_process, post_process=post_process)

    def describe(self, model, cfg) -> list[str]:
        return [f"precision: parameters {cfg.params_dtype}, compute {cfg.compute_dtype}; norms, RoPE, router, "
                "delta-rule states and head in float32",
                f"mixers: {len(cfg.linear_layers)} Gated DeltaNet + {len(cfg.full_layers)} gated attention; "
                f"delta rule: {self._delta_rule_impl(model)}"]

    @staticmethod
    def _delta_rule_impl(model) -> str:
        from megatron_s2.models.intern_s2.gated_delta import fla_available

        on_cuda = any(p.is_cuda for p in model.parameters())
        if on_cuda and fla_available():
            return "fla-core fused kernels (torch chunked form for packed documents)"
        return "torch chunked (WY) form" + ("; install fla-core for the fused CUDA kernels" if on_cuda else "")

    def account(self, cfg: InternS2Config) -> AccountReport:
        from megatron_s2.models.intern_s2.executor import kv_bytes_per_token, state_bytes_per_request

        counts = parameter_counts(cfg)
        state, kv = state_bytes_per_request(cfg), kv_bytes_per_token(cfg)
        figures = {"model": cfg.name, "params": counts["total"], "active_params": counts["active"],
                   "components": {k: v for k, v in counts.items() if k not in ("total", "active")},
                   "recurrent_state_bytes_per_request": state, "kv_bytes_per_token": kv,
                   "linear_layers": len(cfg.linear_layers), "full_attention_layers": len(cfg.full_layers)}
        lines = [f"model: {cfg.name} ({len(cfg.linear_layers)} Gated DeltaNet + {len(cfg.full_layers)} gated "
                 f"attention layers, {cfg.num_routed_experts} experts top-{cfg.moe_topk})",
                 f"parameters              {counts['total']:>16,}",
                 f"active per token        {counts['active']:>16,}"]
        lines += [f"  {k:<22}{v:>16,}" for k, v in counts.items() if k not in ("total", "active")]
        lines += [f"recurrent state/request {state:>16,} bytes (any length)",
                  f"KV bytes / token        {kv:>16,} ({cfg.compute_dtype}, full-attention layers only)"]
        return AccountReport(figures, lines)

    def train_flops_per_token(self, cfg: InternS2Config, seq_length: int) -> float:
        counts = parameter_counts(cfg)
        matmul = counts["active"] - counts["embedding"] - counts["norms"]
        attention = 2 * len(cfg.full_layers) * seq_length * cfg.num_attention_heads * cfg.head_dim  # causal half
        c, vh = cfg.gdn_chunk_size, cfg.linear_num_value_heads
        delta = 2 * len(cfg.linear_layers) * vh * (2 * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                                                  + c * (cfg.linear_key_head_dim + cfg.linear_value_head_dim))
        return 6.0 * matmul + 3.0 * (attention + delta)

    def memory_model(self, cfg) -> InternMemoryModel:
        return InternMemoryModel(cfg)

    @property
    def hf(self) -> QwenMoEAdapter:
        return QwenMoEAdapter()

    def executor(self, model, config, device):
        from megatron_s2.models.intern_s2.executor import HybridExecutor

        return HybridExecutor(model, config, device)

    def check_engine(self, cfg, config) -> None:
        from megatron_s2.models.intern_s2.executor import check_engine_config

        check_engine_config(config)

    def engine_cache_bytes(self, cfg, config) -> int:
        from megatron_s2.models.intern_s2.executor import cache_bytes

        return cache_bytes(cfg, config)


FAMILY = InternS2Family()
