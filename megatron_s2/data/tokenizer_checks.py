"""A model and its tokenizer stay together: fit checks, the run's copy, the checkpoint's copy.

A trained model is a function of token ids *and* of the tokenizer that produced them: the
embedding rows mean that tokenizer's tokens, and Engram hashes n-grams through the
tokenizer's compressed token map (§2.4.2), a property of its files. Hence:

* :func:`check_tokenizer_fits` — the model has a row for every token id, and its Engram pad
  id is the tokenizer's pad token (the released model's 2 is its pad, as in ours);
* :func:`record_run_tokenizer` — the trainer writes the tokenizer's files to
  ``<run_dir>/tokenizer/`` when a run starts, and refuses to continue a run directory that was
  trained with different files;
* :func:`find_checkpoint_tokenizer` — the tokenizer a checkpoint was trained (or imported)
  with: ``tokenizer/`` in the step directory, beside it in ``checkpoints/``, or in the run
  directory; :func:`check_checkpoint_tokenizer` refuses to start from a checkpoint whose
  tokenizer differs from the recipe's.

Every refusal is a :class:`ConfigError` naming the field and the path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["RUN_TOKENIZER_DIR", "check_tokenizer_fits", "record_run_tokenizer", "find_checkpoint_tokenizer",
           "check_checkpoint_tokenizer"]

RUN_TOKENIZER_DIR = "tokenizer"
"""Folder (in a run directory, a checkpoints directory or an export) holding the tokenizer files."""


def check_tokenizer_fits(tokenizer: Tokenizer, model: ModelSchema, name: str = "data.tokenizer") -> None:
    """Raise ConfigError unless ``model`` can be trained on ``tokenizer``'s ids."""
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"model.vocab_size: {model.vocab_size} is smaller than the {tokenizer.vocab_size} ids of "
                          f"the tokenizer {name}; set model.vocab_size >= {tokenizer.vocab_size}")
    model.check_tokenizer(tokenizer.vocab_size, tokenizer.pad_id, name)  # the family's own rules


def record_run_tokenizer(tokenizer: Tokenizer, run_dir: str | os.PathLike) -> Path:
    """Write the tokenizer's files to ``<run_dir>/tokenizer/`` (atomically) unless the same
    files are already there; different files there are a ConfigError."""
    target = Path(run_dir) / RUN_TOKENIZER_DIR
    if target.exists():
        existing = load_tokenizer(target, field=f"{target}")
        if existing.fingerprint() != tokenizer.fingerprint():
            raise ConfigError(f"data.tokenizer: the run directory {run_dir} was trained with the tokenizer saved in "
                              f"{target}, which differs from this recipe's; use a new run directory or the same "
                              "tokenizer")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=target.parent))
    try:
        tokenizer.save(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def find_checkpoint_tokenizer(step_dir: str | os.PathLike) -> Path | None:
    """The tokenizer folder of a checkpoint step directory (step, checkpoints/, run dir), or None."""
    step_dir = Path(step_dir)
    for folder in (step_dir, step_dir.parent, step_dir.parent.parent):
        if (folder / RUN_TOKENIZER_DIR).is_dir():
            return folder / RUN_TOKENIZER_DIR
    return None


def check_checkpoint_tokenizer(step_dir: str | os.PathLike, tokenizer: Tokenizer, log=print) -> None:
    """Refuse to start from a checkpoint trained with another tokenizer (``checkpoint.load``)."""
    found = find_checkpoint_tokenizer(step_dir)
    if found is None:
        log(f"checkpoint: {step_dir} carries no tokenizer files; assuming it was trained with this recipe's")
        return
    if load_tokenizer(found, field=str(found)).fingerprint() != tokenizer.fingerprint():
        raise ConfigError(f"checkpoint.load: {step_dir} was trained with the tokenizer in {found}, which differs from "
                          "data.tokenizer; its embeddings and Engram hashes mean other tokens — use that tokenizer")
