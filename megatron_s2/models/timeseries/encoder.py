"""The time-series encoder (Intern-S2 report §2.2.1; walkthrough Ch. 1 "The encoder forward pass").

One series ``x`` of ``C`` channels and ``T`` steps (T up to 300,000) becomes ``Q * ceil(T / L)``
tokens of the backbone width, plus the statistics the forecaster needs to emit real values:

1. instance normalisation per channel; ``mu`` and ``sigma`` are **retained** (``forecast(...)
   * sigma + mu`` puts values back on the original scale: :func:`denormalise`);
2. Stage 1, temporal chunking: whole patches at a time (``patching.plan_patching``) so the
   activations of steps 3-4 are bounded by one chunk;
3. Stage 2, compressive patching: a CNN over raw samples (local morphology), cut into patches of
   the *adaptive* length ``L``, and a Q-Former per patch - ``Q`` learned queries cross-attend over
   the patch's embedded samples (a within-patch position feature keeps their order);
4. Stage 3, the channel-wise Transformer: per token position, attention across the channel axis
   (with a channel-index embedding: montage order is the signal - walkthrough Worked example 2),
   then a learned-query attention pool merges channels where S1-Pro took ``mean()``;
5. the temporal Transformer body over the series tokens, and a projection to the backbone width.

Variable length, sampling frequency and channel count in one batch: every series is planned,
normalised, chunked, patched and Q-Former-compressed on its own (its own ``L``), conditioned on
``log10`` of its sampling rate and of its patch duration ``L / rate``; the per-series token grids
``[C_i, N_i, D]`` are then zero-padded to ``[B, C_max, N_max, D]`` with a channel mask (padded
channels are keys nobody attends to and are left out of the pool) and a token mask (padded tokens
are masked in the temporal body and returned in :attr:`TimeSeriesEncoding.token_mask`).

Cost: steps 1-3 are linear in ``T`` (a fixed CNN per sample, ``Q`` queries over ``L`` samples per
patch); steps 4-5 act on at most ``token_budget / Q`` positions whatever ``T`` is. ``bench/
timeseries_encoder.py`` measures it. Family-neutral: a family inserts :attr:`tokens` at its
series-token positions like image embeddings.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.timeseries.patching import PatchPlan, plan_patching

__all__ = ["TimeSeriesEncoderConfig", "SeriesInput", "TimeSeriesEncoding", "TimeSeriesEncoder",
           "normalise", "denormalise"]

POSITION_FREQUENCIES = 4
"""Sine/cosine pairs of the within-patch position feature."""


@dataclass(frozen=True)
class TimeSeriesEncoderConfig:
    """Shape of the encoder; the report publishes none of these constants (all illustrative)."""

    output_hidden: int
    """Backbone width the tokens are projected to (D_llm)."""
    hidden: int = 64
    """Encoder width D."""
    heads: int = 4
    """Attention heads in the Q-Former, channel and temporal Transformers; must divide ``hidden``."""
    token_budget: int = 1024
    """Most series tokens one series may produce (B in L = ceil(T / floor(B / Q)))."""
    queries_per_patch: int = 4
    """Q: Q-Former queries per patch."""
    patches_per_chunk: int = 64
    """Stage-1 chunk size in patches: bounds the CNN / Q-Former activations."""
    chunk_samples: int = 16_384
    """Cap of a chunk's raw samples (fewer patches per chunk as L grows): a chunk's activations
    stay the same size whatever T is."""
    min_patch_length: int = 1
    """Floor of L for very short series."""
    cnn_kernel: int = 5
    """Kernel of the two 1-D convolutions of the patch embedder (odd)."""
    max_channels: int = 64
    """Largest channel count (size of the channel-index embedding)."""
    channel_layers: int = 1
    """Layers of the channel-wise Transformer."""
    temporal_layers: int = 2
    """Layers of the temporal Transformer body."""
    eps: float = 1e-6
    """Added to sigma in the normalisation (a constant channel stays finite)."""

    def __post_init__(self):
        for name in ("output_hidden", "hidden", "heads", "token_budget", "queries_per_patch",
                     "patches_per_chunk", "chunk_samples", "min_patch_length", "cnn_kernel", "max_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"timeseries.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"timeseries.heads ({self.heads}) must divide timeseries.hidden ({self.hidden})")
        if self.cnn_kernel % 2 == 0:
            raise ValueError(f"timeseries.cnn_kernel must be odd (same-length convolution), got {self.cnn_kernel}")
        if self.token_budget < self.queries_per_patch:
            raise ValueError(f"timeseries.token_budget ({self.token_budget}) is below queries_per_patch "
                             f"({self.queries_per_patch}): raise the budget")


@dataclass(frozen=True)
class SeriesInput:
    """One series: ``values`` [C, T]; ``sample_rate`` in Hz (None: unknown, conditioned as 1 Hz)."""

    values: torch.Tensor
    sample_rate: Optional[float] = None

    def __post_init__(self):
        if self.sample_rate is not None and not (math.isfinite(self.sample_rate) and self.sample_rate > 0):
            raise ValueError(f"sample_rate must be a positive number of Hz (or None when unknown), "
                             f"got {self.sample_rate!r}")
        if self.sample_rate is not None and self.sample_rate < sys.float_info.min:
            # a subnormal rate: the patch duration L / rate is inf and the forecast NaN (review24)
            raise ValueError(f"sample_rate {self.sample_rate!r} Hz is below {sys.float_info.min:.3g}, where the "
                             f"patch duration (patch length / rate) is infinite; give the series' real rate")


@dataclass
class TimeSeriesEncoding:
    """What the encoder hands the backbone and the forecaster."""

    tokens: torch.Tensor
    """[B, N_max, output_hidden]; rows past ``token_mask`` are padding."""
    token_mask: torch.Tensor
    """[B, N_max] bool, True at real tokens (series ``i`` has ``plans[i].num_tokens``)."""
    mu: list
    """Per series [C_i, 1]: the retained channel means."""
    sigma: list
    """Per series [C_i, 1]: the retained channel standard deviations."""
    plans: list
    """Per series :class:`PatchPlan`."""


def normalise(x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Instance normalisation over time: (x - mu) / (sigma + eps), and (mu, sigma) kept."""
    mu = x.mean(dim=-1, keepdim=True)
    sigma = x.std(dim=-1, keepdim=True, unbiased=False)
    return (x - mu) / (sigma + eps), mu, sigma


