"""Series in the server (Intern-S2 report §2.2.1-§2.2.2; walkthrough §2.2.2: "a request with a
series returns numbers, not text"): chat ``time_series`` parts, the ``forecast`` extension and
``POST /v1/forecast``.

**Chat part** (user messages)::

    {"type": "time_series", "time_series": {"values": [[...], [...]], "sample_rate": 4}}
    {"type": "time_series", "time_series": {"path": "/allowed/dir/ecg.csv"}}

``values``: ``[steps]`` or ``[channels][steps]`` numbers; ``path``: a local ``.csv`` / ``.parquet`` /
``.npz`` file (``megatron_s2.data.timeseries.load_series``), read only under
``--allowed-local-media-path`` (as image ``file://`` URLs); ``sample_rate`` in Hz (optional; needed
when a horizon is asked in time units). The part renders as :data:`SERIES_MARKER` where it stands,
so the chat template places it; after rendering each marker becomes the model's series placeholder
id and the engine expands it into the series' span (the encoder's tokens go there).

**Forecast extension** (``extra_body`` of the ``openai`` client): ``"forecast": true`` — each
series' horizon is read from the request's last user text by the horizon predictor — the
checkpoint's learned one (``models/timeseries/horizon_predictor.py``, over the prompt's hidden states
and the sampling rate) when it has one, else the parser (``models/timeseries/horizon.py``: "forecast
the next two seconds" at 4 Hz is 8 steps) — or
``"forecast": {"horizon": H}`` (every series) / ``{"horizons": [H1, ...]}``. The answer gets a
top-level ``"forecast": [{"horizon": H, "values": [[...] per channel]}]``, one entry per series, real
values on the series' own scale from the forecasting branch (no text numerals).

**``POST /v1/forecast``** takes ``tools/forecast.py``'s request — ``{"instruction": "forecast the
next two seconds", "sample_rate": 4, "series": [[...], ...]}`` (or ``"path"``; an optional
``"horizon": N`` overrides the predictor, as in ``tools/forecast.py``) — renders the prompt
exactly as the forecasting phase trained it (``bos [series] instruction sep``) and answers
``{"id", "object": "forecast", "model", "horizon", "horizon_parsed", "forecast": [[...], ...], "usage"}``.
With a learned predictor it decides ``horizon`` (as in the report) and ``horizon_parsed`` is the
parser's reading as a cross-check (null where the parser cannot read the instruction); a client
who wants the parser's can send it as the horizon. A checkpoint without the predictor answers
with the parser (``horizon_parsed`` equals ``horizon``).

Bad series are one-line 400s naming the field: NaN / inf, ragged channels, more than 300,000
steps, more channels than ``model.timeseries.max_channels``, too many series parts, a horizon
beyond ``model.timeseries.max_horizon``, a model without a time-series lane or forecasting branch.
The checks run off the event loop; other clients are served meanwhile.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from megatron_s2.serve.errors import BadRequest

__all__ = ["SERIES_MARKER", "ServedSeries", "encode_with_marker", "forecast_route"]

SERIES_MARKER = "<series>"


def encode_with_marker(encode: Callable[[str], list[int]], text: str, marker: str, token_id: int
                       ) -> tuple[list[int], int]:
    """(ids of ``text`` with each ``marker`` replaced by ``token_id``, markers found): the pieces
    between markers are tokenised on their own, so the id never depends on the tokenizer."""
    pieces = text.split(marker)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            ids.append(token_id)
        if piece:
            ids += encode(piece)
    return ids, len(pieces) - 1


class ServedSeries:
    """What the chat and forecast endpoints need of the engine and the media policy for series."""

    def __init__(self, engine, allowed_local_media_path: str = "", max_series: int = 8):
        """``max_series``: the server's ``--max-images-per-request``, which caps series parts too."""
        self.engine = engine
        self.allowed_local_media_path = allowed_local_media_path or None
        self.max_series = max_series

    @property
    def token_id(self) -> int | None:
        """The series placeholder id; None: the model has no time-series lane."""
        return self.engine.series_token_id

    @property
    def lane(self):
        return getattr(self.engine.model_config, "timeseries", None)

    def refuse_unless_supported(self, param: str) -> None:
        if self.token_id is None:
            raise BadRequest(f"{param}: this model has no time-series lane (model.timeseries is not set); send text "
                             "only", param=param)

    def refuse_too_many(self, count: int, param: str) -> None:
        if count > self.max_series:
            raise BadRequest(f"{param}: {count} time_series parts; this server takes at most {self.max_series} per "
                             "request (--max-images-per-request caps series parts too)", param=param)

    def read(self, spec: Any, param: str, fields: dict[str, str] | None = None):
        """A :class:`SeriesInput` from a part's ``time_series`` object, or a one-line 400 naming
        ``param.values`` / ``.sample_rate`` / ``.path`` (``fields``: other names for them, e.g. the
        top-level fields of ``/v1/forecast``)."""
        import numpy as np
        import torch

        from megatron_s2.data.errors import DataError
        from megatron_s2.data.timeseries import check_series, load_series
        from megatron_s2.models.timeseries.encoder import SeriesInput

        def field(key: str) -> str:
            return (fields or {}).get(key, f"{param}.{key}")

        self.refuse_unless_supported(param)
        if not isinstance(spec, dict) or ("values" in spec) == ("path" in spec):
            raise BadRequest(f"{param}: give an object with 'values' ([steps] or [channels][steps] numbers) or a "
                             "local 'path', and optionally 'sample_rate' (Hz)", param=param)
        rate = spec.get("sample_rate")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not math.isfinite(rate) or rate <= 0):
            raise BadRequest(f"{field('sample_rate')}: must be a positive number of Hz, got {rate!r}",
                             param=field("sample_rate"))
        try:
            if "path" in spec:
                values, rate = self._load(spec["path"], rate, field("path"), load_series)
            else:
                if not isinstance(spec["values"], list):
                    raise DataError(f"{field('values')}: must be a JSON array of numbers")
                values = check_series(spec["values"], field("values"))
        except DataError as exc:
            raise BadRequest(str(exc).replace("before training", "before sending"), param=param) from None
        limit = self.lane.max_channels
        if values.shape[0] > limit:
            raise BadRequest(f"{param}: {values.shape[0]} channels, above this model's model.timeseries.max_channels "
                             f"({limit}); send at most {limit} channels (rows of [channels][steps])", param=param)
        try:   # a subnormal rate (1e-310 Hz) passes the check above; SeriesInput refuses it (review24)
            return SeriesInput(torch.from_numpy(np.ascontiguousarray(values)), None if rate is None else float(rate))
        except ValueError as exc:
            raise BadRequest(f"{field('sample_rate')}: {exc}", param=field("sample_rate")) from None

    def _load(self, path: Any, rate, param: str, load_series):
        if self.allowed_local_media_path is None:
            raise BadRequest(f"{param}: reading local files needs the server's --allowed-local-media-path; send "
                             "the values inline", param=param)
        if not isinstance(path, str) or not path:
            raise BadRequest(f"{param}: must be a file path", param=param)
        root = Path(self.allowed_local_media_path).resolve()
        target = Path(path).resolve()
        if root != target and root not in target.parents:
            raise BadRequest(f"{param}: {path} is outside --allowed-local-media-path ({root})", param=param)
        loaded = load_series(target)
        return loaded.values, rate if rate is not None else loaded.sample_rate

    def prepare(self, prompt: list[int], inputs: list, param: str) -> tuple[list[int], list]:
        """The prompt with every placeholder expanded to its series' span, and the spans."""
        try:
            return self.engine.prepare_series(prompt, inputs)
        except ValueError as exc:
            raise BadRequest(f"{param}: {exc}", param=param) from None

    def check_readable(self, instruction: str, inputs: list, param: str,
                       hint: str = '"forecast": {"horizon": N}') -> None:
        """With a learned predictor: refuse what the parser *reads* and no predictor may answer — time
        units without a sampling rate, a count no number holds, more steps than max_horizon
        (``hint``: how this request gives a horizon instead)."""
        from megatron_s2.models.timeseries.horizon import HorizonError, HorizonRefused, parse_horizon

        for s in inputs:
            try:
                parsed = parse_horizon(instruction, s.sample_rate)
            except HorizonRefused as exc:
                raise BadRequest(f"{param}: {exc}; or give {hint}", param=param) from None
            except HorizonError:
                continue   # a phrasing the parser cannot read: the learned predictor's to answer
            if parsed > self.lane.max_horizon:
                raise BadRequest(f"{param}: asks for {parsed} steps, above this model's model.timeseries.max_horizon "
                                 f"({self.lane.max_horizon}); ask for fewer steps", param=param)

    @property
    def learned(self) -> bool:
        """The served checkpoint has the learned horizon predictor."""
        return getattr(getattr(self.engine.model, "forecaster", None), "horizon", None) is not None

    def horizons(self, asked: Any, instruction: str, inputs: list, param: str = "forecast") -> list | None:
        """The horizon of each series the ``forecast`` field asks for (module docstring; None
        entries: the learned predictor's, decided in the engine); None: no forecast."""
        from megatron_s2.models.timeseries.horizon import parse_horizon

        if asked is None or asked is False:
            return None
        if not inputs:
            raise BadRequest(f"{param}: needs at least one time_series part", param=param)
        if getattr(self.engine.model, "forecaster", None) is None:
            raise BadRequest(f"{param}: this model has no forecasting branch (train it with phase.kind: "
                             "timeseries_forecast)", param=param)
        if asked is True and self.learned:
            out = [None] * len(inputs)   # the learned predictor decides, in the engine
            self.check_readable(instruction, inputs, param)
        elif asked is True:
            try:
                out = [parse_horizon(instruction, s.sample_rate) for s in inputs]
            except ValueError as exc:
                raise BadRequest(f"{param}: {exc}; or give \"forecast\": {{\"horizon\": N}}", param=param) from None
        elif isinstance(asked, dict) and set(asked) <= {"horizon", "horizons"} and len(asked) == 1:
            out = asked.get("horizons", [asked.get("horizon")] * len(inputs))
        else:
            raise BadRequest(f"{param}: must be true, {{\"horizon\": N}} or {{\"horizons\": [N, ...]}}", param=param)
        limit = self.lane.max_horizon
        if (not isinstance(out, list) or len(out) != len(inputs)
                or any(isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= limit
                       for h in out if not (h is None and self.learned))):
            raise BadRequest(f"{param}: one horizon per series, each in 1..{limit} (model.timeseries.max_horizon), "
                             f"got {out!r}", param=param)
        return out


