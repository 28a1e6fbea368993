"""A recipe: one YAML file mapped 1:1 onto one dataclass per subsystem.

Anatomy (every section optional; unknown keys are errors that name the key path)::

    base: ../base/pretrain.yaml     # another recipe this one extends (relative to this file)
    model: tiny                     # a file in recipes/models/ (name or path), or a mapping
    phase:      {...}               # PhaseConfig
    parallel:   {...}               # ParallelConfig
    training:   {...}               # TrainingConfig
    optimizer:  {...}               # OptimizerConfig
    schedule:   {...}               # ScheduleConfig
    data:       {...}               # DataConfig
    checkpoint: {...}               # CheckpointConfig
    logging:    {...}               # LoggingConfig
    launcher:   {...}               # LauncherConfig
    rl:         {...}               # RLConfig (phase.kind: rl)
    opd:        {...}               # OPDConfig (phase.kind: opd)
    contrastive: {...}              # ContrastiveConfig (phase.kind: contrastive; optional)

Precedence, lowest to highest: dataclass defaults < base recipe (recursively) < the model
file named by ``model:`` < keys written in the recipe itself (including ``model:`` given as
a mapping, merged over the named file via ``model: {file: tiny, hidden_size: 96}``) <
command-line overrides ``section.key=value``. The resolved recipe, written as
``config.yaml`` in the run directory, is self-contained: it reproduces the run alone.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from megatron_s2.config.checkpoint import CheckpointConfig
from megatron_s2.config.contrastive import ContrastiveConfig, check_contrastive_recipe
from megatron_s2.config.data import DataConfig
from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.config.logging import LoggingConfig
from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.optimizer import OptimizerConfig, ScheduleConfig
from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.phase import PhaseConfig
from megatron_s2.config.schema import ConfigError, apply_override, from_mapping, to_mapping
from megatron_s2.config.training import TrainingConfig
from megatron_s2.config.posttrain import OPDConfig, RLConfig

__all__ = ["RecipeConfig", "load_recipe", "MODELS_DIR", "RECIPES_DIR"]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
MODELS_DIR = RECIPES_DIR / "models"
FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32 (``torch.finfo(torch.float32).max``; config code does not import torch)."""


@dataclass(frozen=True)
class RecipeConfig:
    model: ModelSchema
    """The model (recipes/models/*.yaml); ``model.family`` selects its schema (default v41)."""
    phase: PhaseConfig = field(default_factory=PhaseConfig)
    """What is trained and with which loss."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout sizes."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Steps, batch geometry, seed, run directory."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Muon / Sinkhorn / AdamW hyper-parameters (§4.2.2)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule (§4.2.2)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and resume policy."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics, TensorBoard, progress bar."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Defaults for `megatron-s2 launch`."""
    rl: RLConfig | None = None
    """Reinforcement learning (phase.kind: rl): rollout x advantage x loss (megatron_s2/posttrain)."""
    opd: OPDConfig | None = None
    """On-policy distillation (phase.kind: opd): teachers, rollout, loss (megatron_s2/posttrain)."""
    contrastive: ContrastiveConfig | None = None
    """SigLIP vision pre-training (phase.kind: contrastive): text tower, embedding, resolution cap,
    pairs; absent = the defaults."""

    def __post_init__(self) -> None:
        from megatron_s2.config.posttrain.recipe_checks import check_posttrain_recipe

        check_posttrain_recipe(self)
        check_contrastive_recipe(self)
        # The optimisers apply lr x lr_mult in the parameters' floating-point type: a product
        # beyond float32's range overflows inside the first step instead of here.
        worst = max(self.optimizer.rules, key=lambda rule: rule.lr_mult)
        if self.schedule.lr * worst.lr_mult > FLOAT32_MAX:
            raise ConfigError(f"schedule.lr: {self.schedule.lr:g} x lr_mult {worst.lr_mult:g} (optimizer rule "
                              f"'{worst.pattern}') exceeds the float32 range ({FLOAT32_MAX:.3g}) the optimizers "
                              "compute in; use a learning rate such as 1e-4")

    def to_mapping(self) -> dict:
        return to_mapping(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_mapping(), sort_keys=False)

    def replace(self, **sections) -> "RecipeConfig":
        return dataclasses.replace(self, **sections)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"recipe file '{path}' does not exist; check the path (recipes live in {RECIPES_DIR})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe file '{path}' is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"recipe file '{path}' cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = problem or " ".join(str(exc).split())
        raise ConfigError(f"recipe file '{path}' is not valid YAML{where}: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _model_file(ref: str, relative_to: Path) -> Path:
    candidates = [relative_to / ref, MODELS_DIR / ref, MODELS_DIR / f"{ref}.yaml"]
    for cand in candidates:
        if cand.is_file():
            return cand
    names = sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))
    raise ConfigError(f"model: '{ref}' is neither a file nor a model in {MODELS_DIR} (available: {', '.join(names)})")


