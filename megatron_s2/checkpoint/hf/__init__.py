"""Hugging Face conversion of our checkpoints, for any model family.

Our checkpoints <-> Hugging Face-style sharded safetensors + ``model.safetensors.index.json``
+ ``config.json``. What depends on the architecture — the ``config.json`` spelling, the tensor
names (the V4.1 backbone: the official DeepSeek-V4.1-Flash reference naming, so that the
released checkpoint imports; FP8/FP4 weights are dequantised), what the tokenizer must match —
is the family's :class:`~megatron_s2.models.family.hf.HFAdapter`; this package is the rest:

* :mod:`.safetensors_io` — sharded writing and a reader that refuses pickles;
* :mod:`.quant`, :mod:`.tensor_source` — the release's block-scaled FP8 / FP4 formats, read
  with every tensor accounted for;
* :mod:`.gather`, :mod:`.checkpoint_io` — gather/scatter of shards; our sharded checkpoints
  read and written whole through :mod:`megatron_s2.checkpoint.offline` at any layout;
* :mod:`.convert` — :func:`export_model_state` / :func:`import_model_state` on full states;
* :mod:`.verify` — tensor and logits checks after a round trip. The commands are
  ``megatron-s2 checkpoint export|import`` (:mod:`megatron_s2.cli.hf_convert`).
"""

from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state, load_hf_checkpoint

__all__ = ["export_model_state", "import_model_state", "load_hf_checkpoint"]
