"""Phase section of a recipe (``phase:``): what is being trained and with which loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.data import DataConfig
from megatron_s2.config.next_patch import VisualNextPatchConfig
from megatron_s2.config.schema import ConfigError

__all__ = ["PhaseConfig"]


@dataclass(frozen=True)
class PhaseConfig:
    kind: Literal["pretrain", "sft", "rl", "opd", "dspark", "contrastive", "visual_next_patch", "memdec",
                  "memdec_router", "timeseries_forecast"] = "pretrain"
    """pretrain: loss on every token; sft: loss only on answer tokens (prompt masked); rl:
    reinforcement learning from verifiable rewards (the recipe's ``rl:`` section); opd: on-policy
    distillation (the ``opd:`` section). rl and opd roll out with the inference engine on the
    training ranks (megatron_s2/posttrain/trainer.py). dspark: the stage after pre-training that
    trains only the DSpark drafter on the frozen backbone's own distributions (V4.1 report
    §2.4.3); the backbone is frozen and not stored in the optimiser. contrastive: SigLIP pre-training
    of the vision encoder over image-text pairs with a small text tower (report §4.2.2; the
    optional ``contrastive:`` section, megatron_s2/training/contrastive_trainer.py); the vision
    encoder is stored under the ``vision.*`` names of the model's encoder. visual_next_patch:
    continued pre-training on text and rendered pages together, the pages' contrastive next-patch
    loss added to the text loss (Intern-S2 walkthrough Ch. 3, Eq. 5-9; settings in ``next_patch``). memdec: Memory
    Decoder pre-training (Intern-S2 walkthrough Ch. 2, Eq. 1-2): ``model:`` is the small memory decoder,
    trained on the domain corpus (``data:``) to imitate the kNN distribution of a datastore built
    from the frozen ``memdec_backbone``. memdec_router: router training (Eq. 3-4): ``model:`` is
    the memory decoder (``checkpoint.load``: its memdec run), frozen with the backbone; only the
    router trains, on ``data:`` (domain) and ``memdec_general_data`` mixed 1:1
    (megatron_s2/posttrain/memdec). timeseries_forecast: the forecasting branch (Intern-S2 report
    §2.2.2) trained with the text: ``data.kind: timeseries`` documents, the answer's cross-entropy
    (loss on answers, as in sft) times ``forecast_lambda_text`` plus the causal forecaster's error
    on the series' known futures times ``forecast_lambda``, plus, with ``model.timeseries.horizon_predictor``,
    the learned horizon predictor's NLL times ``horizon_lambda`` (megatron_s2/training/forecast_trainer.py)."""
    freeze: tuple[str, ...] = ()
    """Parameter-name globs frozen in this phase (e.g. the backbone while training a drafter)."""
    train_drafter: bool = False
    """Co-train the model's DSpark drafter in a pretrain / sft phase (§2.4.3: "we continue to train
    DSpark alongside the backbone, without propagating gradients from the DSpark objective into
    the backbone"); implied by ``kind: dspark``."""
    drafter_eta: float = 3.0
    """eta of the drafter's hybrid LK loss schedule lambda_k = exp(-eta * acceptance_k)
    (Intern-S2 walkthrough Eq. 23)."""
    drafter_temperature: float = 1.0
    """Temperature at which the drafter's distributions are matched to the policy's."""

    next_patch: VisualNextPatchConfig = field(default_factory=VisualNextPatchConfig)
    """Visual next-patch pre-training (``kind: visual_next_patch``): loss weights, temperature,
    page rendering and chunking (megatron_s2/config/next_patch.py)."""
    memdec_backbone: str = ""
    """The frozen backbone of the memdec / memdec_router phases: a run, checkpoints or step
    directory (``${phase:<name>}`` names an earlier phase of a pipeline); it shares the tokenizer."""
    memdec_backbone_model: str = ""
    """The backbone's architecture (a model recipe: name in recipes/models or path) for ``plan memory``
    before its checkpoint is written (a flagship plan before pretraining ran); the phases load the
    architecture saved with the checkpoint and refuse one of another name."""
    memdec_knn_k: int = 16
    """Neighbours retrieved per position for the kNN target (Eq. 1's N(k_t))."""
    memdec_knn_temperature: float = 1.0
    """tau of Eq. 1 (distances are squared L2 between final hidden states)."""
    memdec_beta: float = 0.5
    """beta of Eq. 2: weight of KL(p_kNN || p_mem) against the gold token's cross-entropy."""
    memdec_router_alpha: float = 0.05
    """alpha_s of Eq. 4: strength of the signed linear prior on lambda (-1 domain, +1 general)."""
    memdec_router_init_lambda: float = 0.1
    """lambda of the freshly initialised router (a constant dial until its weights learn)."""
    memdec_router_hidden: int = 64
    """Width of the router's hidden layer (features -> hidden -> GELU -> lambda logit)."""
    memdec_general_data: DataConfig | None = None
    """memdec_router: the general corpus mixed 1:1 with ``data:`` (the domain corpus)."""
    forecast_lambda: float = 1.0
    """timeseries_forecast: weight of the forecaster's loss (mean absolute error of the normalised values)."""
    forecast_lambda_text: float = 1.0
    """timeseries_forecast: weight of the text cross-entropy."""
    horizon_lambda: float = 1.0
    """timeseries_forecast with ``model.timeseries.horizon_predictor``: weight of the learned horizon
    predictor's cross-entropy against the true horizon (logged as ``loss_horizon_raw``, ``horizon_acc``)."""
    horizon_detach: bool = False
    """timeseries_forecast: the horizon predictor reads the backbone's hidden states without sending its
    gradient back into the backbone (the module learns alone; the backbone trains on text and forecast).
    Measured on timeseries_forecast_tiny: detached it reads 15/200 held-out horizons (the tiny
    character-level backbone does not encode "twenty-four" unasked), trained through 151/200."""

    def __post_init__(self) -> None:
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError("phase.freeze: duplicate patterns")
        if self.drafter_eta < 0:
            raise ConfigError(f"phase.drafter_eta: must be >= 0, got {self.drafter_eta}")
        if not self.drafter_temperature > 0:
            raise ConfigError(f"phase.drafter_temperature: must be positive, got {self.drafter_temperature}")
        if self.kind in ("memdec", "memdec_router") and not self.memdec_backbone:
            raise ConfigError(f"phase.memdec_backbone: phase.kind {self.kind} needs the frozen backbone's run or "
                              "checkpoint directory")
        if self.kind == "memdec_router" and self.memdec_general_data is None:
            raise ConfigError("phase.memdec_general_data: router training mixes the domain corpus (data:) with a "
                              "general one; give its data section here (e.g. {kind: procedural_text, corpus: general})")
        if self.forecast_lambda < 0 or self.forecast_lambda_text < 0:
            raise ConfigError(f"phase.forecast_lambda / forecast_lambda_text: must be >= 0, got {self.forecast_lambda} "
                              f"and {self.forecast_lambda_text}")
        if self.horizon_lambda < 0:
            raise ConfigError(f"phase.horizon_lambda: must be >= 0, got {self.horizon_lambda}")
        if self.kind == "timeseries_forecast" and self.forecast_lambda == 0:
            raise ConfigError("phase.forecast_lambda: 0 trains no forecaster in phase.kind timeseries_forecast; use "
                              "kind sft for text only, or a positive weight")
        if self.memdec_knn_k < 1:
            raise ConfigError(f"phase.memdec_knn_k: must be >= 1, got {self.memdec_knn_k}")
        if not self.memdec_knn_temperature > 0:
            raise ConfigError(f"phase.memdec_knn_temperature: must be positive, got {self.memdec_knn_temperature}")
        if not 0.0 <= self.memdec_beta <= 1.0:
            raise ConfigError(f"phase.memdec_beta: must be in [0, 1], got {self.memdec_beta}")
        if not self.memdec_router_alpha >= 0:
            raise ConfigError(f"phase.memdec_router_alpha: must be >= 0, got {self.memdec_router_alpha}")
        if self.memdec_router_hidden < 1:
            raise ConfigError(f"phase.memdec_router_hidden: must be >= 1, got {self.memdec_router_hidden}")
        if not 0.0 < self.memdec_router_init_lambda < 1.0:
            raise ConfigError(f"phase.memdec_router_init_lambda: must be in (0, 1), got {self.memdec_router_init_lambda}")

    @property
    def trains_drafter(self) -> bool:
        return self.kind == "dspark" or self.train_drafter
