"""The trainer of ``phase.kind: timeseries_forecast`` (Intern-S2 report §2.2.2; walkthrough Ch. 1
"The forecasting branch, and why it is not text").

Series + instruction / answer documents (``data.kind: timeseries``) in every micro-batch; the
backbone reads the prompt with the series inserted (the encoder's tokens at the placeholder span,
§2.2.1) and learns the text answer, and the forecasting branch — two conditioning Q-Formers and
the causal forecaster (:mod:`megatron_s2.models.timeseries.forecaster`) — learns the series' known
future from the same forward: the loss is ``forecast_lambda_text * L_text + forecast_lambda *
L_forecast`` (:class:`ForecastObjective`). The branch lives beside the family model as its
``forecaster`` submodule, so it is optimised and checkpointed with it.

The step is disaggregated as the vision encoder's is (report §3.1.1; :mod:`megatron_s2.models.timeseries.phase`):
series forward (each micro-batch's series encoded once, cut from the encoder's graph into one leaf
for the embedding and one for the forecaster) -> the LLM forward/backward under its unchanged
parallel schedule -> series backward (the leaves' summed gradient through the encoder). The
schedules call the model through :class:`SeriesForecastForward`, which keeps the backbone's last
hidden state on the forward context for :class:`ForecastObjective`: no second backbone pass.

Layouts: dp, tp, tp + sp and pp (+vpp), parity with one rank in ``tests/timeseries/test_layouts.py``.
The encoder and the forecaster are whole on every rank that runs them, outside any tensor-parallel
plan: replicas whose gradients are identical over tp and summed over dp. Under sequence
parallelism the embedding merges the span rows of its slice and the forecaster reads the gathered
hidden state (:func:`~megatron_s2.models.timeseries.predict.full_final_hidden`). Under pipeline
parallelism the series embeddings are consumed on the first stage and the forecaster lives on the
last, which encodes the series with a replica of the first stage's encoder
(:mod:`megatron_s2.models.timeseries.replica`). Context parallelism (a series span cut between
chunks) and expert parallelism are refused
(:func:`~megatron_s2.training.run_checks.check_series_layout`).
"""

from __future__ import annotations

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family.stage_output import KeepsStageOutput
from megatron_s2.models.init import initialize_parameters
from megatron_s2.models.timeseries.attach import tag_inits
from megatron_s2.models.timeseries.forecaster import ForecastBranch
from megatron_s2.models.timeseries.phase import SeriesPhase
from megatron_s2.models.timeseries.predict import forecast_loss, full_final_hidden, horizon_loss
from megatron_s2.models.timeseries.replica import SeriesEncoderStages
from megatron_s2.parallel.grad_finalize import finalize_model_grads
from megatron_s2.pipeline.losses import global_token_count, micro_batch_objective
from megatron_s2.pipeline.step import StepInputs
from megatron_s2.runtime.device import to_device
from megatron_s2.training.trainer import Trainer

__all__ = ["ForecastTrainer", "ForecastObjective", "SeriesForecastForward", "load_trained_forecaster"]


class SeriesForecastForward(KeepsStageOutput):
    """The family model as the schedules call it: ``model(tokens, ctx, labels=..., series=...)``
    without pipelining, ``embed`` / ``run_layers`` / ``head`` stage by stage with it. Every
    ``run_layers`` call keeps its output on ``ctx.forecast_hidden``: on the last stage that is the
    backbone's last hidden state, which :class:`ForecastObjective` reads."""

    attr = "forecast_hidden"

    def __call__(self, tokens: torch.Tensor, ctx, labels=None, series=None):
        return super().__call__(tokens, ctx, labels, series=series)


class ForecastObjective:
    """A step's ``loss_fn``: per micro-batch, ``lambda_text`` x the answer cross-entropy (its share
    of the global token mean, as without series) + ``lambda_forecast`` x the forecaster's mean
    absolute error on the normalised futures (a per-micro-batch mean counted as
    ``1 / num_micro_global`` of the step, as auxiliary losses are) + ``lambda_horizon`` x the learned
    horizon predictor's cross-entropy (counted the same way; only when the branch has one). Logged
    beside the total: ``loss_text``, ``loss_forecast`` (normalised MAE), ``forecast_mae`` (original
    scale) and, with the predictor, ``loss_horizon_raw`` and ``horizon_acc`` (its micro-batch accuracy)."""

    def __init__(self, global_tokens: torch.Tensor, num_micro_global: int, *, lambda_text: float,
                 lambda_forecast: float, lambda_horizon: float = 0.0, detach_horizon: bool = False):
        self.global_tokens, self.num_micro_global = global_tokens, num_micro_global
        self.lambda_text, self.lambda_forecast, self.lambda_horizon = lambda_text, lambda_forecast, lambda_horizon
        self.detach_horizon = detach_horizon

    def __call__(self, model, logits: torch.Tensor, mb: dict, ctx):
        text_objective, text_summed = micro_batch_objective(model.loss(logits, mb["labels"]), mb["loss_mask"],
                                                            self.global_tokens, None, self.num_micro_global)
        encoded, final = mb["series_forecast"], full_final_hidden(model, ctx.forecast_hidden)
        if encoded.encoding is None:  # a micro-batch without series (cannot happen with data.kind timeseries)
            loss_fc = mae = final.sum() * 0.0
        else:
            loss_fc, mae = forecast_loss(model.forecaster, final, encoded, mb["series_targets"])
        # the branch's own terms (forecast, horizon), each a per-micro-batch mean
        branch_loss = self.lambda_forecast * loss_fc
        if model.forecaster.horizon is not None and encoded.encoding is not None:
            read = final.detach() if self.detach_horizon else final   # phase.horizon_detach
            loss_h, accuracy = horizon_loss(model.forecaster, read, encoded, mb["series_targets"])
            branch_loss = branch_loss + self.lambda_horizon * loss_h
            ctx.aux_metrics["loss_horizon"] = loss_h.detach()  # logged as loss_horizon_raw
            ctx.aux_metrics["horizon_acc"] = accuracy
        objective = self.lambda_text * text_objective + branch_loss / self.num_micro_global
        share = self.global_tokens.squeeze() / self.num_micro_global
        summed = self.lambda_text * text_summed + branch_loss.detach() * share
        ctx.aux_metrics["loss_text"] = text_summed / share
        ctx.aux_metrics["loss_forecast"] = loss_fc.detach()
        ctx.aux_metrics["forecast_mae"] = mae
        return objective, summed


