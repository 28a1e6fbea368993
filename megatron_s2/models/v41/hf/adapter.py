"""The V4.1 backbone's Hugging Face adapter: the DeepSeek-V4.1-Flash release layout.

``config.json`` <-> :class:`~megatron_s2.models.v41.config.V41Config` (:mod:`.config_json`), the
tensor-name table (:mod:`.mapping`), and the tokenizer fact the release states: its
``engram_compressed_vocab_size`` must equal the tokenizer's compressed token map, or every
Engram hash multiplier differs (§2.4.2, reference behaviour).
"""

from __future__ import annotations

from typing import Any

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.hf import HFAdapter
from megatron_s2.models.v41.hf import config_json
from megatron_s2.models.v41.hf.context import ConversionContext
from megatron_s2.models.v41.hf.mapping import V41_REGISTRY, v41_registry

__all__ = ["V41HFAdapter"]

# ModelArgs' flat spelling (the reference inference code's own config.json): these keys name it.
_FLAT_MARKERS = ("kv_source_layers", "index_source_layers", "compress_ratios")


class V41HFAdapter(HFAdapter):
    @property
    def registry(self):
        return V41_REGISTRY

    def registry_for(self, config: dict[str, Any]):
        """With a DSpark drafter (§2.4.3) / a vision tower (§2.1.1) in the config their ``mtp.*`` /
        ``vision.*``, ``aligner.*``, ``image_*`` tensors are imported, else skipped and reported."""
        text = config.get("text_config", config)
        return v41_registry(drafter=config_json.has_drafter(text), vision=config_json.has_vision(text))

    def claims(self, config: dict[str, Any]) -> bool:
        text = config.get("text_config", config)
        archs = config.get("architectures") or []
        return (config.get("model_type") == config_json.MODEL_TYPE or config_json.ARCHITECTURE in archs
                or (isinstance(text, dict) and any(k in text for k in _FLAT_MARKERS)))

    def config_to_hf(self, cfg, torch_dtype: str) -> dict[str, Any]:
        return config_json.config_to_hf(cfg, torch_dtype)

    def config_from_hf(self, config: dict[str, Any]):
        return config_json.config_from_hf(config)

    def context(self, cfg) -> ConversionContext:
        return ConversionContext(cfg)

    def annotate_export(self, config: dict[str, Any], cfg, tokenizer) -> None:
        if tokenizer is not None and cfg.engram_layers:
            config["text_config"]["engram_compressed_vocab_size"] = tokenizer.compressed_vocab_size

    def check_tokenizer(self, config: dict[str, Any], tokenizer, where: str) -> None:
        text = config.get("text_config", config)
        stated = text.get("engram_compressed_vocab_size") if isinstance(text, dict) else None
        if stated is not None and int(stated) != tokenizer.compressed_vocab_size:
            raise ConfigError(f"{where}: config.json states engram_compressed_vocab_size={stated}, but the tokenizer's "
                              f"compressed token map has {tokenizer.compressed_vocab_size} ids; use the tokenizer the "
                              "checkpoint was trained with")