def denormalise(xn: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The inverse of :func:`normalise`: where the forecaster's values regain their scale."""
    return xn * (sigma + eps) + mu


def _sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Standard sinusoidal embedding [n, dim] of integer positions."""
    half = dim // 2
    freq = torch.exp(-math.log(10_000.0) * torch.arange(half, device=positions.device) / max(half, 1))
    angle = positions.float()[:, None] * freq[None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)[:, :dim]


class Attention(nn.Module):
    """Multi-head attention of ``query`` over ``context``; ``key_mask`` [b, k] True = attend."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, query, context, key_mask=None):
        b, nq, d = query.shape
        q = self.q(query).view(b, nq, self.heads, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, context.size(1), 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, nq, d))


class Block(nn.Module):
    """Pre-norm block: self-attention (or, with ``cross``, attention over a context) then MLP."""

    def __init__(self, hidden: int, heads: int, cross: bool = False):
        super().__init__()
        self.norm_q, self.norm_mlp = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.norm_kv = nn.LayerNorm(hidden) if cross else None   # the context has its own statistics
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, context=None, key_mask=None):
        query = self.norm_q(x)
        kv = query if self.norm_kv is None else self.norm_kv(context)
        x = x + self.attn(query, kv, key_mask)
        return x + self.mlp(self.norm_mlp(x))


