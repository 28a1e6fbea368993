"""The dense GQA family: ``FAMILY`` implements :class:`megatron_s2.models.family.base.ModelFamily`.

Hugging Face layout: the Llama one (``LlamaForCausalLM``: ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``), so that
``transformers`` loads an export and computes the same logits.
"""

from __future__ import annotations

from typing import Any

from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping
from megatron_s2.models.family.base import (AccountReport, CommVolume, LayerActivations, MemoryModel, ModelFamily,
                                            RankShape)
from megatron_s2.models.family.hf import BLOCK_KEY, HFAdapter
from megatron_s2.models.family.mapping_registry import MappingRegistry
from megatron_s2.models.family.param_mapping import DirectMapping
from tests.families.dense_gqa.config import DenseGQAConfig

__all__ = ["DenseGQAFamily", "FAMILY", "LLAMA_NAMES"]

L, HL = "layers.{layer}.", "model.layers.{layer}."
LLAMA_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    L + "attn_norm.weight": HL + "input_layernorm.weight",
    L + "mlp_norm.weight": HL + "post_attention_layernorm.weight",
    **{L + f"attention.{p}.weight": HL + f"self_attn.{p}_proj.weight" for p in "qkvo"},
    **{L + f"mlp.{p}.weight": HL + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


class LlamaAdapter(HFAdapter):
    registry = MappingRegistry([DirectMapping(ours, theirs) for ours, theirs in LLAMA_NAMES.items()])

    def claims(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") == "llama"

    def config_to_hf(self, cfg: DenseGQAConfig, torch_dtype: str) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": torch_dtype,
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
                "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
                "rope_theta": cfg.rope_theta, "hidden_act": "silu", "max_position_embeddings": 4096,
                "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                BLOCK_KEY: {"format_version": 1, "model": to_mapping(cfg)}}

    def config_from_hf(self, config: dict[str, Any]) -> DenseGQAConfig:
        block = config.get(BLOCK_KEY)
        if isinstance(block, dict):
            return from_mapping(DenseGQAConfig, block.get("model"), f"{BLOCK_KEY}.model")
        try:
            return DenseGQAConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                                  ffn_hidden_size=config["intermediate_size"], layers=config["num_hidden_layers"],
                                  num_attention_heads=config["num_attention_heads"],
                                  num_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
                                  head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                                  norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=config.get("rope_theta", 10000.0))
        except KeyError as exc:
            raise ConfigError(f"config.json: a Llama config needs '{exc.args[0]}'") from None


class DenseMemoryModel(MemoryModel):
    """Saved activations per layer: float32 elements per token of this implementation."""

    def __init__(self, cfg: DenseGQAConfig):
        self.cfg = cfg

    def layer_activations(self, layer: int, shape: RankShape, recompute: str) -> LayerActivations:
        c, out = self.cfg, LayerActivations(layer)
        if recompute == "full":
            out.add("block input", shape.stream_tokens * c.hidden_size)
            return out
        heads, kv = c.num_attention_heads / shape.tp, c.num_kv_heads / shape.tp
        out.add("norms", 2 * shape.stream_tokens * c.hidden_size)
        out.add("attention", shape.tokens * (c.hidden_size + (2 * heads + 2 * kv) * c.head_dim)
                + shape.batch * heads * shape.seq * shape.seq)
        out.add("mlp", shape.tokens * (c.hidden_size + 3 * c.ffn_hidden_size / shape.tp))
        return out

    def head_activations(self, shape: RankShape) -> float:
        return 4 * shape.tokens * (self.cfg.hidden_size + self.cfg.vocab_size / shape.tp)

    def transient_bytes(self, shape: RankShape, last_stage: bool) -> float:
        c = self.cfg
        scores = 4 * shape.batch * c.num_attention_heads / shape.tp * shape.seq * shape.seq * 2
        return max(scores, 8 * shape.tokens * c.vocab_size / shape.tp if last_stage else 0.0)

    def comm_volume(self, recipe, layout, pp_rank: int, grad_bytes: float, expert_grad_bytes: float = 0.0):
        t, d = recipe.training, self.cfg.hidden_size
        micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
        tokens, out = t.micro_batch_size * t.seq_length, CommVolume()
        layers = sum(len(layout.stage_layers[s]) for s in layout.stages_of_rank(pp_rank))
        ring = lambda g: 2 * (g - 1) / g if g > 1 else 0.0  # noqa: E731
        out.add("tp", 4 * micro * layers * 4 * tokens * d * ring(layout.tp))  # attention + MLP, forward + backward
        out.add("dp", ring(layout.dp) * grad_bytes)
        if layout.pp > 1:
            out.add("pp", 4 * micro * 2 * tokens * d)
        return out


class DenseGQAFamily(ModelFamily):
    name = "tests.families.dense_gqa"
    config_class = DenseGQAConfig

    def build_model(self, cfg, groups=None, *, layers=None, pre_process=True, post_process=True, portable=False):
        from tests.families.dense_gqa.model import DenseGQAModel

        return DenseGQAModel(cfg, groups, layers=layers, pre_process=pre_process, post_process=post_process)

    def check_recipe(self, recipe) -> None:
        if recipe.parallel.cp > 1:
            raise ConfigError("parallel.cp: the dense GQA family has no context parallelism; set cp: 1")
        if recipe.parallel.recompute == "selective":
            raise ConfigError("parallel.recompute: the dense GQA family recomputes whole blocks only; use full or none")

    def account(self, cfg: DenseGQAConfig) -> AccountReport:
        d, hd = cfg.hidden_size, cfg.head_dim
        attention = d * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_kv_heads)
        per_layer = attention + 3 * d * cfg.ffn_hidden_size + 2 * d
        params = 2 * cfg.vocab_size * d + cfg.layers * per_layer + d
        kv = cfg.layers * 2 * cfg.num_kv_heads * hd * 4
        figures = {"model": cfg.name, "params": params, "kv_bytes_per_token": kv}
        return AccountReport(figures, [f"model: {cfg.name}", f"parameters        {params:>12,}",
                                       f"KV bytes / token  {kv:>12,}"])

    def train_flops_per_token(self, cfg: DenseGQAConfig, seq_length: int) -> float:
        matmul = self.account(cfg).figures["params"] - 2 * cfg.hidden_size * (cfg.layers + 1)
        attention = 2 * cfg.layers * seq_length * cfg.num_attention_heads * cfg.head_dim  # causal: half of 4 s h d
        return 6.0 * matmul + 3.0 * attention

    def memory_model(self, cfg) -> DenseMemoryModel:
        return DenseMemoryModel(cfg)

    @property
    def hf(self) -> LlamaAdapter:
        return LlamaAdapter()

    def executor(self, model, config, device):
        from tests.families.dense_gqa.executor import DenseExecutor

        return DenseExecutor(model, config, device)

    def engine_cache_bytes(self, cfg, config) -> int:
        from tests.families.dense_gqa.executor import cache_bytes

        return cache_bytes(cfg, config)


FAMILY = DenseGQAFamily()
