"""Full (unsharded) model state <-> Hugging Face checkpoint directory.

:func:`export_model_state` writes ``config.json`` (the model family's Hugging Face adapter,
:mod:`megatron_s2.models.family.hf`), sharded safetensors and ``model.safetensors.index.json``
(:mod:`.safetensors_io`) through the family's mapping table; the directory is assembled under a temporary name and renamed into
place, so a crash never leaves a half-written checkpoint under the requested name.
:func:`import_model_state` reads such a directory — ours or the released one (FP8/FP4
weights are dequantised) — into our full state for the config it describes, checking every
name and shape against a skeleton of the model built from that config.

Both take and return the *full* state (``state_dict`` of the single-rank model). Gathering
from, and scattering to, a parallel layout is :mod:`.gather` / :mod:`.checkpoint_io`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_s2.checkpoint.hf.safetensors_io import SafetensorsReader, write_sharded
from megatron_s2.checkpoint.hf.tensor_source import TensorSource
from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.models.family import family_of
from megatron_s2.models.family.registry import family_for_hf_config
from megatron_s2.models.family.mapping_registry import ConversionError, ImportReport, MappingRegistry
from megatron_s2.models.family.skeleton import skeleton_state

__all__ = ["CONFIG_FILE", "DEFAULT_MAX_SHARD_BYTES", "ExportResult", "export_model_state", "import_model_state",
           "load_hf_checkpoint", "read_config_json", "check_state", "check_compressed_vocab"]

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportResult:
    directory: Path
    files: list[Path]
    tensors: int
    elided: list[str] = field(default_factory=list)
    dtype: str = "float32"


def check_state(state: dict[str, torch.Tensor], cfg: ModelSchema) -> None:
    """Refuse a state whose names or shapes differ from the model ``cfg`` describes."""
    expected = skeleton_state(cfg)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ConversionError(f"the state does not match model '{cfg.name}': missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for name, info in expected.items():
        if tuple(state[name].shape) != info.full_shape:
            raise ConversionError(f"{name}: shape {tuple(state[name].shape)}, the config expects {info.full_shape} "
                                  "(a shard, not the full tensor?)")


def _target_dtype(view: torch.Tensor, keep_fp32: bool, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not view.is_floating_point() or (keep_fp32 and view.dtype == torch.float32):
        return view.dtype
    return dtype


def export_model_state(full_state: dict[str, torch.Tensor], cfg: ModelSchema, out_dir: str | Path, *,
                       dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       progress: bool = True, registry: MappingRegistry | None = None,
                       extra_files: dict[str, bytes] | None = None, private: bool = False,
                       tokenizer=None) -> ExportResult:
    """Write ``full_state`` of model ``cfg`` as a Hugging Face checkpoint in ``out_dir``.

    ``dtype``: None keeps each tensor's dtype (lossless); "bfloat16"/"float16"/"float32" casts
    floating tensors except those the reference keeps in float32 (mHC, sinks, router biases).
    ``out_dir`` must not exist or be empty. ``extra_files`` (the tokenizer files, the
    verification logits) are written beside the weights; what the family records about the
    ``tokenizer`` goes into ``config.json`` (V4.1: the Engram map's size, as the release does). Files and
    the directory get the usual modes of this process's umask (e.g. 0644 / 0755), or owner-only
    0600 / 0700 with ``private``.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; export into a new directory")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype: choose one of {sorted(_DTYPES)} or None, got {dtype!r}")
    target = _DTYPES.get(dtype) if dtype else None
    check_state(full_state, cfg)
    adapter = family_of(cfg).hf
    # the table an import of this export will read it with (a family may pick one per config.json)
    registry = registry or adapter.registry_for(adapter.config_to_hf(cfg, dtype or "float32"))
    views, elided = registry.export_views(full_state, adapter.context(cfg))
    dtypes = {name: _target_dtype(v, m.keep_fp32, target) for name, (v, m) in views.items()}
    plan = [(name, v.numel() * torch.empty((), dtype=dtypes[name]).element_size()) for name, (v, _) in views.items()]

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: views[n][0].to(dtypes[n]).contiguous() for n in names}

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        raise ConversionError(f"{out}: cannot be created ({exc.strerror}: {exc.filename}); choose another "
                              "output directory") from None
    try:
        with tqdm(total=len(plan), desc="export", unit="tensor", disable=not progress) as bar:
            files = write_sharded(tmp, plan, produce, max_shard_bytes=max_shard_bytes,
                                  metadata={"producer": "megatron_s2"}, progress=bar)
        counts: dict[str, int] = {}
        for d in dtypes.values():
            counts[str(d).replace("torch.", "")] = counts.get(str(d).replace("torch.", ""), 0) + 1
        main_dtype = max(counts, key=counts.get)
        config = adapter.config_to_hf(cfg, main_dtype)
        adapter.annotate_export(config, cfg, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        _set_modes(tmp, private)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, [out / f.name for f in files], len(plan), elided, main_dtype)


def _set_modes(directory: Path, private: bool) -> None:
    """``mkdtemp`` (0700) and safetensors (0600) create owner-only files; a release directory
    is meant to be shared: apply the umask's modes (owner-only only when asked)."""
    if private:
        dir_mode, file_mode = 0o700, 0o600
    else:
        umask = os.umask(0)
        os.umask(umask)
        dir_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    for path in directory.iterdir():
        path.chmod(file_mode)
    directory.chmod(dir_mode)


def read_config_json(hf_dir: str | Path) -> dict:
    """The ``config.json`` of a Hugging Face directory as a mapping; a ConversionError naming the
    file for anything else (missing, unreadable, not UTF-8, not JSON, nested beyond reason, not
    an object)."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{Path(hf_dir)}: no {CONFIG_FILE}; the architecture cannot be determined")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConversionError(f"{path}: nested too deeply to be a model config; give the checkpoint's own "
                              f"{CONFIG_FILE}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConversionError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_hf_checkpoint(hf_dir: str | Path, *, progress: bool = True, registry: MappingRegistry | None = None
                       ) -> tuple[ModelSchema, dict[str, torch.Tensor], ImportReport]:
    """(config, full state, report) of a Hugging Face checkpoint directory."""
    directory = Path(hf_dir)
    data = read_config_json(directory)
    adapter = family_for_hf_config(data).hf
    cfg = adapter.config_from_hf(data)
    reader = SafetensorsReader(directory)
    expected = skeleton_state(cfg)
    with tqdm(total=len(expected), desc="import", unit="tensor", disable=not progress) as bar:
        state, report = (registry or adapter.registry_for(data)).import_state(TensorSource(reader), expected,
                                                                    adapter.context(cfg), progress=bar)
    return cfg, state, report


def check_compressed_vocab(hf_dir: str | Path, tokenizer) -> None:
    """A tokenizer the checkpoint's ``config.json`` rules out (the family decides what it states;
    V4.1: ``engram_compressed_vocab_size`` must equal the tokenizer's compressed token map, or
    every Engram hash multiplier differs)."""
    data = read_config_json(hf_dir)
    family_for_hf_config(data).hf.check_tokenizer(data, tokenizer, str(hf_dir))


def import_model_state(hf_dir: str | Path, *, progress: bool = False) -> tuple[ModelSchema, dict[str, torch.Tensor]]:
    """(config, full state) of a Hugging Face checkpoint directory."""
    cfg, state, _ = load_hf_checkpoint(hf_dir, progress=progress)
    return cfg, state