def forecast_entries(values: list, horizons: list) -> list[dict]:
    """The response's ``forecast`` list: one ``{"horizon", "values"}`` per series (the horizon
    answered is the values' length: the learned predictor's where ``horizons`` held None)."""
    return [{"horizon": int(v.shape[-1]), "values": v.tolist()} for v, h in zip(values, horizons)]


def last_user_text(messages: Any) -> str:
    """The text parts of the last user message (where the horizon predictor reads the ask)."""
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _forecast_prompt(state, f) -> tuple[list[int], list, list, int | None]:
    """(prompt with one series placeholder, [SeriesInput], [horizon or None: the learned one's], the
    parser's horizon or None) of a ``/v1/forecast`` body."""
    from megatron_s2.data.timeseries_text import SeriesPlanner, series_prompt
    from megatron_s2.models.timeseries.horizon import parse_horizon

    served = state.series
    served.refuse_unless_supported("series")
    instruction = f.raw("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        f.fail("instruction", "required: the ask the horizon predictor reads, e.g. \"forecast the next two seconds\"")
    spec = {key: f.raw(key) for key in ("series", "path", "sample_rate") if f.raw(key) is not None}
    if "series" in spec:
        spec["values"] = spec.pop("series")
    # the request's own top-level names in errors (not the chat part's series.values / .sample_rate)
    series = served.read(spec, "series" if "values" in spec else "path",
                         fields={"values": "series", "sample_rate": "sample_rate", "path": "path"})
    explicit = f.raw("horizon")
    try:
        parsed = parse_horizon(instruction, series.sample_rate)
    except ValueError as exc:
        if not served.learned and explicit is None:
            raise BadRequest(f"instruction: {exc}; or give \"horizon\": N", param="instruction") from None
        parsed = None   # the learned predictor (or the explicit horizon) still answers; the cross-check is null
    if explicit is not None:   # as tools/forecast.py: an explicit horizon overrides the predictor
        horizons = served.horizons({"horizon": explicit}, instruction, [series], "horizon")
    elif served.learned:
        served.check_readable(instruction, [series], "instruction", hint='"horizon": N')
        horizons = served.horizons(True, instruction, [series], "instruction")
    else:
        horizons = served.horizons({"horizon": parsed}, instruction, [series], "instruction")
    planner = SeriesPlanner.from_model(state.backend.engine.model_config)
    ids, at = series_prompt(state.tokenizer, planner, instruction, series.values.shape[1])
    span = planner.span_length(series.values.shape[1])
    # one placeholder where the span goes: the engine expands it by the model's own plan
    prompt = [int(t) for t in ids[:at]] + [served.token_id] + [int(t) for t in ids[at + span:]]
    return prompt, [series], horizons, parsed


