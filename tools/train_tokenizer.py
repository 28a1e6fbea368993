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

The corpus must hold text (inputs that are all empty are refused: the result would be learnt
from the chat format's fixed strings alone). BPE stops early when the corpus has no more pairs
seen ``--min-frequency`` times: a tokenizer that falls short of ``--vocab-size`` is written
with a note naming the size reached, and refused when it reaches less than half of it — then the
corpus is far too small for the size asked (or the size has a typo), and a tokenizer several
times smaller than the recipe expects is not what was meant.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

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
    parser.add_argument("--split-digits", action="store_true",
                        help="every digit its own token (no merge joins digits), as Llama / DeepSeek do")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    if not args.input and args.synthetic <= 0:
        print("train_tokenizer: error: give at least one --input FILE or --synthetic N", file=sys.stderr)
        return 2
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        print(f"train_tokenizer: error: --output: {output} is a file; name a directory", file=sys.stderr)
        return 2
    for path in args.input:  # before training, which may take long
        if not Path(path).is_file():
            print(f"train_tokenizer: error: --input: {path}: file not found; pass an existing .txt, .jsonl or "
                  ".parquet file", file=sys.stderr)
            return 2
    sources = [*args.input, *([f"{args.synthetic} synthetic task problems (seed {args.seed})"]
                              if args.synthetic > 0 else [])]
    documents = {path: 0 for path in args.input}  # counted while the trainer streams them
    texts = itertools.chain(format_texts(), *(_counted(iter_texts(p), documents, p) for p in args.input),
                            synthetic_texts(args.synthetic, args.seed) if args.synthetic > 0 else ())
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        out = train_bpe(texts, args.vocab_size, staging, min_frequency=args.min_frequency,
                        split_digits=args.split_digits)
        _check_corpus(documents, args.synthetic)
        _check_reached_size(out, args.vocab_size, args.min_frequency)
        different = [n for n in ("tokenizer.json", "tokenizer_config.json") if (output / n).exists()
                     and (output / n).read_bytes() != (out / n).read_bytes()]
        if different or (output.is_dir() and any(output.iterdir()) and not (output / "tokenizer.json").exists()):
            raise ConfigError(f"--output: {output} already holds {'another tokenizer' if different else 'files'}; "
                              "runs trained with it would no longer match it — write to a new directory")
        output.mkdir(exist_ok=True)
        for item in out.iterdir():
            os.replace(item, output / item.name)
        out = output
    except (DataError, ConfigError) as exc:
        print(f"train_tokenizer: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    command = "python tools/train_tokenizer.py " + " ".join(shlex.quote(a) for a in argv)
    (Path(out) / "README.md").write_text(describe(sources) + f"\nReproduce with:\n\n    {command}\n")
    from megatron_s2.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(out, field="--output")
    print(f"wrote {out}: {tokenizer.vocab_size} ids, {tokenizer.compressed_vocab_size} compressed (Engram) ids "
          f"in {time.perf_counter() - started:.1f} s")
    return 0


def _counted(texts: Iterator[str], counts: dict[str, int], path: str) -> Iterator[str]:
    for text in texts:
        counts[path] += 1
        yield text


def _check_corpus(documents: dict[str, int], synthetic: int) -> None:
    """Refuse a corpus without text; note an empty input among others."""
    empty = [path for path, count in documents.items() if count == 0]
    if empty and len(empty) == len(documents) and synthetic <= 0:
        raise ConfigError(f"--input: {', '.join(empty)} hold{'s' if len(empty) == 1 else ''} no text (0 documents); "
                          "pass files with text, or add --synthetic N")
    for path in empty:
        print(f"train_tokenizer: note: --input {path} holds no text (0 documents)", file=sys.stderr)


def _check_reached_size(out: Path, asked: int, min_frequency: int) -> None:
    """Say when BPE stopped short of ``--vocab-size``; refuse when it is under half of it."""
    from tokenizers import Tokenizer

    reached = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    if reached >= asked:
        return
    why = f"the corpus has no more pairs seen --min-frequency={min_frequency} times"
    if reached * 2 < asked:
        raise ConfigError(f"--vocab-size: {asked} asked, but {why}: it reaches only {reached} ids; add text or "
                          f"ask for --vocab-size {reached} or less")
    print(f"train_tokenizer: note: {reached} ids, not --vocab-size {asked}: {why}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
