"""``megatron-s2 generate RUN --series SERIES --prompt INSTRUCTION``: numbers for a series, not text
(Intern-S2 report §2.2.2; walkthrough: "a request with a series returns numbers, not text").

``SERIES`` is a JSON array (``[steps]`` or ``[channels][steps]``) or a local ``.csv`` / ``.parquet``
/ ``.npz`` file (:func:`megatron_s2.data.timeseries.load_series`; the terminal's own files, so no
allow-list). ``--prompt`` is the instruction the horizon predictor reads ("forecast the next two
seconds" with ``--sample-rate 4`` is 8 steps; "predict 12 steps ahead"), or ``--horizon N`` sets it
(with no ``--prompt`` the instruction is the data's own phrasing, "predict N steps ahead"):
the checkpoint's learned predictor decides when it has one (``horizon_parsed`` in the output is the
parser's reading, a cross-check, null where it cannot read the prompt), the parser otherwise.
The prompt is rendered as the forecasting phase trained it (``bos [series] instruction sep``,
as ``POST /v1/forecast`` does), the engine inserts the encoder's tokens and runs the forecasting
branch on the prompt's hidden states, and stdout gets one JSON line ``{"horizon": H, "horizon_parsed", "forecast":
[[H values] per channel]}`` on the series' own scale. A NaN / inf, empty, ragged or enormous series,
an unreadable instruction, a horizon past ``model.timeseries.max_horizon`` or a checkpoint without
the lane or the branch exits with code 2 and one line naming the flag — the series is checked
before the model loads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from megatron_s2.config.schema import ConfigError

__all__ = ["read_series_flag", "forecast_command"]


def read_series_flag(spec: str, rate: float | None):
    """(float32 [channels, steps], Hz or None) of ``--series`` (module docstring), or a one-line ConfigError."""
    from megatron_s2.data.errors import DataError
    from megatron_s2.data.timeseries import check_series, load_series

    if rate is not None and (not math.isfinite(rate) or rate <= 0):
        raise ConfigError(f"--sample-rate: must be a positive number of Hz, got {rate}")
    if rate is not None and rate < sys.float_info.min:   # subnormal: the encoder's L / rate is inf
        raise ConfigError(f"--sample-rate: {rate} Hz is below {sys.float_info.min:.3g}; give the series' real rate")
    try:
        if spec.lstrip().startswith("["):
            try:
                values = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--series: not a JSON array ({exc.msg} at character {exc.pos}); give "
                                  "[steps], [[channel 0 steps], [channel 1 steps]] or a .csv/.parquet/.npz path") from None
            return check_series(values, "--series"), rate
        loaded = load_series(spec)
        return loaded.values, rate if rate is not None else loaded.sample_rate
    except DataError as exc:
        message = str(exc).replace(" before training", "")
        raise ConfigError(message if message.startswith("--series") else f"--series: {message}") from None


def forecast_command(args: argparse.Namespace) -> int:
    """The ``--series`` path of ``generate`` (module docstring)."""
    import numpy as np
    import torch

    from megatron_s2.data.timeseries_text import SeriesPlanner, series_prompt
    from megatron_s2.inference import EngineConfig, EngineDriver, InferenceEngine, SamplingParams
    from megatron_s2.inference.weights import load_model
    from megatron_s2.models.timeseries.encoder import SeriesInput
    from megatron_s2.models.timeseries.horizon import HorizonRefused, parse_horizon, render_instruction

    # sampling and text flags have no meaning for a forecast: refused when set, never ignored
    for flag, given in (("--image", args.image), ("--memory-decoder", args.memory_decoder),
                        ("--speculative", args.speculative), ("--max-tokens", args.max_tokens != 64),
                        ("--temperature", args.temperature != 1.0), ("--top-p", args.top_p != 1.0),
                        ("--top-k", args.top_k != 0), ("--seed", args.seed is not None), ("--stop", args.stop),
                        ("--no-bos", not args.bos)):
        if given:
            raise ConfigError(f"{flag}: not with --series (a forecast is one prompt forward, no sampling); drop {flag}")
    if args.prompt is None and args.horizon is None:
        raise ConfigError("--prompt: give the instruction the horizon predictor reads, e.g. --prompt 'predict 12 "
                          "steps ahead', or --horizon N")
    if args.prompt is not None and not args.prompt.strip():
        raise ConfigError("--prompt: empty; give the instruction, e.g. --prompt 'predict 12 steps ahead', or drop "
                          "it and give --horizon N")
    values, rate = read_series_flag(args.series, args.sample_rate)
    parsed, unreadable = None, None
    if args.horizon is not None and args.horizon < 1:
        raise ConfigError(f"--horizon: must be >= 1 steps, got {args.horizon}")
    if args.prompt is not None:   # the parser's reading: the horizon, or the cross-check beside --horizon
        try:
            parsed = parse_horizon(args.prompt, rate)
        except HorizonRefused as exc:   # read, but no predictor may answer it (no rate, no number holds it)
            if args.horizon is None:
                raise ConfigError(f"--prompt: {exc}; or give --horizon N") from None
        except ValueError as exc:
            if args.horizon is None:
                unreadable = ConfigError(f"--prompt: {exc}; or give --horizon N")
    model, tokenizer, description = load_model(args.checkpoint, args.device)
    learned = getattr(getattr(model, "forecaster", None), "horizon", None) is not None
    if unreadable is not None and not learned:   # the parser is all this checkpoint has
        raise unreadable
    # --horizon overrides; else the learned predictor decides (None, in the engine), else the parser
    horizon = args.horizon if args.horizon is not None else None if learned else parsed
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=1, max_model_len=args.max_model_len, prefill_chunk=256,
                                                 max_prefill_tokens=256),
                             eos_token_ids=[tokenizer.eos_id], detokenize=tokenizer.decode)
    lane = engine.model_config.timeseries if engine.series_token_id is not None else None
    if lane is None:
        raise ConfigError(f"--series: {args.checkpoint} has no time-series lane (model.timeseries is not set); use a "
                          "phase.kind: timeseries_forecast run")
    if getattr(model, "forecaster", None) is None:
        raise ConfigError(f"--series: {args.checkpoint} has no forecasting branch (train it with phase.kind: "
                          "timeseries_forecast)")
    if horizon is not None and horizon > lane.max_horizon:
        raise ConfigError(f"--horizon: {horizon} steps asked, above this model's model.timeseries.max_horizon "
                          f"({lane.max_horizon}); ask for fewer steps")
    if args.horizon is None and parsed is not None and parsed > lane.max_horizon:  # a learned predictor never overrides it
        raise ConfigError(f"--prompt: asks for {parsed} steps, above this model's model.timeseries.max_horizon "
                          f"({lane.max_horizon}); ask for fewer steps")
    if args.prompt is None:   # the instruction as the forecasting data phrases this horizon (now known to fit)
        try:
            args.prompt = render_instruction(args.horizon, None, style=1)
        except ValueError as exc:
            raise ConfigError(f"--horizon: {exc}; give the instruction with --prompt") from None
    if values.shape[0] > lane.max_channels:
        raise ConfigError(f"--series: {values.shape[0]} channels, above this model's model.timeseries.max_channels "
                          f"({lane.max_channels}); give at most {lane.max_channels} channels")
    planner = SeriesPlanner.from_model(engine.model_config)
    ids, at = series_prompt(tokenizer, planner, args.prompt, values.shape[1])
    span = planner.span_length(values.shape[1])
    # one placeholder where the span goes: the engine expands it by the model's own plan
    prompt = [int(t) for t in ids[:at]] + [engine.series_token_id] + [int(t) for t in ids[at + span:]]
    try:
        series = SeriesInput(torch.from_numpy(np.ascontiguousarray(values)), None if rate is None else float(rate))
        handle = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), series=[series], forecast=[horizon])
    except ValueError as exc:
        raise ConfigError(f"--series: {exc}") from None
    print(f"[{description}]", file=sys.stderr)
    driver, result = EngineDriver(engine), None
    while engine.has_work():
        driver.step()
        while not handle.empty():
            out = handle.get()
            if out.forecast is not None:
                result = out.forecast[0]
    if result is None:
        print("--series: the engine returned no forecast", file=sys.stderr)
        return 1
    # the horizon answered is the forecast's length; the parser's reading rides along as a cross-check
    print(json.dumps({"horizon": int(result.shape[-1]), "horizon_parsed": parsed, "forecast": result.float().tolist()}))
    return 0