class ForecastTrainer(Trainer):
    fresh_on_load = Trainer.fresh_on_load + ("forecaster.",)  # a text checkpoint starts the branch fresh

    def build_model(self, host):
        """The family model, given the forecasting branch as its ``forecaster`` submodule on the last
        pipeline stage before the optimiser is built (it trains and checkpoints with it), and the
        series encoder of each stage that runs one (:class:`SeriesEncoderStages`)."""
        model, pipeline = super().build_model(host)
        ts = self.recipe.model.timeseries
        first, last = getattr(model, "pre_process", True), getattr(model, "post_process", True)
        if ts is None or not hasattr(model, "final_hidden") or (first and getattr(model, "timeseries", None) is None):
            raise ConfigError(f"phase.kind: timeseries_forecast: model family '{self.recipe.model.family}' has no "
                              "time-series encoder or final_hidden; set model.timeseries on a v41 or intern_s2 model")
        if last:
            branch = tag_inits(ForecastBranch(ts, self.recipe.model.hidden_size))
            initialize_parameters(branch, self.recipe.training.seed, self.recipe.model.init_std)
            model.forecaster = branch.to(self.device)
        self.series = SeriesEncoderStages(model, self.recipe.model, self.groups, first=first, last=last,
                                          device=self.device)
        self.series.refresh()  # the last stage's replica starts as the owner
        return model, pipeline

    def compute_gradients(self, micro_batches: list[dict]):
        """Series forward -> forward/backward through :class:`SeriesForecastForward` (any
        schedule) -> series backward; then the replica's gradient joins the owner's and the
        gradients are reduced."""
        micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        series = SeriesPhase.forward(self.series.encoder, micro_batches, embeds=self.series.first,
                                     forecasts=self.series.last)
        inputs = StepInputs(micro_batches, self.groups, self.num_micro_global, loss_fn=self.step_objective(micro_batches))
        result = self.forward_backward(SeriesForecastForward(self.model), inputs)
        series.backward()
        self.series.sync_grads()
        finalize_model_grads(self.params, self.groups, self.recipe.parallel.grad_bucket_mb, zero1=self.zero1)
        return result

    def apply_gradients(self, loss: float | None = None) -> float:
        grad_norm = super().apply_gradients(loss)
        self.series.refresh()  # the replica follows the updated owner
        return grad_norm

    def restore(self) -> bool:
        restored = super().restore()
        if restored:
            self.series.refresh()  # ... and the loaded one
        return restored

    def step_objective(self, micro_batches: list[dict]):
        phase = self.recipe.phase
        return ForecastObjective(global_token_count(micro_batches, self.groups.dp_cp), self.num_micro_global,
                                 lambda_text=phase.forecast_lambda_text, lambda_forecast=phase.forecast_lambda,
                                 lambda_horizon=phase.horizon_lambda, detach_horizon=phase.horizon_detach)


def load_trained_forecaster(run_dir) -> ForecastTrainer:
    """The trainer of a ``timeseries_forecast`` run directory with its newest checkpoint loaded
    (``.model`` in eval mode, ``.tokenizer``, ``.recipe``, ``.step``): what the forecasting bench
    and ``tools/forecast.py`` answer with. Refuses, in one line, a directory without a checkpoint."""
    from pathlib import Path

    from megatron_s2.config.recipe import load_recipe

    run_dir = Path(run_dir)
    recipe = load_recipe(run_dir / "config.yaml")
    if recipe.phase.kind != "timeseries_forecast":
        raise ConfigError(f"{run_dir}: phase.kind is {recipe.phase.kind}, not timeseries_forecast; give the run "
                          "directory of a forecasting phase")
    trainer = ForecastTrainer(recipe, run_dir, log=lambda *a, **k: None)
    if not trainer.restore():
        raise ConfigError(f"{run_dir}: no checkpoint to load; train it first (megatron-s2 train <recipe>)")
    trainer.model.eval()
    return trainer
