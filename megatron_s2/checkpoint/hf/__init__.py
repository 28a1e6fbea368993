"""Hugging Face conversion of V4.1 checkpoints (issue 7: "HF conversion with built-in verification").

Our checkpoints <-> Hugging Face-style sharded safetensors + ``model.safetensors.index.json``
+ ``config.json``, in the naming of the official DeepSeek-V4.1-Flash reference so that the
released checkpoint imports (FP8/FP4 weights are dequantised) and produces the same logits.

* :mod:`.param_mapping`, :mod:`.registry`, :mod:`.v41_bridge` — the declarative mapping table
  (wildcards ``{layer}`` / ``{expert}``, grouped-expert split/merge, Engram row padding,
  exact import substitutes) and the drivers that apply it;
* :mod:`.hf_config` — ``config.json`` <-> :class:`~megatron_s2.config.model.ModelConfig`;
* :mod:`.safetensors_io` — sharded writing and a reader that refuses pickles;
* :mod:`.quant` — the release's block-scaled FP8 / FP4 formats;
* :mod:`.skeleton`, :mod:`.gather`, :mod:`.checkpoint_io` — names, ShardSpecs and per-rank
  states of any layout without allocating the model; gather/scatter; our sharded checkpoints
  read and written whole through :mod:`megatron_s2.checkpoint.offline`;
* :mod:`.convert` — :func:`export_model_state` / :func:`import_model_state` on full states;
* :mod:`.verify` — tensor and logits checks after a round trip; :mod:`.cli` — the commands.
"""

from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state, load_hf_checkpoint
from megatron_s2.checkpoint.hf.v41_bridge import V41_REGISTRY

__all__ = ["export_model_state", "import_model_state", "load_hf_checkpoint", "V41_REGISTRY"]
