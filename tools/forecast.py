"""Answer one forecasting request with numbers, not text (Intern-S2 report §2.2.2), from a trained
``phase.kind: timeseries_forecast`` run, out of the engine — the request/response that ``megatron-s2
serve``'s ``POST /v1/forecast`` carries through the engine (``megatron_s2/serve/series.py``, walkthrough
§2.2.2), with the same numbers.

    python tools/forecast.py runs/timeseries_forecast_tiny request.json
    echo '{"instruction": "forecast the next two seconds", "sample_rate": 4,
           "series": [[0.1, 0.5, 0.9, ...], [1.0, 0.8, ...]]}' | python tools/forecast.py RUN -

Request (JSON): ``instruction`` (the horizon predictor reads it), ``series`` (a JSON array:
``[steps]`` or ``[channels][steps]``) or ``path`` (a local .csv / .parquet / .npz file, read by
``megatron_s2.data.timeseries.load_series``; only with ``--allow-files``), optional
``sample_rate`` (Hz; needed when the instruction asks in time units), optional ``horizon`` (steps;
overrides the predictor). Response (JSON on stdout): ``{"horizon": H, "horizon_parsed": P,
"forecast": [[...], ...]}`` — one list of H real values per channel, on the series' own scale (the
encoder's retained mu / sigma). H is the checkpoint's learned horizon predictor's when it has one
(``model.timeseries.horizon_predictor``), else the parser's; P is the parser's reading (a
cross-check; null where it cannot read the instruction). A bad request exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


FIELDS = ("model", "instruction", "series", "path", "sample_rate", "horizon")
"""The request's fields (``/v1/forecast``'s: a request file serves both; ``model`` is not read here)."""


def answer(trainer, request: dict, allow_files: bool = False) -> dict:
    """The response to one request (module docstring); ValueError with one line on a bad one."""
    import numpy as np
    import torch

    from megatron_s2.data.timeseries import check_series, load_series
    from megatron_s2.data.timeseries_text import SeriesPlanner, series_prompt
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.horizon import HorizonRefused, parse_horizon
    from megatron_s2.models.timeseries.insertion import SeriesPlacement
    from megatron_s2.models.timeseries.predict import forecast

    if not isinstance(request, dict) or not isinstance(request.get("instruction"), str):
        raise ValueError("request: give a JSON object with an 'instruction' string and 'series' (or 'path')")
    for key in request:   # a misspelt "horizon" was ignored and the predictor's horizon answered (review57)
        if key not in FIELDS:
            raise ValueError(f"request.{key}: unknown field; a request takes {', '.join(FIELDS)}")
    if not request["instruction"].strip():   # as /v1/forecast and generate --prompt ''
        raise ValueError("request.instruction: empty; give the ask, e.g. \"forecast the next two seconds\"")
    rate = request.get("sample_rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not math.isfinite(rate) or rate <= 0):
        raise ValueError(f"request.sample_rate: must be a number of Hz > 0, got {json.dumps(rate)}; "
                         "give it or leave it out and ask in steps")
    if "path" in request:
        if not allow_files:
            raise ValueError("request.path: reading local files needs --allow-files; send the values as 'series'")
        if not isinstance(request["path"], str) or not request["path"]:
            raise ValueError(f"request.path: must be the path of a local .csv / .parquet / .npz file, got "
                             f"{json.dumps(request['path'])}")
        loaded = load_series(request["path"])
        values, rate = loaded.values, rate if rate is not None else loaded.sample_rate
    else:
        values = check_series(request.get("series", []), "request.series")
    learned = trainer.model.forecaster.horizon is not None
    try:
        parsed = parse_horizon(request["instruction"], rate)
    except HorizonRefused as exc:   # read, but no predictor may answer it (no rate, no number holds it)
        if request.get("horizon") is None:
            raise type(exc)(f"request.instruction: {exc}; or give \"horizon\": N") from None
        parsed = None
    except ValueError as exc:
        if not learned and request.get("horizon") is None:   # the parser is all this checkpoint has
            raise type(exc)(f"request.instruction: {exc}; or give \"horizon\": N") from None
        parsed = None
    horizon = request.get("horizon")
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
        raise ValueError(f"request.horizon: must be a whole number of steps >= 1, got {json.dumps(horizon)}")
    if horizon is None and not learned:
        horizon = parsed
    recipe = trainer.recipe
    limit = recipe.model.timeseries.max_horizon
    asked = horizon if horizon is not None else parsed   # a learned predictor never overrides an over-long ask
    if asked is not None and asked > limit:
        raise ValueError(f"request.{'horizon' if horizon is not None else 'instruction'}: asks for {asked} steps, "
                         f"above this model's model.timeseries.max_horizon ({limit})")
    planner = SeriesPlanner.from_model(recipe.model)
    ids, at = series_prompt(trainer.tokenizer, planner, request["instruction"], values.shape[1])
    if len(ids) > recipe.training.seq_length:
        raise ValueError(f"request: the prompt takes {len(ids)} tokens, more than the model's "
                         f"{recipe.training.seq_length}; shorten the instruction")
    tokens = torch.from_numpy(ids)[None].to(trainer.device)
    placement = SeriesPlacement(at, SeriesInput(torch.from_numpy(np.ascontiguousarray(values)), rate))
    # horizon None: the learned predictor decides (its answer is the forecast's length)
    out = forecast(trainer.model, tokens, [[placement]], [[(0, len(ids) - 1)]], [horizon])[0]
    return {"horizon": int(out.shape[-1]), "horizon_parsed": parsed, "forecast": out.float().cpu().tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("request", help="request JSON file, or - for stdin")
    parser.add_argument("--allow-files", action="store_true", help="let a request name a local series file")
    args = parser.parse_args(argv)

    from megatron_s2.config.schema import ConfigError
    from megatron_s2.data.errors import DataError
    from megatron_s2.training.forecast_trainer import load_trained_forecaster

    try:
        text = sys.stdin.read() if args.request == "-" else Path(args.request).read_text()
        request = json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"forecast: cannot read the request ({exc})", file=sys.stderr)
        return 2
    try:
        trainer = load_trained_forecaster(args.run_dir)
        response = answer(trainer, request, args.allow_files)
    except (ConfigError, DataError, ValueError) as exc:
        print(f"forecast: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())
