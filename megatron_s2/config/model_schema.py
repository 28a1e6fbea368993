"""The recipe's ``model:`` section, whatever the model family: the base every family's schema extends.

A *model family* (``megatron_s2/models/<family>/``) owns everything family-specific, including
the dataclass its ``model:`` section maps onto. ``model.family`` (default ``v41``) selects it:

* an installed family name — an entry point of the ``megatron_s2.model_families`` group whose
  value is the family's package (``setup.py``: ``v41 = megatron_s2.models.v41``), or
* the dotted path of any importable family package (a family of your own, or the minimal dense
  family of the test suite), e.g. ``family: my_lab.families.gqa``.

A family package follows one convention: its ``config`` module defines ``CONFIG_CLASS`` (a
:class:`ModelSchema` subclass; importing it must not import torch, so that loading a recipe
stays cheap) and its ``family`` module defines ``FAMILY`` (the implementation, reached by
generic code only through :func:`megatron_s2.models.family.family_of`).

Generic code below the model layer (the layout, the tokenizer checks, the planners) reads a
model only through this base class: a few shared fields and :meth:`ModelSchema.layout_requirements`.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Mapping

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.timeseries import TimeSeriesConfig

__all__ = ["ModelSchema", "LayoutRequirements", "DEFAULT_FAMILY", "ENTRY_POINT_GROUP", "family_package",
           "schema_class", "installed_families"]

DEFAULT_FAMILY = "v41"
ENTRY_POINT_GROUP = "megatron_s2.model_families"


@dataclass(frozen=True)
class LayoutRequirements:
    """What a parallel layout must respect to cut this model (checked by ``ParallelLayout.build``)."""

    tp: tuple[tuple[int, str], ...] = ()
    """(count, what) pairs that tensor parallelism must divide, e.g. ``(64, "query heads")``."""
    ep: tuple[tuple[int, str], ...] = ()
    """(count, what) pairs that expert parallelism must divide (routed experts)."""
    etp: tuple[tuple[int, str], ...] = ()
    """(count, what) pairs that expert-tensor parallelism must divide (expert width)."""
    cp_min_chunk: int = 1
    """Shortest context-parallel chunk (tokens): the attention window whose halo a chunk passes on."""
    engram: bool = False
    """The model has Engram tables (engram-parallel sizes above 1 are allowed)."""
    experts: bool = False
    """The model has routed experts (ep / etp above 1 are allowed)."""
    no_context_parallel: str = ""
    """Why the family cannot run under context parallelism (empty: it can); cp > 1 is refused with it."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """The ``parallel.recompute`` modes the family implements."""


@dataclass(frozen=True)
class ModelSchema(abc.ABC):
    """Fields every model family has. A family's schema subclasses it (``CONFIG_CLASS``), adds its
    own fields (each with a docstring), validates in ``__post_init__`` with :class:`ConfigError`
    messages that name the field, and implements :attr:`num_layers` and :meth:`layout_requirements`."""

    family: str = DEFAULT_FAMILY
    """Model family: an installed family name (``v41``) or the dotted path of a family package."""
    name: str = "custom"
    """Free-form model name, printed in logs and stored in checkpoints."""
    vocab_size: int = 32000
    """Vocabulary size of the embedding and the prediction head."""
    hidden_size: int = 1024
    """Hidden dimension."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of parameters."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Activation dtype of matrix products (the family's precision map keeps its float32 islands)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices."""
    timeseries: TimeSeriesConfig | None = None
    """The time-series lane (Intern-S2 report §2.2.1-2.2.2): series encoder and forecasting
    branch; absent = text only (megatron_s2/config/timeseries.py)."""

    @classmethod
    def resolve_schema(cls, data: Any, path: str) -> type:
        """The dataclass a ``model:`` mapping maps onto: the schema of its ``family``."""
        given = isinstance(data, Mapping) and "family" in data
        family = data["family"] if given else DEFAULT_FAMILY
        if not isinstance(family, str) or not family:
            raise ConfigError(f"{path}.family: expected a family name or a package path, got {family!r}")
        if cls is not ModelSchema:  # a family's own schema: the mapping must not name another family
            if given and schema_class(family, f"{path}.family") is not cls:
                raise ConfigError(f"{path}.family: '{family}' is not the family of {cls.__name__}")
            return cls
        return schema_class(family, f"{path}.family")

    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """Transformer layers (pipeline stages are cut between them)."""

    def layout_requirements(self) -> LayoutRequirements:
        """Divisibility rules of the family's parallel plan (tensor, expert, context parallelism)."""
        return LayoutRequirements(tp=((self.vocab_size, "vocabulary entries"),))

    @property
    def uses_token_map(self) -> bool:
        """The weights depend on the tokenizer beyond token ids (e.g. Engram's compressed token map):
        conversion refuses to run without the tokenizer."""
        return False

    def check_tokenizer(self, vocab_size: int, pad_id: int | None, name: str) -> None:
        """Refuse a tokenizer the model cannot be trained with beyond its vocabulary size (which the
        caller checks), with a ConfigError naming the field; default: nothing more."""

    def optimizer_rules(self) -> tuple:
        """Parameter-group rules (:class:`~megatron_s2.config.optimizer.ParamGroupRule`) this
        family puts before the default table when the recipe gives none; default: none."""
        return ()

    def replace(self, **changes) -> "ModelSchema":
        return dataclasses.replace(self, **changes)


def installed_families() -> dict[str, str]:
    """``{name: package}`` of the families registered as entry points."""
    return dict(_entry_points())


@lru_cache(maxsize=1)
def _entry_points() -> tuple[tuple[str, str], ...]:
    from importlib.metadata import entry_points

    return tuple(sorted((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP)))


def family_package(family: str, where: str = "model.family") -> str:
    """The package of ``family``: an installed family's entry point, else the name itself
    when it is an importable package path."""
    registered = installed_families()
    if family in registered:
        return registered[family]
    if "." in family:
        return family
    names = ", ".join(sorted(registered)) or "none (reinstall megatron_s2: pip install -e .)"
    raise ConfigError(f"{where}: '{family}' is not an installed model family (installed: {names}); give one of "
                      "them or the dotted path of a family package")


@lru_cache(maxsize=None)
def _schema_class(package: str) -> type:
    module = importlib.import_module(f"{package}.config")
    cls = getattr(module, "CONFIG_CLASS", None)
    if not (isinstance(cls, type) and issubclass(cls, ModelSchema)):
        raise TypeError(f"{package}.config.CONFIG_CLASS must be a ModelSchema subclass, got {cls!r}")
    return cls


def schema_class(family: str, where: str = "model.family") -> type:
    """The ``ModelSchema`` subclass of ``family`` (imports only the family's torch-free config module)."""
    package = family_package(family, where)
    try:
        return _schema_class(package)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{where}: family '{family}' cannot be imported ({exc}); check the package path "
                          "and that it is on PYTHONPATH") from None
    except (TypeError, AttributeError) as exc:
        raise ConfigError(f"{where}: family '{family}' is not a model family package ({exc})") from None

