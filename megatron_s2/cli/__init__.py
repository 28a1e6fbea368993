"""The `megatron-s2` command: one console entry point, one subcommand per workflow.

Each subcommand lives next to the code it drives and registers itself here through a
``register(subparsers)`` function returning nothing and setting ``func`` on its parser;
``func(args) -> int`` is the exit code. Configuration errors exit with code 2 and a
one-line message naming the key and the fix, never a traceback; unusable data, a checkpoint
that cannot be written or read, a halted run (non-finite loss) and a full disk exit with code
1 and one line; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from megatron_s2.config.schema import ConfigError

__all__ = ["main", "build_parser"]

# (module, description) in the order shown by --help.
_SUBCOMMANDS = (
    "megatron_s2.cli.train",      # train
    "megatron_s2.launcher.cli",        # launch
    "megatron_s2.tools.account",       # account
    "megatron_s2.cli.checkpoint",      # checkpoint
    "megatron_s2.tools.plan",          # plan
    "megatron_s2.cli.generate",       # generate
    "megatron_s2.cli.serve",           # serve
    "megatron_s2.cli.orchestrate",     # orchestrate (disaggregated RL)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-s2",
        description="Train S2-class models from YAML recipes, locally or on SLURM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # subcommand not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    early = None
    if argv[:1] == ["train"]:
        # A rank may be signalled (preemption warning, scancel --signal, Ctrl-C) while the
        # imports below take seconds: record it from now on instead of dying by it.
        from megatron_s2.runtime.preemption import catch_early

        early = catch_early()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"megatron-s2 {argv[0]}: interrupted" if argv else "megatron-s2: interrupted", file=sys.stderr)
        return 130
    finally:
        if early is not None:
            early.uninstall()


def _main(argv: list[str]) -> int:
    from megatron_s2.checkpoint.format import CheckpointError
    from megatron_s2.data.errors import DataError
    from megatron_s2.runtime.finite import TrainingHalted

    parser = build_parser()
    # `section.key=value` overrides may come before or after the flags.
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    unknown = [a for a in extra if a not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*(args.overrides or []), *overrides]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"megatron-s2 {args.command}: configuration error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    except (CheckpointError, DataError, TrainingHalted) as exc:
        print(f"megatron-s2 {args.command}: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"megatron-s2 {args.command}: disk full{where} (no space left on device); free space and run "
              "again (the newest committed checkpoint is intact)", file=sys.stderr)
        return 1

