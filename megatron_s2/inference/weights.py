"""Weights for inference: from a model in this process, a state dict, or a checkpoint.

A checkpoint path may be a run directory, its ``checkpoints/`` directory, one committed step
directory (the sharded format of :mod:`megatron_s2.checkpoint`, any saving layout), or a
Hugging Face export (``config.json`` + safetensors, :mod:`megatron_s2.checkpoint.hf`). Full
tensors are read once and every rank copies the slice its parameters hold (their
``ShardSpec``), so any tp / ep layout loads any checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import ConfigError
from megatron_s2.parallel.sharding import shard_spec, slice_of

__all__ = ["LoadedCheckpoint", "read_checkpoint", "read_model_config", "load_weights_into", "load_tokenizer", "load_model",
           "check_same_architecture"]


@dataclass
class LoadedCheckpoint:
    model_config: ModelSchema
    state: dict[str, torch.Tensor]
    """Full (unsharded) tensors by parameter / buffer name."""
    directory: Path
    """Where the tokenizer is looked for (the run directory, or the export directory)."""
    description: str
    recipe: object | None = None
    """The resolved recipe the checkpoint was saved with (None for a Hugging Face export)."""


def _tokenizer_home(step_dir: Path) -> Path:
    """Where a checkpoint's tokenizer lives: the folder holding ``tokenizer/`` nearest the step —
    the run directory of a trained run, the checkpoints directory an import wrote into
    (``<run>/checkpoints/tokenizer``) — else the run directory above ``<run>/checkpoints/step_N``."""
    from megatron_s2.data.tokenizer_checks import find_checkpoint_tokenizer

    found = find_checkpoint_tokenizer(step_dir)
    if found is not None:
        return found.parent
    parent = step_dir.parent
    return parent.parent if parent.name == "checkpoints" else parent


def read_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Full model state and config of any checkpoint kind (module docstring)."""
    from megatron_s2.checkpoint.format import CheckpointError

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint: {path} does not exist; give a run, checkpoints, step or Hugging Face directory")
    if (path / "config.json").is_file():
        from megatron_s2.checkpoint.hf.convert import import_model_state

        try:
            cfg, state = import_model_state(path)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"checkpoint: {path} is not a readable Hugging Face export ({exc})") from None
        return LoadedCheckpoint(cfg, state, path, f"Hugging Face export {path}")
    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state

    try:
        full = read_full_state(path)
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint: {exc}") from None
    return LoadedCheckpoint(full.recipe.model, full.state, _tokenizer_home(full.path),
                            f"{full.path} (step {full.step}, saved by {full.world_size} rank(s): {full.layout})",
                            recipe=full.recipe)


def read_model_config(path: str | Path) -> ModelSchema:
    """The model config of any checkpoint kind, without reading its tensors (a step's manifest)."""
    from megatron_s2.checkpoint.format import CheckpointError

    path = Path(path)
    if (path / "config.json").is_file():
        return read_checkpoint(path).model_config
    from megatron_s2.checkpoint.offline import resolve_step_dir
    from megatron_s2.checkpoint.store import read_manifest
    from megatron_s2.config.recipe import RecipeConfig
    from megatron_s2.config.schema import from_mapping

    try:
        step_dir = resolve_step_dir(path, log=lambda *a: None)
        manifest = read_manifest(step_dir)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"checkpoint: {path}: {exc}") from None
    return from_mapping(RecipeConfig, manifest.config, f"{step_dir.name}/checkpoint.json:config").model


@torch.no_grad()
def load_weights_into(model: nn.Module, source: nn.Module | Mapping[str, torch.Tensor] | str | Path) -> None:
    """Copy weights into ``model`` in place (its parameters keep their storage and sharding).

    A module or state dict must have this model's names and *local* shapes (same layout); a
    checkpoint path holds full tensors, sliced here for this rank."""
    if isinstance(source, (str, Path)):
        loaded = read_checkpoint(source)
        _check_same_model(model.config, loaded.model_config, loaded.description)
        params = dict(model.named_parameters())
        local = {}
        for name, t in model.state_dict().items():
            if name not in loaded.state:
                raise ConfigError(f"checkpoint: {loaded.description} has no tensor '{name}'")
            full = loaded.state[name]
            local[name] = slice_of(full, shard_spec(params[name])) if name in params else full
        source = local
    elif isinstance(source, nn.Module):
        source = source.state_dict()
    own = model.state_dict()
    missing = sorted(set(own) - set(source))
    if missing:
        raise ValueError(f"update_weights: the new weights lack {missing[:3]} (and {max(0, len(missing) - 3)} more)")
    # every shape first: a misfit found half-way through the copy would leave the model half old, half new
    for name, target in own.items():
        value = source[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: '{name}' has shape {tuple(value.shape)}, this rank holds "
                             f"{tuple(target.shape)} (a different parallel layout?)")
    for name, target in own.items():
        target.copy_(source[name].to(device=target.device, dtype=target.dtype))


