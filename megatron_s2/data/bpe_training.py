"""Training a byte-level BPE tokenizer with the V4-style chat format (``tools/train_tokenizer.py``).

:func:`train_bpe` runs the ``tokenizers`` BPE trainer over texts with a GPT-2 style byte-level
pre-tokenizer (every string encodes; no unknown token), puts the special tokens of
:mod:`.chat_format` first (ids 0 .. 13: bos, eos, pad, role markers, think and tool delimiters)
and writes a directory :class:`~megatron_s2.data.hf_tokenizer.HFTokenizer` loads:
``tokenizer.json`` and ``tokenizer_config.json`` (special tokens + the V4-style chat template).
The trainer is deterministic: the same texts in the same order give byte-identical files, so a
shipped tokenizer is reproduced by re-running the command recorded in its ``README.md``.

Text sources (:func:`iter_texts`): ``.txt`` (one document per non-empty line), ``.jsonl`` and
``.parquet`` (``text`` fields, or the contents of ``messages``), and the embedded synthetic
tasks (:mod:`.synthetic`), rendered as the prompt/answer text a chat would hold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.chat_format import CHAT_TEMPLATE, SPECIAL_TOKEN_NAMES, SPECIAL_TOKENS, reasoning_effort_line
from megatron_s2.data.errors import DataError

__all__ = ["MIN_VOCAB_SIZE", "train_bpe", "iter_texts", "synthetic_texts", "format_texts", "describe"]

MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
"""Special tokens plus the 256 byte symbols of the byte-level alphabet."""


def synthetic_texts(count: int, seed: int) -> Iterator[str]:
    """Prompt and answer texts of ``count`` synthetic task problems (default tasks)."""
    from megatron_s2.config.data import TASK_NAMES, TaskDifficulty
    from megatron_s2.data.synthetic import sample_problems
    from megatron_s2.data.tasks import build_tasks

    for problem in sample_problems(build_tasks(TASK_NAMES, TaskDifficulty()), count, seed):
        yield problem.prompt
        yield problem.answer


def format_texts() -> Iterator[str]:
    """Fixed strings of the chat format (the §5.1.4 effort line, the tools header), so that
    they tokenize compactly even when the corpus never contains them."""
    for effort in (1, 25, 50, 75, 100):
        yield reasoning_effort_line(effort)
    yield "## Tools"


def iter_texts(path: str | os.PathLike) -> Iterator[str]:
    """Documents of one local text file (.txt, .jsonl or .parquet; see module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--input: {path}: file not found; pass an existing .txt, .jsonl or .parquet file")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                    f"{exc.start + 1}); re-encode the file as UTF-8") from None
                if line.strip():
                    yield line.rstrip("\n")
        return
    if suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported input type '{suffix}'; use .txt, .jsonl or .parquet")
    from megatron_s2.data.records import iter_records

    for where, record in iter_records(path):
        if isinstance(record.get("text"), str):
            yield record["text"]
        elif isinstance(record.get("messages"), list):
            yield from (m["content"] for m in record["messages"] if isinstance(m, dict)
                        and isinstance(m.get("content"), str))
        else:
            raise DataError(f"{where}: no 'text' string or 'messages' list")


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
              min_frequency: int = 2, model_max_length: int = 1 << 20, split_digits: bool = False) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids on ``texts`` and write it to ``out_dir``.

    ``split_digits``: every digit is its own pre-token (as Llama's and DeepSeek's tokenizers do), so
    no merge ever joins digits: "47+38" is 4 7 + 3 8, and a model can learn arithmetic digit by digit
    instead of one embedding per number (which leaves a small model a lookup table that does not
    generalise to unseen operand pairs).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size: a byte-level BPE with the {len(SPECIAL_TOKENS)} chat special tokens "
                        f"needs at least {MIN_VOCAB_SIZE} ids, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKEN_NAMES["bos"],
        "eos_token": SPECIAL_TOKEN_NAMES["eos"],
        "pad_token": SPECIAL_TOKEN_NAMES["pad"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def describe(sources: Sequence[str]) -> str:
    """A short README for a trained tokenizer directory (what it is, how to reproduce it)."""
    return ("# Byte-level BPE tokenizer (megatron_s2)\n\n"
            f"Trained by `tools/train_tokenizer.py` on: {', '.join(sources)}.\n"
            "Special tokens and chat template: `megatron_s2/data/chat_format.py` (V4-style, §5.1.4 effort line).\n")