async def forecast_route(state, request):
    """``POST /v1/forecast`` (module docstring)."""
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    from megatron_s2.inference.sampling import SamplingParams
    from megatron_s2.serve.backend import ClientDisconnected, Generation
    from megatron_s2.serve.fields import Fields, read_json_object
    from megatron_s2.serve.responses import collect
    from megatron_s2.serve.state import new_id

    f = Fields(await read_json_object(request, state.config.max_body_bytes))
    state.check_model(f)
    f.only({"model", "instruction", "series", "path", "sample_rate", "horizon"})
    prompt, inputs, horizons, parsed = await run_in_threadpool(_forecast_prompt, state, f)
    prompt, spans = await run_in_threadpool(state.series.prepare, prompt, inputs, "series")
    rid = new_id("fcst")
    gen = Generation(state.backend, rid, request, state.config.disconnect_poll_s)
    # the numbers come from the prompt's forward; one greedy token is the least the engine generates
    gen.add(0, prompt, SamplingParams(max_tokens=1, temperature=0), series=spans, forecast=horizons)
    try:
        done = await collect(gen, [0], [prompt], 1)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    result = done[0]
    if result.forecast is None:
        raise BadRequest(f"series: the engine returned no forecast ({result.error or result.finish_reason})")
    return JSONResponse({"id": rid, "object": "forecast", "created": int(time.time()), "model": state.model_name,
                         "horizon": int(result.forecast[0].shape[-1]), "horizon_parsed": parsed,
                         "forecast": result.forecast[0].tolist(),
                         "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0,
                                   "total_tokens": len(prompt)}})
