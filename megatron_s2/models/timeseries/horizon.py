"""The horizon predictor (Intern-S2 report §2.2.2; walkthrough Ch. 1 "Why a separate horizon
predictor"): the instruction says in English how many values to emit — "forecast the next two
seconds", "predict 96 steps ahead" — and a numerical branch has no end-of-sequence token, so a
small module turns the instruction into an integer before the forecaster runs.

The report's module is learned (99% accurate) and its form unpublished; ours reads the
instruction with a closed grammar: a quantity (digits, or English number words up to the
thousands: "two", "twenty-four", "one hundred and twenty") followed by a unit — steps / samples /
points / values / timesteps (counted as is) or milliseconds / seconds / minutes / hours (times the
sampling rate, which an instruction in time units needs). It is exact on every phrasing
:func:`render_instruction` produces (the data's instructions; ``tests/timeseries/test_forecast.py``)
and refuses, with a ValueError naming the instruction, one it cannot read — never a guess.
No torch: the data side renders instructions with it and the server parses requests with it.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_horizon", "render_instruction", "number_words", "HorizonError", "HorizonRefused"]

_UNITS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
          "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
          "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80,
         "ninety": 90}
_SCALES = {"hundred": 100, "thousand": 1000}
_STEP_UNITS = ("step", "steps", "sample", "samples", "point", "points", "value", "values", "timestep", "timesteps")
_TIME_UNITS = {"millisecond": 1e-3, "milliseconds": 1e-3, "ms": 1e-3, "second": 1.0, "seconds": 1.0, "s": 1.0,
               "minute": 60.0, "minutes": 60.0, "hour": 3600.0, "hours": 3600.0}
_WORD = set(_UNITS) | set(_TENS) | set(_SCALES) | {"and", "a", "an"}
_TOKEN = re.compile(r"[a-z]+|\d+(?:\.\d+)?")


class HorizonError(ValueError):
    """An instruction whose horizon cannot be read (one line, names the instruction)."""


class HorizonRefused(HorizonError):
    """An instruction the parser *did* read (a quantity and a unit) that no predictor may answer:
    time units with no usable sampling rate, a count no number holds, a fraction of a step. A
    checkpoint's learned predictor answers phrasings the parser cannot read, never these."""


def number_words(n: int) -> str:
    """English words of ``0 <= n < 10,000`` ("one hundred and twenty"), the inverse of the parser."""
    if not 0 <= n < 10_000:
        raise ValueError(f"number_words covers 0..9999, got {n}")
    if n < 20:
        return next(k for k, v in _UNITS.items() if v == n)
    if n < 100:
        tens = next(k for k, v in _TENS.items() if v == n - n % 10)
        return tens if n % 10 == 0 else f"{tens}-{number_words(n % 10)}"
    if n < 1000:
        head = f"{number_words(n // 100)} hundred"
        return head if n % 100 == 0 else f"{head} and {number_words(n % 100)}"
    head = f"{number_words(n // 1000)} thousand"
    rest = n % 1000
    return head if rest == 0 else f"{head} {'and ' if rest < 100 else ''}{number_words(rest)}"


def _words_value(words: list[str]) -> int | None:
    total, current, seen = 0, 0, False
    for word in words:
        if word in ("and",):
            continue
        if word in ("a", "an"):
            current, seen = max(current, 1), True
        elif word in _UNITS:
            current, seen = current + _UNITS[word], True
        elif word in _TENS:
            current, seen = current + _TENS[word], True
        elif word == "hundred":
            current, seen = max(current, 1) * 100, True
        elif word == "thousand":
            total, current, seen = total + max(current, 1) * 1000, 0, True
    return total + current if seen else None


def parse_horizon(instruction: str, sample_rate: float | None = None) -> int:
    """Steps to forecast that ``instruction`` asks for (the last quantity followed by a unit).

    Time units need ``sample_rate`` (Hz): "the next two seconds" at 4 Hz is 8 steps."""
    tokens = _TOKEN.findall(instruction.lower().replace("-", " "))
    found = None
    for i, token in enumerate(tokens):
        if token not in _STEP_UNITS and token not in _TIME_UNITS:
            continue
        j = i
        while j > 0 and tokens[j - 1] in _WORD:
            j -= 1
        if j > 0 and re.fullmatch(r"\d+(?:\.\d+)?", tokens[j - 1]) and j == i:
            quantity = float(tokens[j - 1])
        else:
            value = _words_value(tokens[j:i])
            if value is None:
                continue
            quantity = float(value)
        found = (quantity, token)
    if found is None:
        raise HorizonError(f"cannot read a horizon in {instruction!r}: say how many steps (\"predict 96 steps "
                           "ahead\") or how long (\"forecast the next two seconds\")")
    quantity, unit = found
    if unit in _STEP_UNITS:
        steps = quantity
    else:
        if not sample_rate or not math.isfinite(sample_rate) or sample_rate <= 0:
            raise HorizonRefused(f"{instruction!r} asks in {unit}, which needs the series' sampling rate; give it "
                               "(sample_rate in Hz) or ask in steps")
        steps = quantity * _TIME_UNITS[unit] * sample_rate
    if not math.isfinite(steps):   # "the next two seconds" at 1e308 Hz, or a 400-digit count
        raise HorizonRefused(f"{instruction!r} asks for more steps than a number holds; ask for fewer steps "
                           "or give the series' real sampling rate")
    if steps < 1 or abs(steps - round(steps)) > 1e-6:
        raise HorizonRefused(f"{instruction!r} asks for {steps:g} steps; a horizon is a whole number of steps >= 1")
    return int(round(steps))


def render_instruction(horizon: int, sample_rate: float | None, style: int) -> str:
    """One of the data's instruction phrasings (``style`` picks it) for ``horizon`` steps; a time
    phrasing only when the horizon is a whole number of seconds at ``sample_rate``."""
    seconds = horizon / sample_rate if sample_rate else None
    whole = seconds is not None and abs(seconds - round(seconds)) < 1e-9 and round(seconds) >= 1
    choices = [f"forecast the next {horizon} steps", f"predict {horizon} steps ahead",
               f"forecast the next {number_words(horizon)} values"]
    if whole:
        n = int(round(seconds))
        choices += [f"forecast the next {number_words(n)} second{'s' if n != 1 else ''}",
                    f"predict the next {n} seconds"]
    return choices[style % len(choices)]
