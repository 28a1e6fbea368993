"""Entry points of ``megatron-s2 checkpoint export`` / ``checkpoint import``.

The checkpoint command (``megatron_s2/cli/checkpoint.py``) wires two sub-commands with::

    p = sub.add_parser("export", ...); add_export_arguments(p); p.set_defaults(func=export_checkpoint)
    p = sub.add_parser("import", ...); add_import_arguments(p); p.set_defaults(func=import_checkpoint)

``export <ckpt_dir> <hf_dir>``: gathers the full model state of a committed checkpoint saved
with any layout, writes the Hugging Face directory *with the tokenizer the checkpoint was
trained with* (its ``tokenizer/`` folder, or ``--tokenizer``) beside the weights, and verifies
it: import back, tensors, and the logits of the trained model (with its tokenizer's Engram
token map, on text tokens) against the model rebuilt from the exported directory alone.
``import <hf_dir> <ckpt_dir> [section.key=value ...]``: reads a Hugging Face directory (ours
or the released one) and its tokenizer files (or ``--tokenizer``), builds the recipe
(``--recipe`` or defaults, model from ``config.json``, overrides such as ``parallel.tp=2``),
writes a committed checkpoint for that layout plus ``<ckpt_dir>/tokenizer/`` and verifies it
(logits against the exporter's stored logits when present, and the written shards read
back). Exit code 0 on success, 1 when verification fails, 2 on a configuration error or a
refusal (missing or unreadable input or tokenizer, existing target), printed as one line
naming the file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_s2.config.schema import ConfigError

__all__ = ["add_export_arguments", "add_import_arguments", "export_checkpoint", "import_checkpoint",
           "parse_size", "refusals", "run_refusing"]

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"--max-shard-size: cannot read '{text}' (e.g. 5GB, 500MiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (or 'char') when the source carries none of its own")
    p.add_argument("--no-verify", action="store_true", help="skip the built-in round-trip verification")
    p.add_argument("--verify-max-params", type=int, default=None,
                   help="largest model whose logits are checked (default 3e8 parameters)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_dir", help="a committed step directory, a checkpoints/ directory or a run directory")
    p.add_argument("hf_dir", help="new directory for the Hugging Face checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast floating weights (mHC, sinks and router biases stay float32); default: keep")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--show-mapping", action="store_true", help="print the name mapping table first")
    p.add_argument("--private", action="store_true",
                   help="owner-only files (0600) and directory (0700); default: the umask's modes")
    _common(p)


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="Hugging Face checkpoint directory (config.json + safetensors)")
    p.add_argument("ckpt_dir", help="new (or empty) checkpoints directory to write (a step_00000000 directory inside it)")
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. parallel.tp=2 parallel.pp=2")
    p.add_argument("--recipe", default=None, help="recipe whose non-model sections the checkpoint records")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks of the target layout (default: tp*pp*cp*max(dp,1) from the overrides)")
    _common(p)


def _max_params(args) -> int:
    from megatron_s2.checkpoint.hf.verify import DEFAULT_VERIFY_MAX_PARAMS

    return args.verify_max_params if args.verify_max_params is not None else DEFAULT_VERIFY_MAX_PARAMS


def _print_report(title: str, report) -> None:
    print(f"{title}: {'passed' if report.passed else 'FAILED'}")
    for line in report.lines():
        print(f"  {line}")


def _source_tokenizer(args, directory: Path, *, required: bool, what: str):
    """The tokenizer ``directory`` carries (``--tokenizer`` overrides), or None when not required."""
    from megatron_s2.data.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer, field="--tokenizer")
    if directory is not None:
        return load_tokenizer(directory, field=what)
    if required:
        raise ConfigError(f"{what}: no tokenizer files found; the model's Engram hashes depend on its tokenizer's "
                          "compressed token map — pass --tokenizer DIR (or --tokenizer char)")
    return None


def hf_tokenizer_dir(hf_dir: str | Path) -> Path | None:
    """``hf_dir`` when it holds tokenizer files (Hugging Face ``tokenizer.json`` or our
    ``char_tokenizer.json``), else None."""
    from megatron_s2.data.tokenizer import CHAR_TOKENIZER_FILE

    directory = Path(hf_dir)
    return directory if any((directory / n).is_file() for n in ("tokenizer.json", CHAR_TOKENIZER_FILE)) else None


def _tokenizer_files(tokenizer) -> dict[str, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


def export_checkpoint(args: argparse.Namespace) -> int:
    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state
    from megatron_s2.checkpoint.hf.convert import export_model_state, load_hf_checkpoint
    from megatron_s2.models.family import family_of
    from megatron_s2.checkpoint.hf.verify import (VERIFICATION_FILE, VerificationReport, check_reference_logits,
                                                  compare_states, reference_logits)
    from megatron_s2.data.tokenizer import load_tokenizer
    from megatron_s2.data.tokenizer_checks import check_tokenizer_fits, find_checkpoint_tokenizer

    loaded = read_full_state(args.ckpt_dir)
    cfg = loaded.recipe.model
    if args.show_mapping:
        print(family_of(cfg).hf.registry.describe())
    # A model whose weights do not depend on the tokenizer (no token map) exports without one,
    # as it was imported (a save_pretrained folder carries none); the export then carries none.
    tokenizer = _source_tokenizer(args, find_checkpoint_tokenizer(loaded.path), required=cfg.uses_token_map,
                                  what=f"checkpoint export: {loaded.path}")
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, cfg, "of the checkpoint")
    named = repr(tokenizer) if tokenizer is not None else "none (the export carries none; --tokenizer DIR adds one)"
    print(f"read {loaded.path} (step {loaded.step}, {loaded.world_size} ranks: {loaded.layout}), "
          f"{len(loaded.state)} tensors of model '{cfg.name}', tokenizer {named}")
    extra, why = _tokenizer_files(tokenizer) if tokenizer is not None else {}, "--no-verify"
    if not args.no_verify:
        data, why = reference_logits(cfg, loaded.state, lossless=args.dtype is None, tokenizer=tokenizer,
                                     max_params=_max_params(args))
        if data is not None:
            extra[VERIFICATION_FILE] = data
    result = export_model_state(loaded.state, cfg, args.hf_dir, dtype=args.dtype,
                                max_shard_bytes=parse_size(args.max_shard_size), progress=not args.no_progress,
                                extra_files=extra, private=args.private,
                                tokenizer=tokenizer)
    print(f"wrote {result.tensors} tensors in {len(result.files)} files ({result.dtype}) to {result.directory}")
    if result.elided:
        print(f"  {len(result.elided)} tensors equal to their reference-format substitute were not written "
              f"(e.g. {result.elided[0]})")
    if args.no_verify:
        return 0
    import torch

    # the imported side uses only what the export wrote: weights, config.json, tokenizer files
    cfg2, state2, _ = load_hf_checkpoint(result.directory, progress=False)
    token_map = None
    if tokenizer is not None:
        token_map = load_tokenizer(result.directory, field=f"{result.directory}").compressed_token_map(cfg2.vocab_size)
    report = VerificationReport()
    if cfg2 != cfg:
        report.tensor_mismatches.append("config.json does not reproduce the model config")
    compare_states(loaded.state, state2, getattr(torch, args.dtype) if args.dtype else None, report)
    report.logits, report.logits_skipped = check_reference_logits(cfg2, state2, result.directory, token_map=token_map,
                                                                  max_params=_max_params(args))
    report.logits_skipped = report.logits_skipped or why
    _print_report("verification (export -> import)", report)
    return 0 if report.passed else 1


def import_checkpoint(args: argparse.Namespace) -> int:
    from megatron_s2.checkpoint.hf.checkpoint_io import read_back_as_layout, recipe_with_model, write_full_state
    from megatron_s2.checkpoint.hf.convert import load_hf_checkpoint
    from megatron_s2.checkpoint.hf.convert import check_compressed_vocab
    from megatron_s2.checkpoint.hf.verify import (VerificationFailed, VerificationReport, check_reference_logits,
                                                  compare_states)
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.tokenizer_checks import RUN_TOKENIZER_DIR, check_tokenizer_fits

    out = Path(args.ckpt_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        held = sorted(p.name for p in out.iterdir())[:3] if out.is_dir() else []
        raise FileExistsError(f"{out}: exists and is not empty{' (holds ' + ', '.join(held) + ')' if held else ''}; "
                              "import into a new directory (a run's own checkpoints and tokenizer are never mixed "
                              "with an import)")
    cfg, state, imported = load_hf_checkpoint(args.hf_dir, progress=not args.no_progress)
    tokenizer = _source_tokenizer(args, hf_tokenizer_dir(args.hf_dir), required=cfg.uses_token_map,
                                  what=f"checkpoint import: {args.hf_dir}")
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, cfg, "of the checkpoint")
        check_compressed_vocab(args.hf_dir, tokenizer)
    print(f"read {args.hf_dir}: model '{cfg.name}', {cfg.num_layers} layers, tokenizer {tokenizer!r}")
    for line in imported.lines():
        print(f"  {line}")
    base = load_recipe(args.recipe) if args.recipe else None
    recipe = recipe_with_model(cfg, list(args.overrides), base)
    par = recipe.parallel
    world = args.world_size or par.model_parallel_size() * max(par.dp, 1)
    report = VerificationReport()
    token_map = tokenizer.compressed_token_map(cfg.vocab_size) if tokenizer is not None else None
    if not args.no_verify:  # before anything is written: a checkpoint is never committed unverified
        report.logits, report.logits_skipped = check_reference_logits(cfg, state, args.hf_dir, token_map=token_map,
                                                                      max_params=_max_params(args))
        if report.logits is not None and not report.logits.passed:
            raise VerificationFailed(_logits_failure(report.logits, args.hf_dir))
    # Written beside the target and renamed into place once read back intact: an interrupted or
    # failed import leaves no checkpoint under the requested name.
    # (the parent is created first: `import <hf> runs/new/checkpoints` is the natural target)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        written = write_full_state(state, recipe, staging, world_size=world, source=str(Path(args.hf_dir).resolve()))
        if tokenizer is not None:
            tokenizer.save(staging / RUN_TOKENIZER_DIR)
        if not args.no_verify:
            compare_states(state, read_back_as_layout(written, recipe, world), None, report)
            if not report.passed:
                raise VerificationFailed(f"verification failed: the written shards read back as {world} ranks differ "
                                         f"({'; '.join(report.tensor_mismatches[:2])}); nothing was written")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    path = out / written.relative_to(staging)
    print(f"wrote {path} for {world} ranks; train from it with: checkpoint.load={path} checkpoint.load_optimizer=false")
    if not args.no_verify:
        _print_report(f"verification (import -> checkpoint -> read as {world} ranks)", report)
    return 0


def _logits_failure(check, hf_dir) -> str:
    """One line: what failed, the likely cause, that nothing was written and how to override."""
    from megatron_s2.checkpoint.hf.convert import read_config_json

    cause = ""
    if check.differing_fields:
        cause = f"; the model config.json describes differs from the exporter's in {', '.join(check.differing_fields)}"
        if "megatron_s2" not in read_config_json(hf_dir):
            cause += (" (config.json has no megatron_s2 block, so the release format's semantics apply: restore the "
                      "block written by the export)")
    return (f"verification failed: the imported model does not reproduce the exporter's logits "
            f"(max |diff| {check.max_abs_diff:.3e}, KL {check.kl:.3e}){cause}; nothing was written "
            "(--no-verify imports it anyway)")


def refusals() -> tuple[type[BaseException], ...]:
    """What export/import refuse with (exit 2, one line): unusable input, an existing or
    impossible target. A verification that fails after writing is exit 1."""
    from megatron_s2.checkpoint.format import CheckpointError
    from megatron_s2.checkpoint.hf.gather import ShardError
    from megatron_s2.models.family.mapping_registry import ConversionError
    from megatron_s2.checkpoint.hf.safetensors_io import UnsafeCheckpointError

    return (CheckpointError, ConversionError, ShardError, UnsafeCheckpointError, FileExistsError,
            FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def run_refusing(func, args: argparse.Namespace, command: str) -> int:
    """``func(args)``, with every refusal printed as one line and exit code 2 (a failed
    verification: one line, exit code 1)."""
    from megatron_s2.checkpoint.hf.verify import VerificationFailed

    try:
        return int(func(args) or 0)
    except VerificationFailed as exc:
        print(f"megatron-s2 {command}: {exc}", file=sys.stderr)
        return VerificationFailed.exit_code
    except refusals() as exc:
        print(f"megatron-s2 {command}: {exc}", file=sys.stderr)
        return 2
