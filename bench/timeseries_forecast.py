"""Forecasting on held-out procedural series: MASE of the trained forecasting branch against the
naive and seasonal-naive baselines (Intern-S2 report §2.2.2; walkthrough Table 5 style: the error,
with the success rate in brackets).

    megatron-s2 train recipes/timeseries_forecast_tiny.yaml          # ~3 min on 2 CPU cores
    python bench/timeseries_forecast.py runs/timeseries_forecast_tiny [--items 200]
    python bench/timeseries_forecast.py --smoke      # trains the recipe 4 steps in a temp dir, 8 items

The run's newest checkpoint is loaded into its own model (config.yaml of the run directory); the
held-out series come from the generator's held-out seed (``data.split: heldout``: no training
item), with the run's lengths, channels, horizons, rates and noise. For every item the prompt
(bos, series span, instruction, sep) goes through the backbone; the parser reads the instruction
(its accuracy is printed) and the branch emits that many de-normalised values per channel (the
MASE table). With a learned horizon predictor in the checkpoint its held-out accuracy is printed
too, and a row "forecaster, learned horizon" scores the forecasts whose length it decided (a wrong
horizon is a failure: the success rate in brackets is its accuracy). MASE divides each forecast's
mean absolute error by the mean absolute one-step change of
the history (per channel), then averages over (item, channel). Baselines: naive (the last value
repeated), seasonal naive with the generator's true period (an oracle period: a strong
baseline) and seasonal naive at the lag the forecaster itself estimates from the history's
autocorrelation (``forecaster.seasonal_lag``: what the model's seasonal candidate alone would score,
so the table shows what the learned part adds). A forecast is a success when it has the asked length and finite values.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np


def mase(forecast: np.ndarray, future: np.ndarray, history: np.ndarray) -> np.ndarray:
    """Per-channel MASE [C] (scale: mean |x_t - x_{t-1}| of the history)."""
    scale = np.abs(np.diff(history, axis=1)).mean(axis=1)
    return np.abs(forecast - future).mean(axis=1) / np.maximum(scale, 1e-8)


def naive(history: np.ndarray, horizon: int) -> np.ndarray:
    return np.repeat(history[:, -1:], horizon, axis=1)


def seasonal_naive(history: np.ndarray, horizon: int, period: int) -> np.ndarray:
    steps = history.shape[1]
    period = min(period, steps)
    index = steps - period + (np.arange(horizon) % period)
    return history[:, index]


def acf_naive(history: np.ndarray, horizon: int, seasonal_lag) -> np.ndarray:
    """Seasonal naive per channel at the forecaster's own lag estimate (no oracle period)."""
    import torch

    x = torch.from_numpy(history).float()
    x = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)
    lags = seasonal_lag(x, torch.ones_like(x, dtype=torch.bool))
    return np.stack([seasonal_naive(history[c:c + 1], horizon, int(lag))[0] for c, lag in enumerate(lags)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("--items", type=int, default=200, help="held-out series")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--smoke", action="store_true",
                        help="train recipes/timeseries_forecast_tiny.yaml 4 steps in a temporary run directory, "
                             "then score 8 held-out items (the suite's check that the script runs)")
    args = parser.parse_args(argv)
    if args.smoke:
        return _smoke(args)
    if args.run_dir is None:
        parser.error("give the run directory of a timeseries_forecast run (or --smoke)")

    import torch

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.timeseries_text import SeriesPlanner, build_series_documents
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.forecaster import seasonal_lag
    from megatron_s2.models.timeseries.horizon import parse_horizon
    from megatron_s2.models.timeseries.insertion import SeriesPlacement
    from megatron_s2.models.timeseries.predict import forecast
    from megatron_s2.training.forecast_trainer import ForecastTrainer

    torch.set_num_threads(1)
    recipe = load_recipe(args.run_dir / "config.yaml")
    trainer = ForecastTrainer(recipe, args.run_dir, log=lambda *a, **k: None)
    if not trainer.restore():
        print(f"{args.run_dir}: no checkpoint to evaluate; train it first", file=sys.stderr)
        return 2
    model = trainer.model.eval()
    data = dataclasses.replace(recipe.data, split="heldout", num_documents=args.items)
    docs = build_series_documents(data, seed=recipe.training.seed, tokenizer=trainer.tokenizer,
                                  planner=SeriesPlanner.from_model(recipe.model), seq_length=recipe.training.seq_length)
    scores = {"forecaster": [], "naive": [], "seasonal naive (true period)": [], "seasonal naive (acf lag)": []}
    successes, horizon_right, wins = 0, 0, []
    learned = model.forecaster.horizon is not None   # the checkpoint's learned horizon predictor
    learned_right, learned_scores = 0, []
    for first in range(0, len(docs), args.batch):
        batch = range(first, min(first + args.batch, len(docs)))
        prompts, placements, spans, horizons, items = [], [], [], [], []
        for d in batch:
            span = docs.series_of(d)[0]
            item = docs.items[span.item]
            prompts.append(docs.tokens(d)[:span.prompt_end + 1])
            placements.append([SeriesPlacement(span.offset, SeriesInput(torch.from_numpy(item.values),
                                                                        item.sample_rate))])
            spans.append([(0, span.prompt_end)])
            horizon = parse_horizon(item.instruction, item.sample_rate)   # the parser (the data's grammar)
            horizon_right += horizon == item.horizon
            horizons.append(horizon)
            items.append(item)
        width = max(len(p) for p in prompts)   # right padding: causal, the prompts never see it
        tokens = torch.full((len(prompts), width), trainer.tokenizer.pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.from_numpy(prompt)
        outputs = forecast(model, tokens.to(trainer.device), placements, spans, horizons)
        if learned:   # the learned predictor decides the length; a wrong one is a failed forecast
            for item, out in zip(items, forecast(model, tokens.to(trainer.device), placements, spans,
                                                 [None] * len(items))):
                if out.shape[-1] == item.horizon:
                    learned_right += 1
                    learned_scores.append(mase(out.float().cpu().numpy(), item.future, item.values))
        for item, horizon, out in zip(items, horizons, outputs):
            values = out.float().cpu().numpy()
            ok = values.shape == item.future.shape and np.isfinite(values).all()
            successes += ok
            if not ok:
                continue
            ours = mase(values, item.future, item.values)
            seasonal = mase(seasonal_naive(item.values, horizon, item.period), item.future, item.values)
            scores["forecaster"].append(ours)
            scores["naive"].append(mase(naive(item.values, horizon), item.future, item.values))
            scores["seasonal naive (true period)"].append(seasonal)
            scores["seasonal naive (acf lag)"].append(mase(acf_naive(item.values, horizon, seasonal_lag),
                                                           item.future, item.values))
            wins.append(ours < seasonal)
    n = len(docs)
    print(f"held-out procedural series: {n} items, {recipe.data.series_channels} channels, history "
          f"{recipe.data.series_length // 2}-{recipe.data.series_length} steps, horizon <= {recipe.data.series_horizon}, "
          f"noise {recipe.data.series_noise}; run {args.run_dir} step {trainer.step}")
    print(f"horizon parser: {horizon_right}/{n} instructions read exactly")
    if learned:
        print(f"learned horizon predictor: {learned_right}/{n} held-out horizons exact "
              f"({100.0 * learned_right / n:.1f}%)")
    else:
        print("learned horizon predictor: none in this checkpoint (model.timeseries.horizon_predictor)")
    print(f"{'method':<30} {'MASE mean':>10} {'MASE median':>12} {'vs naive':>9}  (success rate)")
    naive_mean = float(np.concatenate(scores["naive"]).mean())
    for name, values in scores.items():
        flat = np.concatenate(values)
        rate = 100.0 * successes / n if name == "forecaster" else 100.0
        print(f"{name:<30} {flat.mean():>10.3f} {np.median(flat):>12.3f} {flat.mean() / naive_mean:>9.3f}  ({rate:.1f})")
    if learned and learned_scores:
        flat = np.concatenate(learned_scores)
        print(f"{'forecaster, learned horizon':<30} {flat.mean():>10.3f} {np.median(flat):>12.3f} "
              f"{flat.mean() / naive_mean:>9.3f}  ({100.0 * learned_right / n:.1f})")
    win = np.concatenate(wins)
    print(f"forecaster beats seasonal naive on {100.0 * win.mean():.1f}% of (item, channel) pairs")
    return 0


def _smoke(args) -> int:
    import tempfile

    import torch

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.training.forecast_trainer import ForecastTrainer

    torch.set_num_threads(1)
    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "timeseries_forecast_tiny.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        recipe = load_recipe(recipe_path, [f"training.run_dir={run_dir}", "training.train_steps=4", "data.num_documents=16",
                                           "schedule.warmup_steps=1", "schedule.decay_start_step=3", "schedule.decay_end_step=4",
                                           "checkpoint.save_interval=4"])
        ForecastTrainer(recipe, run_dir, log=lambda *a, **k: None).train()
        return main([str(run_dir), "--items", "8", "--batch", "8"])


if __name__ == "__main__":
    sys.exit(main())