class PatchEmbedder(nn.Module):
    """The CNN patch embedder: two same-length 1-D convolutions over one channel's raw samples."""

    def __init__(self, hidden: int, kernel: int):
        super().__init__()
        self.conv_in = nn.Conv1d(1, hidden, kernel, padding=kernel // 2)
        self.conv_out = nn.Conv1d(hidden, hidden, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[C, t] -> [C, t, D]."""
        return self.conv_out(F.gelu(self.conv_in(x[:, None, :]))).transpose(1, 2)


class QFormer(nn.Module):
    """Q learned queries cross-attend over one patch's embedded samples: any L in, Q out."""

    def __init__(self, hidden: int, heads: int, queries: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(queries, hidden) * hidden ** -0.5)
        self.position = nn.Linear(2 * POSITION_FREQUENCIES, hidden)
        self.block = Block(hidden, heads, cross=True)

    def forward(self, samples: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
        """samples [P, L, D] (P patches), sample_mask [P, L] -> [P, Q, D]."""
        length = samples.size(1)
        # within-patch order as a fraction of the patch: the same feature for any L
        where = (torch.arange(length, device=samples.device) + 0.5) / length
        angle = 2 * math.pi * where[:, None] * torch.arange(1, POSITION_FREQUENCIES + 1, device=samples.device)
        samples = samples + self.position(torch.cat([angle.sin(), angle.cos()], dim=-1))
        queries = self.queries.expand(samples.size(0), -1, -1)
        return self.block(queries, samples, sample_mask)


class TimeSeriesEncoder(nn.Module):
    """Series in, backbone-width tokens and retained (mu, sigma) out (see the module docstring)."""

    PLAN_SECTION = "timeseries"
    """A section of its own: a family's parallel plan skips it; its parameters stay unmarked (whole,
    replicated, identical over tp, reduced over data parallelism; :mod:`.attach`)."""

    def __init__(self, cfg: TimeSeriesEncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.embedder = PatchEmbedder(d, cfg.cnn_kernel)
        self.qformer = QFormer(d, cfg.heads, cfg.queries_per_patch)
        # log10(rate) and log10(patch duration): the same samples mean different things at 1 Hz and 1 MHz
        self.rate = nn.Linear(2, d)
        self.channel_index = nn.Embedding(cfg.max_channels, d)
        self.channel_blocks = nn.ModuleList(Block(d, cfg.heads) for _ in range(cfg.channel_layers))
        self.channel_pool = Block(d, cfg.heads, cross=True)
        self.channel_query = nn.Parameter(torch.randn(1, 1, d) * d ** -0.5)
        self.temporal_blocks = nn.ModuleList(Block(d, cfg.heads) for _ in range(cfg.temporal_layers))
        self.norm = nn.LayerNorm(d)
        self.to_backbone = nn.Linear(d, cfg.output_hidden)

    def plan(self, length: int) -> PatchPlan:
        cfg = self.cfg
        return plan_patching(length, cfg.token_budget, cfg.queries_per_patch,
                             patches_per_chunk=cfg.patches_per_chunk, min_patch_length=cfg.min_patch_length,
                             max_chunk_samples=cfg.chunk_samples)

    def patch_tokens(self, series: SeriesInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PatchPlan]:
        """Steps 1-3 for one series: [C, N_tok, D] tokens, mu, sigma and its plan."""
        x = series.values
        if x.dim() != 2:
            raise ValueError(f"a series is [channels, steps], got shape {tuple(x.shape)}")
        channels, length = x.shape
        if channels > self.cfg.max_channels:
            raise ValueError(f"series has {channels} channels, above timeseries.max_channels "
                             f"({self.cfg.max_channels}): raise it")
        xn, mu, sigma = normalise(x.to(self.rate.weight.dtype), self.cfg.eps)
        plan = self.plan(length)
        xn = F.pad(xn, (0, plan.padded_length - length))   # the last patch is zero-padded ...
        valid = torch.arange(plan.padded_length, device=x.device) < length   # ... and masked
        per_chunk = []
        for start in range(0, plan.padded_length, plan.chunk_length):
            chunk = xn[:, start:start + plan.chunk_length]
            patches = chunk.size(1) // plan.patch_length
            samples = self.embedder(chunk).reshape(channels * patches, plan.patch_length, -1)
            mask = valid[start:start + plan.chunk_length].view(1, patches, plan.patch_length)
            mask = mask.expand(channels, -1, -1).reshape(channels * patches, plan.patch_length)
            per_chunk.append(self.qformer(samples, mask).view(channels, patches * plan.queries_per_patch, -1))
        tokens = torch.cat(per_chunk, dim=1)
        rate = series.sample_rate or 1.0
        condition = torch.tensor([math.log10(rate), math.log10(plan.patch_length / rate)],
                                 dtype=tokens.dtype, device=tokens.device)
        patch_index = torch.arange(plan.num_tokens, device=tokens.device) // plan.queries_per_patch
        tokens = tokens + self.rate(condition) + _sinusoid(patch_index, tokens.size(-1)).to(tokens.dtype)
        return tokens, mu, sigma, plan

    def channel_path(self, z: torch.Tensor, channel_mask: torch.Tensor) -> torch.Tensor:
        """Stage 3: [B, C, N, D] -> [B, N, D]; attention across channels, then a learned-query pool.

        Where S1-Pro took ``z.mean(1)``; Worked example 2 is the test (tests/timeseries)."""
        b, c, n, d = z.shape
        z = z + self.channel_index.weight[:c][None, :, None, :]
        rows = z.transpose(1, 2).reshape(b * n, c, d)          # one row per (series, token position)
        mask = channel_mask[:, None, :].expand(b, n, c).reshape(b * n, c)
        for block in self.channel_blocks:
            rows = block(rows, key_mask=mask)
        pooled = self.channel_pool(self.channel_query.expand(b * n, -1, -1), rows, mask)
        return pooled.view(b, n, d)

    def forward(self, batch: Sequence[SeriesInput]) -> TimeSeriesEncoding:
        grids, mus, sigmas, plans = zip(*(self.patch_tokens(s) for s in batch))
        c_max = max(g.size(0) for g in grids)
        n_max = max(g.size(1) for g in grids)
        z = torch.stack([F.pad(g, (0, 0, 0, n_max - g.size(1), 0, c_max - g.size(0))) for g in grids])
        device = z.device
        channel_mask = torch.stack([torch.arange(c_max, device=device) < g.size(0) for g in grids])
        token_mask = torch.stack([torch.arange(n_max, device=device) < g.size(1) for g in grids])
        h = self.channel_path(z, channel_mask)
        for block in self.temporal_blocks:
            h = block(h, key_mask=token_mask)
        tokens = self.to_backbone(self.norm(h))
        return TimeSeriesEncoding(tokens=tokens, token_mask=token_mask, mu=list(mus), sigma=list(sigmas),
                                  plans=list(plans))
