"""The one interface between generic code and a model family.

A family (``megatron_s2/models/<family>/``, or any package named by ``model.family``) owns its
model, its parallel plan (the PLAN of :class:`~megatron_s2.parallel.placement.ParamPlacement`),
its Hugging Face adapter, its accounting, its inference state and its recipe schema. Generic
code — trainer, pipeline schedules, checkpoints and HF conversion, planner, inference engine,
server, post-training — reaches it only through :func:`~megatron_s2.models.family.family_of`
and the objects below, never by importing the family's package.

What a family provides
======================

:class:`ModelFamily` (the module ``<package>.family`` defines ``FAMILY``):

* :meth:`~ModelFamily.build_model` — the model of one rank: all layers, or the union of a
  pipeline rank's stages (``layers`` / ``pre_process`` / ``post_process``, megatron-core's
  convention). The module satisfies :class:`FamilyModel`.
* :meth:`~ModelFamily.stage_payloads` — under pipeline parallelism, what crosses each cut
  beyond the hidden state (:class:`~megatron_s2.models.family.pipeline.StagePayloads`; the generic
  :class:`~megatron_s2.pipeline.runtime.PipelineRuntime` moves it).
* :attr:`~ModelFamily.hf` — the Hugging Face adapter (:class:`~megatron_s2.models.family.hf.HFAdapter`).
* :meth:`~ModelFamily.account` / :meth:`~ModelFamily.memory_model` — ``megatron-s2 account`` and
  the per-layer terms of ``megatron-s2 plan memory``.
* :meth:`~ModelFamily.executor` — the engine-side state of one inference engine and its one
  incremental forward (:class:`~megatron_s2.models.family.engine.ModelExecutor`);
  :meth:`~ModelFamily.check_engine` — the executor's rules on engine settings, without a model.

Naming convention (read by the skeleton, the planner and pipeline stage filters): parameters
of the embedding live under ``embedding.``, of layer ``i`` under ``layers.<i>.`` (global
index, so names do not depend on the layout), everything else belongs to the last stage.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch
from torch import nn

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.models.family.pipeline import HiddenOnlyPayloads, StagePayloads

if TYPE_CHECKING:
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.models.family.engine import ModelExecutor
    from megatron_s2.models.family.hf import HFAdapter
    from megatron_s2.parallel.groups import ParallelGroups
    from megatron_s2.parallel.layout import ParallelLayout

__all__ = ["ModelFamily", "FamilyModel", "ImageProcessor", "StagePayloads", "HiddenOnlyPayloads", "MemoryModel", "RankShape", "LayerActivations", "FLOAT_BYTES", "CommVolume",
           "AccountReport"]


class FamilyModel(Protocol):
    """What generic code calls on a family's model (an ``nn.Module``) during training and scoring.

    A forward of one stage is ``embed`` (first stage) -> ``run_layers`` -> ``head`` (last stage);
    the hidden state between them is a tuple of tensors (one for a plain residual stream; the
    V4.1 backbone carries its mHC streams and input mix). ``forward(tokens, ctx)`` chains them.

    Optional: ``embed_vectors(vectors [b, s, d]) -> hidden`` (vectors in place of token embeddings)
    and ``final_hidden(*hidden) -> [b, s, d]`` (the normed state the head reads) — what visual
    next-patch pre-training needs of a backbone (:mod:`megatron_s2.models.next_patch`)."""

    config: ModelSchema
    groups: "ParallelGroups"

    @property
    def layer_ids(self) -> list[int]: ...

    def make_context(self, micro_batch: dict[str, torch.Tensor], *, routing=None, step_state=None,
                     positions=None, doc_ids=None) -> Any:
        """The forward context of one micro-batch (``tokens``, optional ``position_ids``,
        ``doc_ids``, context-parallel ``full_*`` views). It carries the family's auxiliary losses
        (``total_aux_loss()``, ``aux_losses``, ``aux_metrics``) and, when given, a routing replay."""

    def embed(self, input_ids: torch.Tensor, images=None) -> tuple[torch.Tensor, ...]:
        """Token ids -> the hidden state. ``images`` (families with an :meth:`ModelFamily.image_processor`
        only; the schedules pass it only when a micro-batch has an ``images`` entry): per row, the
        list of image inputs its processor's ``prepare`` made, whose spans take visual embeddings."""

    def run_layers(self, hidden: tuple[torch.Tensor, ...], ctx, layer_ids: Iterable[int] | None = None
                   ) -> tuple[torch.Tensor, ...]: ...

    def final_hidden(self, *hidden: torch.Tensor) -> torch.Tensor:
        """The normalised last hidden state [b, s, d] that ``head`` projects to the logits (the
        Memory Decoder's datastore keys and router features read it)."""

    def head(self, *hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, float32."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [b, s] (vocabulary-parallel)."""

    def prepare_step(self, micro_batches: list[dict], make_context) -> Any:
        """Work done once per optimiser step for all micro-batches (None when there is none);
        the returned object's ``finish()`` runs after the last backward."""

    def after_optimizer_step(self, skipped: bool) -> None:
        """Once per optimiser step (e.g. the auxiliary-loss-free expert-bias update)."""

    def set_recompute(self, mode: str) -> None: ...

    def set_token_map(self, token_map: list[int] | None) -> None: ...

    def init_weights(self, seed: int) -> "FamilyModel": ...

    def apply_precision_map(self) -> None:
        """Store the parameters as the family's precision map says (``params_dtype`` matrices,
        float32 islands); a model built for rollouts, a teacher or a reference calls it after
        construction, as ``init_weights`` does for a trained model."""


class ImageProcessor(Protocol):
    """How a family with a vision pathway turns a decoded image into a span of the token sequence.

    The data loader (:mod:`megatron_s2.data.image_text`) sizes documents with
    :meth:`span_length` before any pixel is processed, writes ``image_token_id`` at every position
    of the span, and hands :meth:`prepare`'s result to ``model.embed(tokens, images=...)``."""

    image_token_id: int
    """The id every position of an image span carries in the input ids."""

    def span_length(self, width: int, height: int) -> int:
        """Positions the span of an image of ``width x height`` pixels takes (resize planning only)."""

    def prepare(self, image: Any, start: int) -> Any:
        """A decoded RGB Pillow image -> the model's input for a span starting at position ``start``."""

    def work(self, width: int, height: int) -> float:
        """Relative vision-forward cost of an image of ``width x height`` pixels (resize planning
        only): what balanced image sharding across context-parallel ranks balances."""


@dataclass(frozen=True)
class RankShape:
    """Where one micro-batch sits on one rank: what per-layer activation estimates depend on."""

    batch: int
    seq: int            # full sequence length
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    training: bool = True

    @property
    def tokens(self) -> float:
        """Local queries: the rank's context chunk."""
        return self.batch * self.seq / self.cp

    @property
    def stream_tokens(self) -> float:
        """Tokens of the residual stream on this rank (split over tp under sequence parallelism)."""
        return self.tokens / self.tp if self.sequence_parallel else self.tokens

    @property
    def moe_tokens(self) -> float:
        """Tokens this rank routes (an MoE layer routes a disjoint 1/tp of them)."""
        return self.tokens / self.tp


FLOAT_BYTES = 4


@dataclass
class LayerActivations:
    """Bytes one layer saves for its backward, by component."""

    layer: int
    parts: dict[str, float] = field(default_factory=dict)   # component -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def add(self, name: str, elements: float) -> None:
        """Add ``elements`` float32 elements to component ``name``."""
        self.parts[name] = self.parts.get(name, 0.0) + elements * FLOAT_BYTES


@dataclass
class CommVolume:
    """Wire bytes of one optimiser step on one rank, by process-group kind (tp, ep, dp, pp, cp, ...)."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float) -> None:
        if nbytes:
            self.parts[kind] = self.parts.get(kind, 0.0) + nbytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())


class MemoryModel(abc.ABC):
    """The family's terms of the per-rank memory plan (``megatron-s2 plan memory``); the generic
    planner adds model state from the skeleton, the pipeline schedule's in-flight micro-batches
    and what post-training keeps resident."""

    @abc.abstractmethod
    def layer_activations(self, layer: int, shape: RankShape, recompute: str) -> LayerActivations: ...

    @abc.abstractmethod
    def head_activations(self, shape: RankShape) -> float: ...

    @abc.abstractmethod
    def transient_bytes(self, shape: RankShape, last_stage: bool) -> float: ...

    def payload_bytes(self, layout: "ParallelLayout", stage: int, shape: RankShape, parallel) -> float:
        """Inbound shared states + the whole outbound message of ``stage`` (pipeline buffers)."""
        return 0.0

    @abc.abstractmethod
    def comm_volume(self, recipe, layout: "ParallelLayout", pp_rank: int, grad_bytes: float,
                    expert_grad_bytes: float = 0.0) -> "CommVolume":
        """Wire bytes of one step on a rank of pipeline stage ``pp_rank`` (``grad_bytes`` /
        ``expert_grad_bytes``: its dense / expert gradients, from the model-state count)."""

    def shadow_parameters(self, layout: "ParallelLayout", rank: int, parallel) -> list[tuple[torch.Tensor, bool]]:
        """(meta parameter, receives gradients) of the replicas ``rank`` holds (pipeline shadows)."""
        return []


@dataclass
class AccountReport:
    """``megatron-s2 account``: figures by key (``--json``) and the lines printed for people."""

    figures: dict
    lines: list[str]


class ModelFamily(abc.ABC):
    """A model family (module docstring). Stateless: one instance, ``FAMILY``, per package."""

    name: str
    config_class: type[ModelSchema]

    # ---- model -------------------------------------------------------------------------
    @abc.abstractmethod
    def build_model(self, cfg: ModelSchema, groups: "ParallelGroups | None" = None, *,
                    layers: Iterable[int] | None = None, pre_process: bool = True, post_process: bool = True,
                    portable: bool = False) -> nn.Module:
        """The (uninitialised) model of one rank; ``portable``: leaf modules that need no optional
        backend (e.g. Transformer Engine) but hold the same parameters — for skeletons and conversion."""

    def stage_payloads(self, model: nn.Module, layout: "ParallelLayout", groups: "ParallelGroups", pp_rank: int,
                       parallel) -> StagePayloads:
        """The pipeline cut messages of this rank's stages (``parallel``: the recipe's ParallelConfig);
        by default only the hidden state crosses a cut."""
        return HiddenOnlyPayloads(model, layout, groups)

    def build_contrastive_model(self, cfg: ModelSchema, contrastive, vocab_size: int,
                                groups: "ParallelGroups | None" = None) -> nn.Module:
        """The (uninitialised) two-tower model of ``phase.kind: contrastive``: the family's vision
        encoder beside a text tower (``contrastive``: the recipe's ContrastiveConfig)."""
        from megatron_s2.config.schema import ConfigError

        raise ConfigError(f"phase.kind: contrastive: model family '{self.name}' has no vision encoder to "
                          "pre-train; use a v41 model with vision_n_layers > 0")

    def check_recipe(self, recipe) -> None:
        """Refuse, with a ConfigError naming the field, what this family cannot run (backends,
        parallel settings); called before any rank starts and by every rank at start-up."""

    def image_processor(self, cfg: ModelSchema) -> ImageProcessor | None:
        """The :class:`ImageProcessor` of a model with a vision pathway; None for text-only models
        (the default)."""
        return None

    def vision_encoder_patterns(self, cfg: ModelSchema) -> tuple[str, ...]:
        """Parameter-name patterns (fnmatch) of the vision encoder that
        ``training.freeze_vision_until_decay`` holds frozen until the learning-rate decay (report
        §2.5); empty for text-only models (the default)."""
        return ()

    def describe(self, model: nn.Module, cfg: ModelSchema) -> list[str]:
        """Start-up log lines about precision and kernels."""
        return [f"precision: parameters {cfg.params_dtype}, compute {cfg.compute_dtype}"]

    # ---- accounting and planning --------------------------------------------------------
    @abc.abstractmethod
    def account(self, cfg: ModelSchema) -> AccountReport: ...

    @abc.abstractmethod
    def train_flops_per_token(self, cfg: ModelSchema, seq_length: int) -> float: ...

    @abc.abstractmethod
    def memory_model(self, cfg: ModelSchema) -> MemoryModel: ...

    # ---- checkpoints ---------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def hf(self) -> "HFAdapter": ...

    # ---- inference -------------------------------------------------------------------------
    @abc.abstractmethod
    def executor(self, model: nn.Module, config: "EngineConfig", device: torch.device) -> "ModelExecutor":
        """The engine-side state (KV cache, recurrent state, ...) of one inference engine over ``model``."""

    def check_engine(self, cfg: ModelSchema, config: "EngineConfig") -> None:
        """Refuse, with a ConfigError naming the :class:`~megatron_s2.config.engine.EngineConfig`
        field, settings :meth:`executor` cannot honour for this model (checked before any rank
        starts; the executor checks again when it is built). Default: none."""

    @abc.abstractmethod
    def engine_cache_bytes(self, cfg: ModelSchema, config: "EngineConfig") -> int:
        """Bytes :meth:`executor` allocates for ``config``, computed without allocating."""
