"""jsonl / parquet -> indexed dataset conversion (the engine behind ``tools/preprocess_data.py``).

Each record of an input file (a non-empty ``.jsonl`` line, or a ``.parquet`` row read with
``datasets``; :mod:`.records`) is one object, either

* ``{"text": "..."}`` — pretraining text, stored as ``bos + text + eos`` (prompt length 0), or
* ``{"prompt": "...", "answer": "..."}`` — stored as a one-turn chat with the tokenizer's chat
  template (character tokenizer: ``bos + prompt + sep + answer + eos``) and the prompt length,
  so SFT can mask the prompt.

Other keys are ignored. A malformed record is a :class:`~megatron_s2.data.errors.DataError`
naming ``file:line`` (``file:row N`` for parquet) — or, with ``on_bad_record="skip"``, skipped
and counted in the returned statistics; nothing is left on disk when conversion fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from megatron_s2.data.documents import render_prompt_answer, render_text
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDatasetWriter
from megatron_s2.data.records import BadRecords, iter_records
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["PreprocessStats", "read_jsonl_documents", "preprocess_jsonl"]

_FORMAT = 'each line must be {"text": ...} or {"prompt": ..., "answer": ...}'


@dataclass(frozen=True)
class PreprocessStats:
    """What a conversion wrote."""

    documents: int
    prompt_answer_documents: int
    tokens: int
    unknown_tokens: int
    """Characters outside the tokenizer's alphabet (stored as unk; 0 for byte-level BPE)."""
    skipped_records: int = 0
    """Malformed records skipped under on_bad_record='skip'."""


def read_jsonl_documents(path: str | os.PathLike, tokenizer: Tokenizer,
                         bad: BadRecords | None = None) -> Iterator[tuple[np.ndarray, int]]:
    """``(token_ids, prompt_length)`` of every record of one .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found; pass an existing .jsonl or .parquet file to --input")
    bad = bad or BadRecords("stop")
    for where, record in iter_records(path, bad):
        if "prompt" in record or "answer" in record:
            prompt, answer = record.get("prompt"), record.get("answer")
            if not isinstance(prompt, str) or not isinstance(answer, str):
                bad.report(where, f"'prompt' and 'answer' must both be strings; {_FORMAT}")
                continue
            yield render_prompt_answer(tokenizer, prompt, answer)
        elif isinstance(record.get("text"), str):
            yield render_text(tokenizer, record["text"])
        else:
            bad.report(where, f"no string 'text' or 'prompt'/'answer' keys (found {sorted(record)}); {_FORMAT}")


def preprocess_jsonl(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
                     tokenizer: Tokenizer, on_bad_record: str = "stop") -> PreprocessStats:
    """Tokenise every record of ``inputs`` (in order) into ``output_prefix.bin/.idx``."""
    if not inputs:
        raise DataError("no input files given; pass at least one --input FILE.jsonl")
    for path in inputs:
        if not Path(path).is_file():
            raise DataError(f"{path}: input file not found; pass an existing .jsonl or .parquet file to --input")
    documents = prompt_answer = tokens = unknown = 0
    bad = BadRecords(on_bad_record)
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size) as writer:
        for path in inputs:
            for ids, prompt_length in read_jsonl_documents(path, tokenizer, bad):
                writer.add_document(ids, prompt_length)
                documents += 1
                prompt_answer += prompt_length > 0
                tokens += len(ids)
                if tokenizer.unk_id is not None:
                    unknown += int(np.count_nonzero(ids == tokenizer.unk_id))
        if documents == 0:
            raise DataError(f"inputs {[str(p) for p in inputs]} hold no records; {_FORMAT}")
    return PreprocessStats(documents=documents, prompt_answer_documents=prompt_answer, tokens=tokens,
                           unknown_tokens=unknown, skipped_records=bad.count)
