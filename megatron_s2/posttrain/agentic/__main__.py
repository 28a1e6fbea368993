"""Command line for the agentic tasks: list them, or run one episode of an agent on one.

    python -m megatron_s2.posttrain.agentic list
    python -m megatron_s2.posttrain.agentic run fix_median [--agent reference|idle] \\
        [--backend auto|bwrap|unshare] [--json]
    python -m megatron_s2.posttrain.agentic play sum_pair --checkpoint RUN_DIR \\
        [--harness openai_agents|anthropic|smolagents|builtin] [--traces DIR] [--max-turns 6] \\
        [--max-tokens 128] [--temperature 1.0] [--max-model-len 8192] [--json]
    python -m megatron_s2.posttrain.agentic sft-data OUT.jsonl [--tasks sum_pair copy_word] [--copies 1] \\
        [--variants N [--seed 0] [--max-operand 99]] [--declare-tools] [--answer-weight W]

``run`` plays the task's scripted reference solution (``--agent reference``, reward 1) or an agent
that submits at once (``--agent idle``, reward 0) in a fresh sandbox, grades it, and prints the
transcript's labels, the reward, the grading status, each canonical test and the process weights
(``--json``: the whole episode, as a trainer would consume it). A missing sandbox backend or an
unknown task is one line on stderr and exit code 2; Ctrl-C or SIGTERM closes the sandboxes and exits
130 with one line.

``play`` serves a checkpoint in-process (the agent gateway with a PrefixTree store: ``--traces``,
default a fresh temporary folder) and lets a real harness play the task against a session URL
(:mod:`.harnesses`, :mod:`.gateway_episode`); it prints the stop reason, the grade, the trace
(branches, trainable tokens) and the process weights (``--json``: all of it, per call).

``sft-data`` writes the tasks' reference solutions, played in real sandboxes, as chat
conversations for a ``data.kind: chat`` SFT recipe (:mod:`.sft_traces`); with ``--variants N``, N
seeded training-split instances (:func:`~.tasks.task_variants`: never a held-out one) instead of
the stored ones; ``--declare-tools`` adds the tools' JSON schemas to each record, the prompt the
``anthropic`` and ``openai_agents`` harnesses send (the builtin harness names the tools in its
system message only); ``--answer-weight W`` gives the assistant turns that call ``write_file`` (the
answer) the chat loss weight W (:mod:`megatron_s2.data.chat`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from megatron_s2.config.posttrain.agentic import SandboxConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.agentic.harnesses import HARNESSES, HarnessSettings, make_harness
from megatron_s2.posttrain.agentic.runner import run_episode, scripted_policy
from megatron_s2.posttrain.agentic.sandbox import SandboxUnavailable, detect_runtime
from megatron_s2.posttrain.agentic.tasks import load_task, task_names, task_variants


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_s2.posttrain.agentic", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the embedded tasks and their prompts")
    run = sub.add_parser("run", help="one episode of an agent on a task, in a sandbox, graded")
    run.add_argument("task", help=f"one of: {', '.join(task_names())}")
    run.add_argument("--agent", choices=("reference", "idle"), default="reference")
    run.add_argument("--backend", choices=("auto", "bwrap", "unshare"), default="auto")
    run.add_argument("--json", action="store_true", help="print the whole episode as JSON")
    play = sub.add_parser("play", help="a real harness plays a task against a served checkpoint, captured")
    play.add_argument("task", help=f"one of: {', '.join(task_names())}")
    play.add_argument("--checkpoint", required=True, help="a run, checkpoints, step or Hugging Face directory")
    play.add_argument("--harness", choices=sorted(HARNESSES), default="openai_agents")
    play.add_argument("--traces", default="", help="the trace store's folder (default: a new temporary one)")
    play.add_argument("--backend", choices=("auto", "bwrap", "unshare"), default="auto")
    play.add_argument("--max-turns", type=int, default=6)
    play.add_argument("--max-tokens", type=int, default=128)
    play.add_argument("--temperature", type=float, default=1.0)
    play.add_argument("--max-model-len", type=int, default=8192, help="smolagents' own prompt is ~5k tokens")
    play.add_argument("--json", action="store_true", help="print the episode as JSON")
    sft = sub.add_parser("sft-data", help="reference solutions as chat conversations (.jsonl) for SFT")
    sft.add_argument("out", help="the .jsonl file to write")
    sft.add_argument("--tasks", nargs="+", default=["sum_pair", "copy_word"], help="embedded task names")
    sft.add_argument("--copies", type=int, default=1, help="each conversation this many times")
    sft.add_argument("--variants", type=int, default=0,
                     help="N seeded training-split instances of the tasks instead of the stored ones")
    sft.add_argument("--seed", type=int, default=0, help="first seed of --variants")
    sft.add_argument("--max-operand", type=int, default=99, help="sum_pair's largest operand in --variants")
    sft.add_argument("--declare-tools", action="store_true",
                     help="add the tools' JSON schemas to each record (the anthropic / openai_agents harnesses' prompt)")
    sft.add_argument("--answer-weight", type=float, default=1.0,
                     help="loss weight of the assistant turns that call write_file (the answer); default 1")
    sft.add_argument("--backend", choices=("auto", "bwrap", "unshare"), default="auto")
    return parser


def play(args, task, runtime) -> int:
    """One harness episode against the checkpoint served in-process (module docstring)."""
    import tempfile

    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.inference.weights import load_model
    from megatron_s2.posttrain.agentic.gateway_episode import run_harness_episode
    from megatron_s2.serve import ServeConfig
    from megatron_s2.serve.server import ServerThread, build_state

    traces = args.traces or tempfile.mkdtemp(prefix="megatron-s2-traces-")
    model, tokenizer, description = load_model(args.checkpoint, "cpu")
    config = ServeConfig(gateway_traces=traces, logprobs_mode="processed_logprobs", disconnect_poll_s=0.05)
    state = build_state(model, tokenizer, description, config,
                        EngineConfig(max_num_seqs=4, max_model_len=args.max_model_len, seed=0), model_name="policy")
    settings = HarnessSettings(max_turns=args.max_turns, max_tokens=args.max_tokens, temperature=args.temperature)
    with ServerThread(state) as server:
        episode = run_harness_episode(task, make_harness(args.harness), runtime, server_url=server.url,
                                      session=f"{task.name}-{args.harness}@{os.getpid()}", trace_dir=traces,
                                      settings=settings)
    trainable = sum(int(s.loss_mask.sum()) for s in episode.samples)
    summary = {"task": task.name, "harness": args.harness, "session": episode.session, "traces": traces,
               "stop_reason": episode.stop_reason, "error": episode.error, "status": episode.status,
               "reward": episode.reward, "branches": len(episode.samples),
               "tokens": [len(s.token_ids) for s in episode.samples], "trainable_tokens": trainable,
               "tool_calls": [[c.name, c.arguments, r.ok] for c, r in episode.tool_log],
               "weights": episode.weights, "categories": episode.categories}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{args.harness} on {task.name}: stop {episode.stop_reason}{' (' + episode.error + ')' if episode.error else ''}"
          f"  status {episode.status}  reward {episode.reward}")
    print(f"trace {traces} session {episode.session}: {len(episode.samples)} branch(es), "
          f"{sum(summary['tokens'])} tokens, {trainable} trainable")
    for call, result in episode.tool_log:
        print(f"  {call.name}({json.dumps(call.arguments)[:80]}) -> {'ok' if result.ok else 'failed'}")
    print(f"process weights: {episode.weights} ({', '.join(episode.categories)})")
    return 0


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
    if args.command == "sft-data":
        from megatron_s2.posttrain.agentic.sft_traces import write_sft_jsonl

        try:
            tasks = (task_variants(args.tasks, "train", args.variants, args.seed, max_operand=args.max_operand)
                     if args.variants else [load_task(name) for name in args.tasks])
            count = write_sft_jsonl(args.out, tasks, detect_runtime(SandboxConfig(backend=args.backend)), args.copies,
                                    declare_tools=args.declare_tools, answer_weight=args.answer_weight)
        except (ValueError, SandboxUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return ConfigError.exit_code
        print(f"wrote {count} conversations to {args.out}")
        return 0
    try:
        task = load_task(args.task)
        runtime = detect_runtime(SandboxConfig(backend=args.backend))
    except (ValueError, SandboxUnavailable) as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    if args.command == "play":
        try:
            return play(args, task, runtime)
        except ConfigError as exc:  # e.g. a checkpoint that is not there
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
