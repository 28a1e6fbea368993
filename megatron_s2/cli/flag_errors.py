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

__all__ = ["built_from_flags", "check_speculative_flags", "check_memory_decoder_flags", "memory_decoder_from_flags"]

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


def check_memory_decoder_flags(args) -> None:
    """``--memory-decoder`` (generate / serve) against the other flags and the file system, before
    the model loads: a missing path, and combinations the engine cannot honour with a plug-in."""
    from pathlib import Path

    path = getattr(args, "memory_decoder", None)
    if path is None:
        return
    if not path.strip():  # e.g. an unset shell variable: never serve the plain backbone silently
        raise ConfigError("--memory-decoder: empty path; give the run (or checkpoint) directory of a "
                          "phase.kind: memdec_router run, or drop the flag")
    if not Path(path).exists():
        raise ConfigError(f"--memory-decoder: {path} does not exist; give the run (or checkpoint) directory of a "
                          "phase.kind: memdec_router run")
    for flag, on in (("--speculative", getattr(args, "speculative", False)),
                     ("--prefix-caching", getattr(args, "prefix_caching", False)),
                     ("--image", bool(getattr(args, "image", None)))):
        if on:
            raise ConfigError(f"--memory-decoder: cannot be combined with {flag} (the memory decoder's mix is "
                              f"computed over text, from both models' own caches); drop one of them")


def memory_decoder_from_flags(args, model, tokenizer):
    """The plug-in of ``--memory-decoder`` on the backbone's device, checked against the backbone
    (vocabulary, tokenizer, router width, architecture); None without the flag."""
    if getattr(args, "memory_decoder", None) is None:
        return None
    from megatron_s2.inference.memory_decoder import load_memory_decoder

    plugin = load_memory_decoder(args.memory_decoder, next(model.parameters()).device)
    plugin.check_backbone(model.config, tokenizer)
    return plugin
