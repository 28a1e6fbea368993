"""Multi-phase pipelines: recipes chained so that each phase starts from the previous one.

A pipeline file is a YAML file with a ``phases:`` list (recognised by that key)::

    run_dir: runs/tiny-pretrain-sft      # phases run in <run_dir>/<name>; --run-dir overrides
    phases:
      - name: pretrain
        recipe: tiny_pretrain.yaml       # relative to this file
        overrides: [training.train_steps=200]
      - name: sft
        recipe: tiny_sft.yaml
        # from_previous: true (default): start from pretrain's final checkpoint

A phase with ``from_previous`` (every phase but the first, unless it says ``false``) gets
``checkpoint.load=<previous run_dir>/checkpoints`` and ``checkpoint.load_optimizer=false``
(weights only: a new phase starts a fresh optimiser and schedule). Any recipe value or override
of a phase may name an earlier phase's run directory as ``${phase:<name>}`` (e.g. an OPD teacher:
``checkpoint: ${phase:teacher}/checkpoints``), so the pipeline still finds it under ``--run-dir``.
Every phase is checked before the first starts: a checkpoint it loads must exist then, unless it
lies in an earlier phase's run directory (that phase writes it). On SLURM each phase is a job
depending on the previous one (``--dependency=afterok:<id>``); locally the phases run one after
the other.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import ConfigError, from_mapping
from megatron_s2.launcher.job import JobDir

__all__ = ["PhaseEntry", "PipelineConfig", "is_pipeline_file", "load_pipeline", "chain_from"]

_PHASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class PhaseEntry:
    name: str
    """Phase name: its run directory under the pipeline's and its job name suffix."""
    recipe: str
    """Recipe file of the phase (relative to the pipeline file)."""
    overrides: tuple[str, ...] = ()
    """``section.key=value`` overrides for this phase only."""
    from_previous: bool | None = None
    """Start from the previous phase's final checkpoint (weights only); unset = true for every
    phase but the first, which has no previous phase (true there is an error)."""

    def __post_init__(self) -> None:
        if not _PHASE_NAME.fullmatch(self.name):
            raise ConfigError(f"name: {self.name!r} must be letters, digits, '.', '_' or '-' "
                              "(it names a directory)")
        if not self.recipe:
            raise ConfigError(f"phases.recipe: phase {self.name!r} names no recipe")


@dataclass(frozen=True)
class PipelineConfig:
    phases: tuple[PhaseEntry, ...]
    """The phases, in order."""
    run_dir: str = ""
    """Parent of the phases' run directories (relative to the working directory, like
    training.run_dir); --run-dir overrides it."""

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("phases: a pipeline needs at least one phase")
        names = [p.name for p in self.phases]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"phases.name: {', '.join(duplicates)} used twice; phase names must be unique")
        if self.phases[0].from_previous:
            raise ConfigError(f"phases[0].from_previous: the first phase ({self.phases[0].name!r}) has no previous "
                              "phase to start from; remove from_previous, or start it from a checkpoint with "
                              "overrides: [checkpoint.load=DIR]")

    def chained(self, index: int) -> bool:
        """Whether phase ``index`` starts from the previous phase's final checkpoint."""
        return index > 0 and self.phases[index].from_previous is not False


def is_pipeline_file(path: str | Path) -> bool:
    """A YAML mapping with a ``phases`` key (recipes never have one)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "phases" in data


def load_pipeline(path: str | Path) -> PipelineConfig:
    """Read a pipeline file; recipe paths come back resolved against the file's folder."""
    path = Path(path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "phases" not in data:  # e.g. a pipe: read once already, empty now
        raise ConfigError(f"{path}: a pipeline file needs a phases: list (give a regular file, not a pipe)")
    pipeline = from_mapping(PipelineConfig, data)
    phases = tuple(dataclasses.replace(p, recipe=str((path.parent / p.recipe).resolve())) for p in pipeline.phases)
    return dataclasses.replace(pipeline, phases=phases)


def chain_from(recipe: RecipeConfig, previous_run_dir: Path) -> RecipeConfig:
    """``recipe`` starting from the final checkpoint of the phase run in ``previous_run_dir``.

    Same effect as the overrides ``checkpoint.load=<previous>/checkpoints`` and
    ``checkpoint.load_optimizer=false``, applied to the loaded recipe so that any path is safe.
    """
    checkpoint = dataclasses.replace(recipe.checkpoint, load=str(JobDir(previous_run_dir).checkpoints),
                                     load_optimizer=False)
    return recipe.replace(checkpoint=checkpoint)
