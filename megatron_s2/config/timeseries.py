"""``model.timeseries``: the time-series lane of a model (Intern-S2 report §2.2.1 encoder, §2.2.2
forecasting branch), for either family. Absent (the default) = a text-only model.

Torch-free, like every recipe section: the encoder and the forecaster are built from it by
:func:`megatron_s2.models.timeseries.attach.build_series_encoder` and
:class:`megatron_s2.models.timeseries.forecaster.ForecastBranch`. The report publishes none of
the sizes; the defaults are CPU-sized and illustrative.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError

__all__ = ["TimeSeriesConfig"]


@dataclass(frozen=True)
class TimeSeriesConfig:
    """The series encoder (its tokens enter the backbone at reserved placeholder spans) and the
    numerical forecasting branch beside the head."""

    token_id: int = -1
    """Placeholder id every series-token position carries in the input ids (overwritten by the
    encoder's tokens); -1: the last vocabulary id (``vocab_size - 1``). The tokenizer must never
    produce it (checked when the data is built)."""
    hidden: int = 64
    """Encoder width D."""
    heads: int = 4
    """Attention heads of the encoder's Q-Former, channel and temporal Transformers (divides ``hidden``)."""
    token_budget: int = 64
    """Most series tokens one series may take in the sequence (B in L = ceil(T / floor(B / Q)))."""
    queries_per_patch: int = 4
    """Q: Q-Former queries per patch."""
    patches_per_chunk: int = 64
    """Stage-1 temporal chunk size in patches."""
    chunk_samples: int = 16_384
    """Cap of a chunk's raw samples."""
    min_patch_length: int = 1
    """Floor of the adaptive patch length L."""
    cnn_kernel: int = 5
    """Kernel of the CNN patch embedder's convolutions (odd)."""
    max_channels: int = 16
    """Largest channel count of a series."""
    channel_layers: int = 1
    """Layers of the channel-wise Transformer (Stage 3)."""
    temporal_layers: int = 2
    """Layers of the temporal Transformer body."""
    # ---- forecasting branch (§2.2.2) ----------------------------------------------------------
    forecast_queries: int = 8
    """Learned queries of each of the two conditioning Q-Formers (LLM context, encoder output):
    the forecaster cross-attends to 2 x this many slots whatever the prompt length."""
    forecast_layers: int = 2
    """Blocks of the causal forecaster (self-attention over values, cross-attention to the slots)."""
    forecast_context: int = 128
    """Last normalised history steps of a channel the causal forecaster reads before its first
    prediction (its prompt in value space)."""
    max_horizon: int = 256
    """Longest horizon the forecaster emits (size of its position table); a longer request is refused."""
    horizon_predictor: bool = False
    """Give the forecasting branch the learned horizon predictor (report §2.2.2; classifies the
    instruction's hidden states and sampling rate over 1..max_horizon, trained with
    ``phase.horizon_lambda``; models/timeseries/horizon_predictor.py). Without it (older runs) the
    horizon is read with the closed-grammar parser (models/timeseries/horizon.py)."""

    def __post_init__(self) -> None:
        where = "model.timeseries"
        for name in ("hidden", "heads", "token_budget", "queries_per_patch", "patches_per_chunk", "chunk_samples",
                     "min_patch_length", "cnn_kernel", "max_channels", "forecast_queries", "forecast_layers",
                     "forecast_context", "max_horizon"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("channel_layers", "temporal_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"{where}.heads: {self.heads} does not divide hidden={self.hidden}")
        if self.cnn_kernel % 2 == 0:
            raise ConfigError(f"{where}.cnn_kernel: must be odd (same-length convolution), got {self.cnn_kernel}")
        if self.token_budget < self.queries_per_patch:
            raise ConfigError(f"{where}.token_budget: {self.token_budget} is below queries_per_patch="
                              f"{self.queries_per_patch}; raise the budget")
        if self.token_id < -1:
            raise ConfigError(f"{where}.token_id: must be a vocabulary id or -1 (the last id), got {self.token_id}")

    def placeholder_id(self, vocab_size: int) -> int:
        """The resolved placeholder id for a model of ``vocab_size`` entries."""
        token = vocab_size - 1 if self.token_id == -1 else self.token_id
        if not 0 <= token < vocab_size:
            raise ConfigError(f"model.timeseries.token_id: {token} is outside the vocabulary (vocab_size "
                              f"{vocab_size}); pick an id below it, or -1 for the last one")
        return token
