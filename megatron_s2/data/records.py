"""Records of local ``.jsonl`` and ``.parquet`` files, each with the place it came from.

Only local files are read; nothing is downloaded. ``.jsonl`` is parsed line by line here so
that a malformed row is named by ``file:line``; ``.parquet`` goes through Hugging Face
``datasets`` (``Dataset.from_parquet``, in memory, with ``HF_DATASETS_OFFLINE=1``) and a row is
named ``file:row N`` (1-based). :class:`BadRecords` applies a recipe's policy to malformed
rows: ``stop`` raises at the first one, ``skip`` counts them (and keeps the first few reasons)
so that nothing is dropped without a count in the log.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from megatron_s2.data.errors import DataError

__all__ = ["iter_records", "BadRecords", "SUPPORTED_SUFFIXES", "resolve_local_path"]

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


def resolve_local_path(name: str | os.PathLike) -> Path:
    """A file or directory named in a recipe: as given (absolute, or relative to the working
    directory), else relative to the project root (the folder holding ``recipes/``), so the
    shipped recipes run from any directory."""
    path = Path(name)
    if path.is_absolute() or path.exists():
        return path
    from megatron_s2.config.recipe import RECIPES_DIR

    under_root = RECIPES_DIR.parent / path
    return under_root if under_root.exists() else path


@dataclass
class BadRecords:
    """Malformed-row policy and tally (``data.on_bad_record``)."""

    policy: Literal["stop", "skip"] = "stop"
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def report(self, where: str, reason: str) -> None:
        """Raise (``stop``) or count (``skip``) a malformed record at ``where``."""
        message = f"{where}: {reason}"
        if self.policy == "stop":
            raise DataError(message + " (set data.on_bad_record=skip to skip such rows with a count)")
        self.count += 1
        if len(self.examples) < 3:
            self.examples.append(message)

    def summary(self) -> str | None:
        if not self.count:
            return None
        return f"skipped {self.count} malformed record(s); first: " + " | ".join(self.examples)


def _jsonl(path: Path, bad: BadRecords | None) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                reason = f"not valid JSON ({exc.msg})"
            else:
                if isinstance(record, dict):
                    yield where, record
                    continue
                reason = f"expected a JSON object, got {type(record).__name__}"
            if bad is None:
                raise DataError(f"{where}: {reason}")
            bad.report(where, reason)


def _parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset

    try:
        dataset = Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as parquet ({type(exc).__name__}: {exc})") from None
    for row, record in enumerate(dataset, start=1):
        yield f"{path}:row {row}", record


def iter_records(path: str | os.PathLike, bad: BadRecords | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` of every record of a local .jsonl or .parquet file, in order."""
    path = resolve_local_path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; data.paths must name existing local .jsonl or .parquet files")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(path, bad)
    elif suffix == ".parquet":
        yield from _parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type '{suffix}'; use {' or '.join(SUPPORTED_SUFFIXES)}")
