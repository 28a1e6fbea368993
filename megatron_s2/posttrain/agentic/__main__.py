"""Command line for the agentic tasks: list them, or run one episode of an agent on one.

    python -m megatron_s2.posttrain.agentic list
    python -m megatron_s2.posttrain.agentic run fix_median [--agent reference|idle] \\
        [--backend auto|bwrap|unshare] [--json]

``run`` plays the task's scripted reference solution (``--agent reference``, reward 1) or an agent
that submits at once (``--agent idle``, reward 0) in a fresh sandbox, grades it, and prints the
transcript's labels, the reward, the grading status, each canonical test and the process weights
(``--json``: the whole episode, as a trainer would consume it). A missing sandbox backend or an
unknown task is one line on stderr and exit code 2; Ctrl-C or SIGTERM closes the sandboxes and exits
130 with one line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from megatron_s2.config.posttrain.agentic import SandboxConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.agentic.runner import run_episode, scripted_policy
from megatron_s2.posttrain.agentic.sandbox import SandboxUnavailable, detect_runtime
from megatron_s2.posttrain.agentic.tasks import load_task, task_names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_s2.posttrain.agentic", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the embedded tasks and their prompts")
    run = sub.add_parser("run", help="one episode of an agent on a task, in a sandbox, graded")
    run.add_argument("task", help=f"one of: {', '.join(task_names())}")
    run.add_argument("--agent", choices=("reference", "idle"), default="reference")
    run.add_argument("--backend", choices=("auto", "bwrap", "unshare"), default="auto")
    run.add_argument("--json", action="store_true", help="print the whole episode as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the sandboxes were closed on the way out
        print("interrupted: the episode was abandoned and its sandboxes closed", file=sys.stderr)
        return 130


def _main(args) -> int:
    if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds like Ctrl-C (sandboxes closed,
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # the stage folder removed at exit)
    if args.command == "list":
        for name in task_names():
            print(f"{name}: {load_task(name).prompt}")
        return 0
    try:
        task = load_task(args.task)
        runtime = detect_runtime(SandboxConfig(backend=args.backend))
    except (ValueError, SandboxUnavailable) as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    result = run_episode(task, scripted_policy(task.reference if args.agent == "reference" else []), runtime)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    for segment in result.transcript:
        first_line = segment.text.strip().splitlines()[0] if segment.text.strip() else ""
        print(f"[{segment.label:<11}] {segment.role:<9} {first_line[:100]}")
    print(f"sandbox: {runtime.name}  stop: {result.stop_reason}  status: {result.status}  reward: {result.reward}")
    for test, verdict in sorted((result.grade.results if result.grade else {}).items()):
        lines = [line.strip() for line in verdict.strip().splitlines() if line.strip().strip("^~")]
        failing = [line for line in lines if line.startswith("assert ")][-1:]  # the failing assertion's source
        print(f"  {test}: {lines[0] if len(lines) == 1 else 'fail: ' + ' / '.join(failing + lines[-1:])}")
    print(f"process weights: {result.weights} ({', '.join(result.categories)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
