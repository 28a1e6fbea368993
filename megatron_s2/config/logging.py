"""Logging section of a recipe (``logging:``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError

__all__ = ["LoggingConfig"]


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 1
    """Print a log line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tensorboard."""
    progress_bar: bool = True
    """Show a progress bar on an interactive terminal (rank 0)."""
    device_peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 = look the GPU up in the built-in table."""

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ConfigError("logging.log_interval: must be >= 1")
        if self.device_peak_tflops < 0:
            raise ConfigError("logging.device_peak_tflops: must be >= 0")
