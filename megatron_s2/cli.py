"""The `megatron-s2` command: one console entry point, one subcommand per workflow.

Each subcommand lives next to the code it drives and registers itself here through a
``register(subparsers)`` function returning nothing and setting ``func`` on its parser;
``func(args) -> int`` is the exit code. Configuration errors exit with code 2 and a
one-line message naming the key and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_s2.config.schema import ConfigError

__all__ = ["main", "build_parser"]

# (module, description) in the order shown by --help.
_SUBCOMMANDS = (
    "megatron_s2.training.entry",      # train
    "megatron_s2.launcher.cli",        # launch
    "megatron_s2.tools.account",       # account
    "megatron_s2.checkpoint.cli",      # checkpoint
    "megatron_s2.tools.plan",          # plan
    "megatron_s2.inference.cli",       # generate
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


if __name__ == "__main__":
    sys.exit(main())