def _check_same_model(mine: ModelSchema, theirs: ModelSchema, where: str) -> None:
    a, b = mine.replace(name=""), theirs.replace(name="")
    if a != b:
        diff = [k for k in a.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
        raise ConfigError(f"checkpoint: {where} is a different model (fields {diff[:4]} differ)")


def check_same_architecture(mine: ModelSchema, theirs: ModelSchema, where: str) -> None:
    """Refuse weights of another architecture even when every tensor shape fits.

    Compared: the family's released-format description of the model (its Hugging Face
    ``config.json`` without our own block and dtype) — layer modes, windows, top-k, rope, expert
    routing, norms. Training-only fields (initialisation, loss coefficients, bias-update rate,
    precision; the adapter's ``training_only_keys`` where its format states them) may differ: an
    RL phase legitimately overrides them over the checkpoint it starts from, and the weights it
    publishes still belong to the served model."""
    from megatron_s2.models.family import family_of
    from megatron_s2.models.family.hf import BLOCK_KEY

    if mine.family != theirs.family:
        raise ConfigError(f"checkpoint: {where} is a '{theirs.family}' model; this one is '{mine.family}'")
    hf = family_of(mine).hf

    def described(cfg: ModelSchema) -> dict:
        out = hf.config_to_hf(cfg, "float32")
        for key in (BLOCK_KEY, "torch_dtype", "dtype", *hf.training_only_keys):
            out.pop(key, None)
        return _flat(out)

    a, b = described(mine), described(theirs)
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if diff:
        shown = ", ".join(f"{k}: {b.get(k)!r} (served {a.get(k)!r})" for k in diff[:3])
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise ConfigError(f"checkpoint: {where} is another architecture ({shown}{more})")


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_tokenizer(directory: Path):
    """The tokenizer a checkpoint was trained with, behind the ``Tokenizer`` protocol: the run's
    ``tokenizer/`` folder (what the trainer records), the files beside an export's weights
    (Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``, or ``char_tokenizer.json``),
    or a run of an older layout that kept the character tokenizer in ``tokenizer.json``."""
    from megatron_s2.data.errors import DataError
    from megatron_s2.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
    from megatron_s2.data.tokenizer import load_tokenizer as load
    from megatron_s2.data.tokenizer_checks import RUN_TOKENIZER_DIR

    d = Path(directory)
    if (d / RUN_TOKENIZER_DIR).is_dir():
        return load(d / RUN_TOKENIZER_DIR, field=f"tokenizer {d / RUN_TOKENIZER_DIR}")
    if (d / CHAR_TOKENIZER_FILE).is_file() or (d / "tokenizer_config.json").is_file():
        return load(d, field=f"tokenizer {d}")
    file = d / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"tokenizer: no tokenizer files in {d} (tokenizer/, tokenizer.json + tokenizer_config.json "
                          f"or {CHAR_TOKENIZER_FILE}); copy the training run's tokenizer there")
    try:
        return CharTokenizer.from_json(file.read_text())
    except (DataError, ValueError) as exc:
        raise ConfigError(f"tokenizer: {file}: {exc}") from None


def load_model(path: str, device: str | None = None):
    """(model in eval mode on ``device``, tokenizer, description) of a checkpoint, one rank.

    ``device`` defaults to this process's device (:func:`megatron_s2.runtime.device.process_device`:
    its GPU when one is visible, else CPU); the weights are read on the host and copied there."""
    from megatron_s2.models.family import family_of
    from megatron_s2.runtime.device import build_on, process_device

    loaded = read_checkpoint(path)
    tokenizer = load_tokenizer(loaded.directory)
    cfg = loaded.model_config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"tokenizer: {tokenizer.vocab_size} tokens do not fit the model's vocab_size={cfg.vocab_size}")
    if (loaded.directory / "config.json").is_file():  # an export states its tokenizer's Engram map size
        from megatron_s2.checkpoint.hf.convert import check_compressed_vocab

        check_compressed_vocab(loaded.directory, tokenizer)
    try:
        dev = torch.device(device) if device else process_device()
    except RuntimeError as exc:
        raise ConfigError(f"--device: {exc}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device: {dev} is not available on this machine (visible GPUs: "
                          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); use cpu or another GPU")
    with build_on(dev):
        model = family_of(cfg).build_model(cfg)
        if getattr(cfg, "timeseries", None) is not None and any(k.startswith("forecaster.") for k in loaded.state):
            from megatron_s2.models.timeseries.forecaster import ForecastBranch  # a timeseries_forecast run's branch

            model.forecaster = ForecastBranch(cfg.timeseries, cfg.hidden_size)
    model.to(dev)  # host-computed buffers (RoPE frequencies) follow
    missing, unexpected = model.load_state_dict(loaded.state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint: {loaded.description} does not match model '{cfg.name}' "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.set_token_map(tokenizer.compressed_token_map(num_ids=cfg.vocab_size))
    return model.eval(), tokenizer, loaded.description
