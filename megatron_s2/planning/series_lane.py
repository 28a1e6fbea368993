"""What the time-series forecasting phase adds to a rank's model state (Intern-S2 report §2.2.1
encoder, §2.2.2 forecasting branch; megatron_s2/training/forecast_trainer.py).

The family model counts its series encoder (``timeseries.*``) on the first pipeline stage, beside
the embedding, where ``build_model`` puts it. ``phase.kind: timeseries_forecast`` adds, on the
last stage:

* the **forecaster** (:class:`~megatron_s2.models.timeseries.forecaster.ForecastBranch`, the
  model's ``forecaster`` submodule): trained like any parameter of the model — gradients,
  optimiser state under the recipe's rule table, ZeRO-1 ownership — so its parameters join the
  rank's (:func:`forecast_branch_parameters`);
* under pipeline parallelism, the **encoder replica** the last stage encodes with
  (:mod:`megatron_s2.models.timeseries.replica`): parameters and, from the series backward until
  they are summed into the owner's, gradients; no optimiser state (:func:`encoder_replica_parameters`).

Both are built here from the real module code on the meta device (no memory), so the counts are
the runtime's (tests/timeseries/test_series_plan.py compares them with the built modules).
"""

from __future__ import annotations

import torch

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.models.family.skeleton import SkeletonMode

__all__ = ["forecast_branch_parameters", "encoder_replica_parameters"]


def _named(module: torch.nn.Module | None, prefix: str) -> dict[str, torch.Tensor]:
    return {} if module is None else {f"{prefix}{n}": p for n, p in module.named_parameters()}


def forecast_branch_parameters(cfg: ModelSchema) -> dict[str, torch.Tensor]:
    """The last stage's ``forecaster.*`` parameters (meta tensors), as the forecast trainer builds them."""
    from megatron_s2.models.timeseries.forecaster import ForecastBranch

    with SkeletonMode():
        return _named(ForecastBranch(cfg.timeseries, cfg.hidden_size), "forecaster.")


def encoder_replica_parameters(cfg: ModelSchema) -> dict[str, torch.Tensor]:
    """The last stage's replica of the series encoder (meta tensors), as SeriesEncoderStages builds it."""
    from megatron_s2.models.timeseries.attach import build_series_encoder

    with SkeletonMode():
        return _named(build_series_encoder(cfg), "timeseries replica.")
