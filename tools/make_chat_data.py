"""Write synthetic multi-turn chat conversations (all roles, tool calls, effort levels) as jsonl.

Usage::

    python tools/make_chat_data.py --output recipes/data/tiny_chat.jsonl --count 300 --seed 7

The records (:mod:`megatron_s2.data.synthetic_chat`) are what ``data.kind: chat`` reads; the
shipped ``recipes/data/tiny_chat.jsonl`` is reproduced byte for byte by the command above.

``--retry-task`` writes the SFT data of the verifiers retry environment instead (plugin id
``megatron_s2_retry``: its feedback, and its system prompt or ``--system-prompt``; a
``--retry-fraction`` of the conversations answer a near miss first, kept as context with
``"weight": 0``, then right after the feedback). ``recipes/data/addition_retry_chat.jsonl``
(recipes/rl_tiny_verifiers_multiturn.yaml, whose taskset sets ``use_system_prompt: false``) is::

    python tools/make_chat_data.py --output recipes/data/addition_retry_chat.jsonl --count 8000 --seed 7 \
        --retry-task addition --max-digits 2 --retry-fraction 0.3 --system-prompt ''
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from megatron_s2.data.synthetic_chat import retry_conversations, synthetic_conversations


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_chat_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help=".jsonl file to write")
    parser.add_argument("--count", type=int, default=300, help="conversations")
    parser.add_argument("--seed", type=int, default=7, help="generation seed")
    parser.add_argument("--retry-task", choices=("addition", "multiplication"),
                        help="write retry-environment conversations of this task instead (module docstring)")
    parser.add_argument("--max-digits", type=int, default=2, help="--retry-task: operand digits")
    parser.add_argument("--retry-fraction", type=float, default=0.3,
                        help="--retry-task: share of conversations with a wrong first answer and the feedback")
    parser.add_argument("--system-prompt", default=None,
                        help="--retry-task: the system message ('' = none; default: the taskset's, vf_tasks.SYSTEM_PROMPT)")
    args = parser.parse_args(argv)
    if args.count < 1:
        print("make_chat_data: error: --count must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.retry_fraction <= 1.0 or args.max_digits < 1:
        print("make_chat_data: error: --retry-fraction must be in [0, 1] and --max-digits >= 1", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in _records(args)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(lines)} conversations")
    return 0


def _records(args):
    if args.retry_task is None:
        return synthetic_conversations(args.count, args.seed)
    from megatron_s2.config.data import TaskDifficulty
    from megatron_s2.posttrain.envs.vf_retry import FEEDBACK
    from megatron_s2.posttrain.envs.vf_tasks import SYSTEM_PROMPT

    difficulty = TaskDifficulty(addition_max_digits=args.max_digits, multiplication_max_digits=args.max_digits)
    system = SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt
    return retry_conversations(args.retry_task, difficulty, args.count, args.seed, retry_fraction=args.retry_fraction,
                               system_prompt=system, feedback=FEEDBACK)


if __name__ == "__main__":
    sys.exit(main())
