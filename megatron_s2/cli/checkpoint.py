"""`megatron-s2 checkpoint inspect|verify|reshard|export|import`.

``inspect <dir> [--verify] [--no-config]``
    Print a checkpoint's step, format version, layout, optimiser/RNG/data state, tensor
    counts, files with their sha256, and the resolved config. ``<dir>`` is one step directory
    or a run's ``checkpoints/`` directory (every step is listed, then the one ``latest``
    resolves to is described). ``--verify`` also checks every file's checksum.
``verify <dir> [--checksums-only]``
    Check every file of the step directory (or of every committed step of a ``checkpoints/``
    directory, and that ``latest`` resolves to a valid one) and that every floating tensor is
    finite. Exits 1 naming the first bad file or tensor. Leftovers of interrupted saves or
    deletions (``.step_*`` directories) are listed as garbage, not failures.
``reshard <in> <out> [parallel.KEY=VALUE ...] [--world-size N]``
    Rewrite a checkpoint for another layout into the checkpoints directory ``<out>``
    (single process, full tensors in host memory; see :mod:`megatron_s2.checkpoint.offline`).
``export`` / ``import``
    Hugging Face conversion (:mod:`megatron_s2.checkpoint.hf`).

Exit codes: 0 success, 1 invalid or corrupted checkpoint, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_s2.checkpoint.format import COMMIT, CheckpointError

__all__ = ["register"]

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect, verify, reshard and convert checkpoints",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    q = cmds.add_parser("inspect", help="print what a checkpoint holds")
    q.add_argument("path", help="a step directory or a checkpoints/ directory")
    q.add_argument("--verify", action="store_true", help="also check every file's checksum")
    q.add_argument("--no-config", action="store_true", help="do not print the resolved config")
    q.set_defaults(func=_inspect)

    q = cmds.add_parser("verify", help="check every file's checksum and every tensor's values; exit 1 naming "
                                       "the first bad file or tensor")
    q.add_argument("path", help="a step directory or a checkpoints/ directory")
    q.add_argument("--checksums-only", action="store_true", help="skip reading tensors for NaN/inf")
    q.set_defaults(func=_verify)

    q = cmds.add_parser("reshard", help="rewrite a checkpoint for another parallel layout")
    q.add_argument("source", help="a step directory, a checkpoints/ directory or a run directory")
    q.add_argument("dest", help="checkpoints directory to write into (a step_* directory and latest)")
    q.add_argument("overrides", nargs="*", help="layout overrides, e.g. parallel.tp=1 parallel.pp=4")
    q.add_argument("--world-size", type=int, default=None, help="ranks of the target layout (default: as saved)")
    q.set_defaults(func=_reshard)

    _add_hf(cmds, "export", "our checkpoint -> Hugging Face safetensors", "add_export_arguments",
            "export_checkpoint")
    _add_hf(cmds, "import", "Hugging Face safetensors -> our checkpoint", "add_import_arguments",
            "import_checkpoint")


# ---- inspect / verify --------------------------------------------------------------------------
def _target(path: str) -> tuple[Path, bool] | None:
    """(path, is a single step directory), or None after printing why ``path`` is neither."""
    from megatron_s2.checkpoint.store import CheckpointStore, is_step_dir

    p = Path(path)
    if not p.is_dir():
        print(f"megatron-s2 checkpoint: {p}: no such directory", file=sys.stderr)
        return None
    if is_step_dir(p):
        return p, True
    if (p / "checkpoints").is_dir() and not CheckpointStore(p).step_dirs():
        p = p / "checkpoints"
    if not CheckpointStore(p).step_dirs() and not (p / "latest").exists():
        print(f"megatron-s2 checkpoint: {p}: neither a checkpoint step directory nor a checkpoints/ directory",
              file=sys.stderr)
        return None
    return p, False


def _inspect(args: argparse.Namespace) -> int:
    from megatron_s2.checkpoint.describe import (
        describe_root,
        describe_step,
        verify_lines,
    )

    target = _target(args.path)
    if target is None:
        return 2
    path, single = target
    if not single:
        lines, path = describe_root(path)
        print("\n".join(lines))
        if path is None:
            return 1
        print()
    lines, manifest = describe_step(path, config=not args.no_config)
    print("\n".join(lines))
    ok = manifest is not None
    if args.verify and ok:
        lines, ok = verify_lines(path)
        print("\n".join(lines))
    return 0 if ok else 1


def _verify(args: argparse.Namespace) -> int:
    from megatron_s2.checkpoint.describe import verify_lines

    target = _target(args.path)
    if target is None:
        return 2
    path, single = target
    values = not args.checksums_only
    if single:
        lines, ok = verify_lines(path, values)
        print("\n".join(lines))
        return 0 if ok else 1
    from megatron_s2.checkpoint.store import CheckpointStore

    store = CheckpointStore(path, log=lambda m: print(f"note: {m}"))
    ok = True
    for step_dir in store.step_dirs():
        if not (step_dir / COMMIT).is_file():
            print(f"skip   {step_dir}: not committed (an interrupted save; never loaded)")
            continue
        lines, good = verify_lines(step_dir, values)
        print("\n".join(lines))
        ok = ok and good
    for debris in store.garbage():
        print(f"garbage {debris}: left by an interrupted save or deletion; never loaded, removed by the next save")
    chosen = store.latest_valid()
    if chosen is None:
        print(f"FAILED {path}: no valid checkpoint to resume from")
        return 1
    print(f"resume: {chosen.name}")
    return 0 if ok else 1


# ---- reshard -----------------------------------------------------------------------------------
def _reshard(args: argparse.Namespace) -> int:
    from megatron_s2.checkpoint.offline import reshard

    try:
        out = reshard(args.source, args.dest, list(args.overrides), world_size=args.world_size)
    except CheckpointError as exc:
        print(f"megatron-s2 checkpoint reshard: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    _carry_tokenizer(Path(args.source), out)
    return 0


def _carry_tokenizer(source: Path, step_dir: Path) -> None:
    """Copy the source's tokenizer beside the new checkpoint (``<dest>/tokenizer``, as an import
    writes it) unless one is already there: generate / serve / export of the output need it."""
    import shutil

    from megatron_s2.checkpoint.offline import resolve_step_dir
    from megatron_s2.data.tokenizer_checks import RUN_TOKENIZER_DIR, find_checkpoint_tokenizer

    found = find_checkpoint_tokenizer(resolve_step_dir(source, log=lambda *a: None))
    if found is not None and find_checkpoint_tokenizer(step_dir) is None:
        shutil.copytree(found, step_dir.parent / RUN_TOKENIZER_DIR)
        print(f"wrote {step_dir.parent / RUN_TOKENIZER_DIR} (the tokenizer of {found.parent})")


# ---- Hugging Face conversion (megatron_s2/cli/hf_convert.py) ---------------------------------------
def _add_hf(cmds, name: str, help_text: str, add_args: str, entry: str) -> None:
    from megatron_s2.cli import hf_convert

    q = cmds.add_parser(name, help=help_text)
    getattr(hf_convert, add_args)(q)
    q.set_defaults(func=lambda a: hf_convert.run_refusing(getattr(hf_convert, entry), a,
                                                          f"checkpoint {entry.split('_')[0]}"))
