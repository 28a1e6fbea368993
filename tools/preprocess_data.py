"""Convert jsonl / parquet documents into a megatron_s2 indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Usage::

    python tools/preprocess_data.py --input train.jsonl --output-prefix data/train
    python tools/preprocess_data.py --tokenizer recipes/tokenizers/tiny-bpe --input a.parquet --output-prefix data/a
    python -m megatron_s2.tools.preprocess_data --input a.jsonl --input b.jsonl --output-prefix data/ab

Each record is ``{"text": ...}`` (pretraining) or ``{"prompt": ..., "answer": ...}`` (SFT: the
prompt length is stored so the loader can mask it). ``--tokenizer`` is ``char`` or a tokenizer
directory, exactly as ``data.tokenizer`` in the recipe that will read the result with
``data.kind=indexed data.paths=[data/train]``. The file format is documented in
:mod:`megatron_s2.data.indexed_dataset`. Errors print one line naming the file (and line) and
the fix and exit non-zero (2 for a missing or invalid tokenizer); ``--on-bad-record skip``
skips malformed records and reports how many.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preprocess_data",
        description="Tokenise jsonl records into a megatron_s2 indexed dataset (PREFIX.bin + PREFIX.idx).",
        epilog='Each input line: {"text": ...} or {"prompt": ..., "answer": ...}.',
    )
    parser.add_argument("--input", action="append", required=True, metavar="FILE",
                        help=".jsonl or .parquet input file; repeat to concatenate several files in order")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="write PREFIX.bin and PREFIX.idx (parent folders are created)")
    parser.add_argument("--tokenizer", default="char",
                        help="'char' or a tokenizer directory, as data.tokenizer in a recipe (default: char)")
    parser.add_argument("--on-bad-record", choices=["stop", "skip"], default="stop",
                        help="a malformed record stops the conversion (default) or is skipped and counted")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(args.tokenizer, field="--tokenizer")
        stats = preprocess_jsonl(args.input, args.output_prefix, tokenizer, args.on_bad_record)
    except (DataError, ConfigError) as exc:
        print(f"preprocess_data: error: {exc}", file=sys.stderr)
        return exc.exit_code
    unknown = ""
    if stats.unknown_tokens:
        unknown = f", {stats.unknown_tokens} characters outside the alphabet stored as <unk>"
    skipped = f", {stats.skipped_records} malformed records skipped" if stats.skipped_records else ""
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents "
          f"({stats.prompt_answer_documents} prompt/answer), {stats.tokens} tokens{unknown}{skipped} "
          f"in {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