def _resolve_model(node: Any, relative_to: Path) -> dict:
    if isinstance(node, str):
        return _read_yaml(_model_file(node, relative_to))
    if isinstance(node, dict):
        node = dict(node)
        ref = node.pop("file", None)
        base = _read_yaml(_model_file(ref, relative_to)) if ref else {}
        return _merge(base, node)
    raise ConfigError(f"model: expected a model name, a file path or a mapping, got {node!r}")


def _resolve_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"base: recipes include each other in a cycle: {chain}")
    data = _read_yaml(path)
    base_ref = data.pop("base", None)
    tree: dict = {}
    if base_ref is not None:
        if not isinstance(base_ref, str):
            raise ConfigError(f"base: expected a recipe path in '{path}', got {base_ref!r}")
        tree = _resolve_tree(path.parent / base_ref, (*seen, path))
    if "model" in data:
        model = _resolve_model(data.pop("model"), path.parent)
        base_model = tree.get("model", {}) if isinstance(tree.get("model"), dict) else {}
        tree["model"] = model if not base_model else _merge(base_model, model)
    return _merge(tree, data)


PHASE_REFERENCE = re.compile(r"\$\{phase:([^}]*)\}")
"""``${phase:<name>}`` in a recipe value: the run directory of an earlier phase of the pipeline
the recipe runs in (``megatron-s2 launch <pipeline.yaml>``), e.g. an OPD teacher's checkpoint."""


def _substitute_phases(node: Any, phase_dirs: Mapping[str, str] | None, where: str) -> Any:
    if isinstance(node, dict):
        return {k: _substitute_phases(v, phase_dirs, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_phases(v, phase_dirs, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str) or "${phase:" not in node:
        return node

    def one(match: re.Match) -> str:
        name = match.group(1)
        if phase_dirs is None or name not in phase_dirs:
            if phase_dirs is None:
                raise ConfigError(f"{where}: '{match.group(0)}' names a pipeline phase, which only resolves when the "
                                  "recipe runs as a phase of a pipeline (megatron-s2 launch <pipeline.yaml>); give "
                                  "the path itself to run it alone")
            raise ConfigError(f"{where}: '{match.group(0)}' is not an earlier phase of this pipeline; earlier phases: "
                              f"{', '.join(phase_dirs) or 'none'}")
        return phase_dirs[name]

    return PHASE_REFERENCE.sub(one, node)


def load_recipe(path: str | Path, overrides: Iterable[str] = (),
                phase_dirs: Mapping[str, str] | None = None) -> RecipeConfig:
    """Load, merge and validate a recipe; raise ConfigError naming the offending key.

    ``phase_dirs`` (pipeline phases: name -> run directory) resolves ``${phase:<name>}`` in any
    value; outside a pipeline such a reference is refused with a one-line error."""
    tree = _resolve_tree(Path(path))
    if "model" not in tree and "phases" in tree:
        phases = [p.get("recipe") for p in tree["phases"] if isinstance(p, dict)] if isinstance(tree["phases"], list) else []
        raise ConfigError(f"recipe file '{path}' is a pipeline (a phases: list), not one phase's recipe; run it with "
                          f"`megatron-s2 launch`, or give one of its phase recipes ({', '.join(map(str, phases))})")
    for text in overrides:
        if text.startswith("model.") and isinstance(tree.get("model"), str):
            tree["model"] = _resolve_model(tree["model"], Path(path).parent)
        apply_override(tree, text)
    tree = _substitute_phases(tree, phase_dirs, "")
    if "model" not in tree:
        raise ConfigError("model: the recipe names no model; add `model: tiny` (or a path to a model file)")
    if isinstance(tree["model"], str):
        tree["model"] = _resolve_model(tree["model"], Path(path).resolve().parent)
    backbone = tree["phase"].get("memdec_backbone_model") if isinstance(tree.get("phase"), dict) else None
    if isinstance(backbone, str) and backbone:
        # resolved where `plan memory` and the memdec trainer resolve it (the working directory), so
        # `launch --slurm --dry-run` refuses a misspelt one now, not once the job has queued (review24)
        try:
            _resolve_model(backbone, Path.cwd())
        except ConfigError as exc:
            raise ConfigError(f"phase.memdec_backbone_model: {str(exc).removeprefix('model: ')}") from None
    return from_mapping(RecipeConfig, tree)
