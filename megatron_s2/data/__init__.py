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
* :mod:`.loader` — :func:`build_data_iterator`, the trainer's entry point.

Only :mod:`.loader` needs torch; it is imported on first use of its names so that
``tools/preprocess_data.py`` and config validation start without loading torch.
"""

from typing import Any

from megatron_s2.data.documents import DocumentStore, InMemoryDocuments, render_prompt_answer, render_text
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron_s2.data.jsonl import PreprocessStats, preprocess_jsonl
from megatron_s2.data.packing import PackedRows, best_fit_pack
from megatron_s2.data.sample_order import BlendedSampleOrder
from megatron_s2.data.synthetic import build_synthetic_documents, generate_task_documents, sample_problems
from megatron_s2.data.tasks import TASK_REGISTRY, Task, TaskSample, build_task, build_tasks
from megatron_s2.data.tokenizer import CharTokenizer, Tokenizer, build_tokenizer, load_tokenizer

__all__ = [
    "DataError", "Tokenizer", "CharTokenizer", "build_tokenizer", "load_tokenizer",
    "Task", "TaskSample", "TASK_REGISTRY", "build_task", "build_tasks",
    "DocumentStore", "InMemoryDocuments", "render_prompt_answer", "render_text",
    "sample_problems", "generate_task_documents", "build_synthetic_documents",
    "PackedRows", "best_fit_pack", "BlendedSampleOrder",
    "IndexedDataset", "IndexedDatasetWriter", "PreprocessStats", "preprocess_jsonl",
    "DataIterator", "build_data_iterator", "batch_fingerprint", "load_document_stores",
]

_LOADER_NAMES = {"DataIterator", "batch_fingerprint", "build_data_iterator", "load_document_stores"}


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        from megatron_s2.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'megatron_s2.data' has no attribute {name!r}")
