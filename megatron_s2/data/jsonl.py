"""jsonl -> indexed dataset conversion (the engine behind ``tools/preprocess_data.py``).

Each non-empty line of an input file is one JSON object, either

* ``{"text": "..."}`` — pretraining text, stored as ``bos + text + eos`` (prompt length 0), or
* ``{"prompt": "...", "answer": "..."}`` — stored as ``bos + prompt + sep + answer + eos`` with
  prompt length ``len(prompt) + 2`` so SFT can mask the prompt.

Other keys are ignored. A malformed line is a :class:`~megatron_s2.data.errors.DataError`
naming ``file:line``; nothing is left on disk when conversion fails.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from megatron_s2.data.documents import render_prompt_answer, render_text
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDatasetWriter
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
    """Characters outside the tokenizer's alphabet (stored as unk)."""


def read_jsonl_documents(path: str | os.PathLike, tokenizer: Tokenizer) -> Iterator[tuple[np.ndarray, int]]:
    """``(token_ids, prompt_length)`` of every record of one jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found; pass an existing .jsonl file to --input")
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg}); {_FORMAT}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object; {_FORMAT}")
            if "prompt" in record or "answer" in record:
                prompt, answer = record.get("prompt"), record.get("answer")
                if not isinstance(prompt, str) or not isinstance(answer, str):
                    raise DataError(f"{where}: 'prompt' and 'answer' must both be strings; {_FORMAT}")
                yield render_prompt_answer(tokenizer, prompt, answer)
            elif isinstance(record.get("text"), str):
                yield render_text(tokenizer, record["text"])
            else:
                raise DataError(f"{where}: no string 'text' or 'prompt'/'answer' keys "
                                f"(found {sorted(record)}); {_FORMAT}")


def preprocess_jsonl(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
                     tokenizer: Tokenizer) -> PreprocessStats:
    """Tokenise every record of ``inputs`` (in order) into ``output_prefix.bin/.idx``."""
    if not inputs:
        raise DataError("no input files given; pass at least one --input FILE.jsonl")
    for path in inputs:
        if not Path(path).is_file():
            raise DataError(f"{path}: input file not found; pass an existing .jsonl file to --input")
    documents = prompt_answer = tokens = unknown = 0
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size) as writer:
        for path in inputs:
            for ids, prompt_length in read_jsonl_documents(path, tokenizer):
                writer.add_document(ids, prompt_length)
                documents += 1
                prompt_answer += prompt_length > 0
                tokens += len(ids)
                unknown += int(np.count_nonzero(ids == tokenizer.unk_id))
        if documents == 0:
            raise DataError(f"inputs {[str(p) for p in inputs]} hold no records; {_FORMAT}")
    return PreprocessStats(documents=documents, prompt_answer_documents=prompt_answer, tokens=tokens,
                           unknown_tokens=unknown)
