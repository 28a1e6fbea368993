"""Small value checks shared by the post-training config dataclasses (messages name field and fix)."""

from __future__ import annotations

import math

from megatron_s2.config.schema import ConfigError

__all__ = ["finite", "in_range", "positive", "at_least"]


def finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{name}: must be a finite number, got {value}")


def positive(name: str, value: float) -> None:
    finite(name, value)
    if value <= 0:
        raise ConfigError(f"{name}: must be > 0, got {value}")


def at_least(name: str, value: float, low: float) -> None:
    finite(name, value)
    if value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value}")


def in_range(name: str, value: float, low: float, high: float, *, hint: str = "") -> None:
    finite(name, value)
    if not low <= value <= high:
        raise ConfigError(f"{name}: must lie in [{low}, {high}], got {value}{'; ' + hint if hint else ''}")
