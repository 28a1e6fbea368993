"""Convert jsonl documents into a megatron_s2 indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Usage::

    python tools/preprocess_data.py --input train.jsonl --output-prefix data/train
    python -m megatron_s2.tools.preprocess_data --input a.jsonl --input b.jsonl --output-prefix data/ab

Each line is ``{"text": ...}`` (pretraining) or ``{"prompt": ..., "answer": ...}`` (SFT: the
prompt length is stored so the loader can mask it). Point a recipe at the result with
``data.kind=indexed data.paths=[data/train]``. The file format is documented in
:mod:`megatron_s2.data.indexed_dataset`. Errors print one line naming the file and the fix
and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from megatron_s2.config.data import DataConfig
from megatron_s2.data.errors import DataError
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import build_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preprocess_data",
        description="Tokenise jsonl records into a megatron_s2 indexed dataset (PREFIX.bin + PREFIX.idx).",
        epilog='Each input line: {"text": ...} or {"prompt": ..., "answer": ...}.',
    )
    parser.add_argument("--input", action="append", required=True, metavar="FILE.jsonl",
                        help="jsonl input file; repeat to concatenate several files in order")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="write PREFIX.bin and PREFIX.idx (parent folders are created)")
    parser.add_argument("--tokenizer", default="char", choices=["char"],
                        help="tokenizer kind, as data.tokenizer in a recipe (default: char)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        tokenizer = build_tokenizer(DataConfig(tokenizer=args.tokenizer))
        stats = preprocess_jsonl(args.input, args.output_prefix, tokenizer)
    except DataError as exc:
        print(f"preprocess_data: error: {exc}", file=sys.stderr)
        return exc.exit_code
    unknown = ""
    if stats.unknown_tokens:
        unknown = f", {stats.unknown_tokens} characters outside the alphabet stored as <unk>"
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents "
          f"({stats.prompt_answer_documents} prompt/answer), {stats.tokens} tokens{unknown} "
          f"in {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
