"""`megatron-s2 account <model.yaml | recipe.yaml> [--json]`: size a model before booking a cluster.

The model family's accounting (``ModelFamily.account``): for the V4.1 backbone, backbone and
Engram parameters, activated parameters per token in decode and in prefill (CED: encoder +
decoder KV projections only, report §2.2), global KV-cache bytes per token held in HBM and
persistent KV bytes per token by format (§2.4.4, §3.2.1), SWA state bytes per request, and
decode FLOPs per token at 4K and 1M context — computed from the same config objects the model
is built from (``megatron_s2/models/<family>/accounting.py``). For a model with a vision tower,
the report's image I/O criterion rho < (B_IO/B_GPU)·C (§3.1.1, ``megatron_s2/planning/image_io.py``)
under ``--io-gbps`` / ``--gpu-tflops`` / ``--seq-length``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.recipe import RecipeConfig, load_recipe
from megatron_s2.config.schema import ConfigError, from_mapping

__all__ = ["register", "run", "load_model_config"]


_RECIPE_KEYS = {f for f in RecipeConfig.__dataclass_fields__} | {"base", "phases"}


def load_model_config(path: str) -> ModelSchema:
    """The model of a model file (recipes/models/*.yaml: the ``model:`` section alone) or of a recipe."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"'{path}' does not exist; pass a model file (recipes/models/*.yaml) or a recipe")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"'{path}' is not a YAML mapping ({type(exc).__name__}); pass a model file or a recipe") from None
    if isinstance(data, dict) and not _RECIPE_KEYS & set(data):
        return from_mapping(ModelSchema, data, "model")
    return load_recipe(file).model


def run(args: argparse.Namespace) -> int:
    from megatron_s2.models.family import family_of

    cfg = load_model_config(args.config)
    family = family_of(cfg)
    report = family.account(cfg)
    figures, lines = dict(report.figures), list(report.lines)
    if figures.get("image_bytes_per_token"):  # a vision tower: does image loading hide behind compute?
        from megatron_s2.planning.image_io import image_io_criterion

        try:
            criterion = image_io_criterion(figures["image_bytes_per_token"],
                                           family.train_flops_per_token(cfg, args.seq_length),
                                           io_gbps=args.io_gbps, gpu_tflops=args.gpu_tflops)
        except ValueError as exc:
            raise ConfigError(f"--io-gbps / --gpu-tflops: {exc}") from None
        figures["image_io_criterion"] = criterion.figures()
        lines.append(criterion.line())
    print(json.dumps(figures, indent=2) if args.json else "\n".join(lines))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("account", help="parameter / KV-cache / FLOP accounting of a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="model file (recipes/models/*.yaml) or recipe")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    from megatron_s2.planning.image_io import DEFAULT_GPU_TFLOPS, DEFAULT_IO_GBPS, DEFAULT_SEQ_LENGTH

    p.add_argument("--io-gbps", type=float, default=DEFAULT_IO_GBPS,
                   help=f"image I/O criterion: file-system read GB/s per GPU (default {DEFAULT_IO_GBPS:g})")
    p.add_argument("--gpu-tflops", type=float, default=DEFAULT_GPU_TFLOPS,
                   help=f"image I/O criterion: achieved TFLOP/s per GPU (default {DEFAULT_GPU_TFLOPS:g})")
    p.add_argument("--seq-length", type=int, default=DEFAULT_SEQ_LENGTH,
                   help=f"image I/O criterion: sequence length of C's attention average (default {DEFAULT_SEQ_LENGTH})")
    p.set_defaults(func=run)
