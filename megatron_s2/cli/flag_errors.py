"""Configuration errors named by the command-line flag that set the value.

The dataclasses behind a command (:class:`~megatron_s2.inference.sampling.SamplingParams`,
:class:`~megatron_s2.config.engine.EngineConfig`, ...) name their fields in errors
(``max_tokens: must be >= 1``); a terminal user typed ``--max-tokens``, so the command reports
that (``--max-tokens: must be >= 1``). Both spellings follow one rule: ``snake_case`` field,
``--kebab-case`` flag.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from megatron_s2.config.schema import ConfigError

__all__ = ["built_from_flags", "check_speculative_flags"]

T = TypeVar("T")


def built_from_flags(build: Callable[..., T], **fields) -> T:
    """``build(**fields)``; a ConfigError about field ``x_y`` is raised again as ``--x-y``."""
    try:
        return build(**fields)
    except ConfigError as exc:
        field, separator, rest = str(exc).partition(":")
        if not separator or field not in fields:
            raise
        raise ConfigError(f"--{field.replace('_', '-')}:{rest}") from None


def check_speculative_flags(args) -> None:
    """``--speculative-tokens`` without ``--speculative`` would decode plainly without a word."""
    if args.speculative_tokens and not args.speculative:
        raise ConfigError(f"--speculative-tokens: {args.speculative_tokens} takes effect only with --speculative; "
                          "add --speculative or drop --speculative-tokens")
