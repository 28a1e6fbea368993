"""Train a byte-level BPE tokenizer with the V4-style special tokens and chat template.

Usage::

    python tools/train_tokenizer.py --output DIR --vocab-size 32000 --input corpus.txt --input more.jsonl
    python -m megatron_s2.tools.train_tokenizer --output recipes/tokenizers/tiny-bpe --vocab-size 512 \\
        --synthetic 20000

Inputs: ``.txt`` (one document per line), ``.jsonl`` / ``.parquet`` (``text`` or ``messages``
records), and ``--synthetic N`` problems of the embedded synthetic tasks (seed ``--seed``). The
fixed strings of the chat format (the §5.1.4 reasoning-effort line) are always included. The
result (``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``README.md``
with the command) is what a recipe names in ``data.tokenizer``; training is deterministic, so
the same command reproduces the files byte for byte. Errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.bpe_training import describe, format_texts, iter_texts, synthetic_texts, train_bpe
from megatron_s2.data.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, metavar="DIR", help="tokenizer directory to write")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in the trained tokenizer (>= 270)")
    parser.add_argument("--input", action="append", default=[], metavar="FILE",
                        help=".txt, .jsonl or .parquet text source; repeat for several")
    parser.add_argument("--synthetic", type=int, default=0, metavar="N",
                        help="also train on N problems of the embedded synthetic tasks")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the synthetic problems")
    parser.add_argument("--min-frequency", type=int, default=2, help="smallest pair count that is merged")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    if not args.input and args.synthetic <= 0:
        print("train_tokenizer: error: give at least one --input FILE or --synthetic N", file=sys.stderr)
        return 2
    sources = [*args.input, *([f"{args.synthetic} synthetic task problems (seed {args.seed})"]
                              if args.synthetic > 0 else [])]
    texts = itertools.chain(format_texts(), *(iter_texts(p) for p in args.input),
                            synthetic_texts(args.synthetic, args.seed) if args.synthetic > 0 else ())
    try:
        out = train_bpe(texts, args.vocab_size, args.output, min_frequency=args.min_frequency)
    except (DataError, ConfigError) as exc:
        print(f"train_tokenizer: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    command = "python tools/train_tokenizer.py " + " ".join(shlex.quote(a) for a in argv)
    (Path(out) / "README.md").write_text(describe(sources) + f"\nReproduce with:\n\n    {command}\n")
    from megatron_s2.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(out, field="--output")
    print(f"wrote {out}: {tokenizer.vocab_size} ids, {tokenizer.compressed_vocab_size} compressed (Engram) ids "
          f"in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
