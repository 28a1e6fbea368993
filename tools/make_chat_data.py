"""Write synthetic multi-turn chat conversations (all roles, tool calls, effort levels) as jsonl.

Usage::

    python tools/make_chat_data.py --output recipes/data/tiny_chat.jsonl --count 300 --seed 7

The records (:mod:`megatron_s2.data.synthetic_chat`) are what ``data.kind: chat`` reads; the
shipped ``recipes/data/tiny_chat.jsonl`` is reproduced byte for byte by the command above.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from megatron_s2.data.synthetic_chat import synthetic_conversations


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_chat_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help=".jsonl file to write")
    parser.add_argument("--count", type=int, default=300, help="conversations")
    parser.add_argument("--seed", type=int, default=7, help="generation seed")
    args = parser.parse_args(argv)
    if args.count < 1:
        print("make_chat_data: error: --count must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in synthetic_conversations(args.count, args.seed)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(lines)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
