"""The data pipeline: tokenizer, verifiable tasks, packing, indexed datasets, the loader.

Map of the package (each module's docstring has the details):

* :mod:`.tokenizer` — the tokenizer protocol, the character-level tokenizer (vocab 102) and
  :func:`load_tokenizer` (``char`` or a local Hugging Face directory, :mod:`.hf_tokenizer`).
* :mod:`.chat_format`, :mod:`.chat` — the V4-style chat template and special tokens;
  conversations -> ids with per-role loss masks; :mod:`.synthetic_chat` generates some.
* :mod:`.token_map` — the Engram compressed token map derived from tokenizer files (§2.4.2).
* :mod:`.bpe_training` — byte-level BPE training (``tools/train_tokenizer.py``).
* :mod:`.tokenizer_checks` — model/tokenizer fit; run directories and checkpoints carry theirs.
* :mod:`.records` — local .jsonl / .parquet records (via ``datasets``) and the bad-row policy.
* :mod:`.tasks` — synthetic verifiable tasks (sample / answer / exact verifier) by name.
* :mod:`.documents`, :mod:`.synthetic` — documents as token ids; generated task data.
* :mod:`.packing` — best-fit packing into ``seq_length + 1`` rows with segment ids.
* :mod:`.indexed_dataset`, :mod:`.jsonl` — ``.bin``/``.idx`` files and jsonl conversion.
* :mod:`.sample_order` — epoch-seeded shuffling and weighted blending of packed rows.
* :mod:`.images` — safe image decoding (bytes, files, data: / file:// URLs) to RGB (issue 22).
* :mod:`.procedural_images` — rendered shapes, digits and words with verifiable captions.
* :mod:`.image_text` — image-text documents (procedural / folder / parquet / webdataset) with
  image spans sized by the model family's ``ImageProcessor`` (``data.kind: image_text``).
* :mod:`.timeseries` — local .csv / .parquet / .npz series with one-line refusals, and the
  procedural seasonal + trend + noise generator with known futures and lead/lag channels (issue 24).
* :mod:`.loader` — :func:`build_data_iterator`, the trainer's entry point.

Every name below is imported with its module on first use, so that ``tools/preprocess_data.py``,
the command line and config validation start without loading torch.
"""

import importlib
from typing import Any

_MODULE_OF = {
    "DocumentStore": "documents", "InMemoryDocuments": "documents", "render_prompt_answer": "documents",
    "render_text": "documents", "DataError": "errors", "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset", "PreprocessStats": "jsonl", "preprocess_jsonl": "jsonl",
    "PackedRows": "packing", "best_fit_pack": "packing", "BlendedSampleOrder": "sample_order",
    "build_synthetic_documents": "synthetic", "generate_task_documents": "synthetic", "sample_problems": "synthetic",
    "TASK_REGISTRY": "tasks", "Task": "tasks", "TaskSample": "tasks", "build_task": "tasks", "build_tasks": "tasks",
    "CharTokenizer": "tokenizer", "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer", "DataIterator": "loader", "batch_fingerprint": "loader",
    "build_data_iterator": "loader", "load_document_stores": "loader",
    "ImageError": "images", "ImageLimits": "images", "decode_image": "images", "load_image": "images",
    "decode_data_url": "images", "load_image_url": "images", "ProceduralItem": "procedural_images",
    "procedural_item": "procedural_images", "procedural_items": "procedural_images",
    "ImageTextPair": "image_text", "ImageTextDocuments": "image_text", "load_image_text_pairs": "image_text",
    "build_image_text_documents": "image_text",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """Names load with their module on first use: importing ``megatron_s2.data.errors`` (or
    validating a config) does not load the tokenizers, numpy or torch."""
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"megatron_s2.data.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'megatron_s2.data' has no attribute {name!r}")
