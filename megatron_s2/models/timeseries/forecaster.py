"""The forecasting branch (Intern-S2 report §2.2.2; walkthrough Ch. 1 "The forecaster, written out"):
values out, not numerals.

    horizon = horizon_predictor(instruction_hidden)   # models/timeseries/horizon_predictor.py (learned)
                                                      # or horizon.py's parser (runs without it)
    sem  = qformer_sem(llm_hidden)                    # (R, Q, D) what was asked / what the text said
    num  = qformer_num(series_tokens)                 # (R, Q, D) what the signal actually did
    cond = cat([sem, num], dim=1)                     # (R, 2Q, D) constant cost, whatever the prompt
    for t in range(horizon):                          # causal Transformer forecaster
        val = value_head(forecaster_block(state, cross_attend=cond))   # a REAL number
    return stack(y) * sigma + mu                      # de-normalise with the encoder's retained stats

One row ``R`` per (series, channel): the causal forecaster runs in the encoder's normalised
space over a channel's values — its last ``forecast_context`` normalised history steps are the
prompt, then its own predictions (teacher-forced in training, fed back in :meth:`generate`) —
with a channel-index embedding, cross-attending to the series' 2Q conditioning slots (which saw
every channel through the encoder's channel-wise Transformer). :func:`denormalise` (the encoder's
inverse) puts the values back on the series' scale; the loss is the mean absolute error in the
normalised space (scale-free across series, the MASE numerator up to the scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_s2.models.timeseries.encoder import Attention, Block, denormalise
from megatron_s2.models.timeseries.horizon_predictor import HorizonPredictor

__all__ = ["ConditioningQFormer", "CausalForecaster", "ForecastBranch", "ForecastRows", "seasonal_lag"]


class ConditioningQFormer(nn.Module):
    """Q learned queries cross-attend over a variable-length stream [R, N, d_in] (mask [R, N]):
    any N in, Q slots of width D out — the bottleneck both streams must compete to write into."""

    def __init__(self, d_in: int, hidden: int, heads: int, queries: int):
        super().__init__()
        self.proj = nn.Linear(d_in, hidden)
        self.queries = nn.Parameter(torch.randn(queries, hidden) * hidden ** -0.5)
        self.block = Block(hidden, heads, cross=True)

    def forward(self, stream: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        context = self.proj(stream.to(self.proj.weight.dtype))
        return self.block(self.queries.expand(stream.size(0), -1, -1), context, mask)


class _ForecasterBlock(nn.Module):
    """Causal self-attention over the value sequence, cross-attention to the slots, MLP (pre-norm)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_self, self.norm_cross, self.norm_cond, self.norm_mlp = (nn.LayerNorm(hidden) for _ in range(4))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.cross = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, cond: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm_self(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attend[:, None])
        x = x + self.out(o.transpose(1, 2).reshape(b, s, d))
        x = x + self.cross(self.norm_cross(x), self.norm_cond(cond))
        return x + self.mlp(self.norm_mlp(x))


def seasonal_lag(history: torch.Tensor, valid: torch.Tensor, min_overlap: int = 8) -> torch.Tensor:
    """Dominant seasonal lag [R] (steps, >= 2) of each left-padded history [R, K], from its
    autocorrelation (Autoformer-style period discovery: no period is given to the model).

    Each row's valid part is linearly detrended; the biased autocorrelation (so of two multiples
    of the period the shorter wins) is maximised over lags after its first negative value, with
    at least ``min_overlap`` overlapping steps. A row with no such lag (too short, no cycle, a
    pure trend) gets lag 1: its seasonal candidate is the naive last value.
    """
    rows, steps = history.shape
    x = history.float()
    w = valid.float()
    n = w.sum(1, keepdim=True).clamp(min=1.0)
    t = torch.arange(steps, device=x.device, dtype=x.dtype).expand(rows, -1)
    t_mean, x_mean = (t * w).sum(1, keepdim=True) / n, (x * w).sum(1, keepdim=True) / n
    slope = ((t - t_mean) * (x - x_mean) * w).sum(1, keepdim=True) / (((t - t_mean) ** 2 * w).sum(1, keepdim=True) + 1e-8)
    y = (x - x_mean - slope * (t - t_mean)) * w                       # detrended, zero outside the valid part
    spectrum = torch.fft.rfft(y, n=2 * steps)
    acf = torch.fft.irfft(spectrum.abs() ** 2, n=2 * steps)[:, :steps]
    energy = acf[:, :1]
    acf = acf / energy.clamp(min=1e-8)
    lags = torch.arange(steps, device=x.device).expand(rows, -1)
    crossed = torch.cumsum((acf < 0).int(), dim=1) > 0                 # at or after the first negative value
    allowed = crossed & (lags >= 2) & (lags <= n.long() - min_overlap)
    score = acf.masked_fill(~allowed, float("-inf"))
    best, lag = score.max(dim=1)
    cyclic = torch.isfinite(best) & (best > 0) & (energy[:, 0] > 1e-6 * n[:, 0])   # a pure trend leaves ~0
    return torch.where(cyclic, lag, torch.ones_like(lag))


class CausalForecaster(nn.Module):
    """Value sequence [R, S] (normalised; ``valid`` [R, S]) -> next-value predictions [R, S].

    Every position ``s`` also reads its seasonal candidate for the next step, ``values[s + 1 - lag]``
    (``lag`` from :func:`seasonal_lag`; the last value where that falls in the padding), and its
    prediction is a learned gate between that candidate and the last value plus a learned
    correction (trend, harmonics, lead/lag from the conditioning slots): the Transformer learns
    the residual of a seasonal / naive forecast instead of copying a cycle from scratch.
    """

    def __init__(self, hidden: int, heads: int, layers: int, positions: int, channels: int):
        super().__init__()
        self.positions = positions
        self.value_in = nn.Linear(4, hidden)       # value, seasonal candidate, their difference, lag / positions
        self.position = nn.Embedding(positions, hidden)
        self.channel = nn.Embedding(channels, hidden)
        self.blocks = nn.ModuleList(_ForecasterBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.value_head = nn.Linear(hidden, 2)     # correction, gate logit (seasonal vs last value)
        with torch.no_grad():
            self.value_head.weight[1].zero_()
            self.value_head.bias.copy_(torch.tensor([0.0, 2.0]))   # start near the seasonal candidate

    def forward(self, values: torch.Tensor, valid: torch.Tensor, channel: torch.Tensor, cond: torch.Tensor,
                lag: torch.Tensor):
        s = values.size(1)
        index = torch.arange(s, device=values.device)[None] + 1 - lag[:, None]        # [R, S]
        usable = index >= 0
        index = index.clamp(min=0)
        usable = usable & valid.gather(1, index)
        seasonal = torch.where(usable, values.gather(1, index), values)
        feats = torch.stack([values, seasonal, seasonal - values,
                             (lag.to(values.dtype) / self.positions)[:, None].expand(-1, s)], dim=-1)
        x = self.value_in(feats) + self.position.weight[:s] + self.channel(channel)[:, None]
        causal = torch.ones(s, s, dtype=torch.bool, device=values.device).tril()
        # a padded (left) position attends to nobody real: let every position see itself
        attend = (causal & valid[:, None, :]) | torch.eye(s, dtype=torch.bool, device=values.device)
        for block in self.blocks:
            x = block(x, cond, attend)
        correction, gate = self.value_head(self.norm(x)).unbind(-1)
        gate = torch.sigmoid(gate)
        return gate * seasonal + (1 - gate) * values + correction


@dataclass
class ForecastRows:
    """The forecaster's rows of a batch of series: one per (series, channel)."""

    series: torch.Tensor
    """[R] index of the row's series."""
    channel: torch.Tensor
    """[R] channel index inside its series."""
    history: torch.Tensor
    """[R, K] normalised last K history steps, left-padded."""
    history_valid: torch.Tensor
    """[R, K] bool."""
    mu: torch.Tensor
    """[R] the encoder's retained channel mean."""
    sigma: torch.Tensor
    """[R] the encoder's retained channel standard deviation."""

    @classmethod
    def build(cls, values: list[torch.Tensor], mus: list, sigmas: list, context: int, eps: float) -> "ForecastRows":
        """From per-series raw histories [C_i, T_i] and the encoder's mu / sigma [C_i, 1]."""
        series, channel, history, valid, mu, sigma = [], [], [], [], [], []
        for k, (x, m, s) in enumerate(zip(values, mus, sigmas)):
            c, t = x.shape
            tail = ((x[:, -context:].to(m.dtype) - m) / (s + eps))   # the encoder's normalisation
            pad = context - tail.size(1)
            history.append(F.pad(tail, (pad, 0)))
            valid.append((torch.arange(context, device=x.device) >= pad).expand(c, -1))
            series += [k] * c
            channel.append(torch.arange(c, device=x.device))
            mu.append(m[:, 0])
            sigma.append(s[:, 0])
        device = history[0].device
        return cls(torch.tensor(series, device=device), torch.cat(channel), torch.cat(history), torch.cat(valid),
                   torch.cat(mu), torch.cat(sigma))


class ForecastBranch(nn.Module):
    """Horizon-agnostic forecasting head (module docstring); the horizon comes from the instruction."""

    def __init__(self, ts_cfg, backbone_hidden: int, eps: float = 1e-6):
        super().__init__()
        d, heads = ts_cfg.hidden, ts_cfg.heads
        self.context, self.max_horizon, self.eps = ts_cfg.forecast_context, ts_cfg.max_horizon, eps
        self.qformer_sem = ConditioningQFormer(backbone_hidden, d, heads, ts_cfg.forecast_queries)
        self.qformer_num = ConditioningQFormer(backbone_hidden, d, heads, ts_cfg.forecast_queries)
        self.forecaster = CausalForecaster(d, heads, ts_cfg.forecast_layers, self.context + self.max_horizon,
                                           ts_cfg.max_channels)
        # the learned horizon predictor (model.timeseries.horizon_predictor); None: the parser reads it
        self.horizon = (HorizonPredictor(backbone_hidden, d, heads, self.max_horizon)
                        if getattr(ts_cfg, "horizon_predictor", False) else None)

    def condition(self, llm_hidden, llm_mask, series_tokens, token_mask) -> torch.Tensor:
        """cond [S, 2Q, D] of S series: the LLM context's slots, then the signal's."""
        return torch.cat([self.qformer_sem(llm_hidden, llm_mask), self.qformer_num(series_tokens, token_mask)], dim=1)

    def teacher_forced(self, cond: torch.Tensor, rows: ForecastRows, future: torch.Tensor) -> torch.Tensor:
        """Normalised predictions [R, H] of the normalised ``future`` [R, H], each step from the true past."""
        if future.size(1) > self.max_horizon:
            raise ValueError(f"horizon {future.size(1)} exceeds model.timeseries.max_horizon ({self.max_horizon})")
        values = torch.cat([rows.history, future[:, :-1]], dim=1)
        valid = torch.cat([rows.history_valid, torch.ones_like(future[:, :-1], dtype=torch.bool)], dim=1)
        out = self.forecaster(values, valid, rows.channel, cond[rows.series],
                              seasonal_lag(rows.history, rows.history_valid))
        return out[:, self.context - 1:]

    @torch.no_grad()
    def generate(self, cond: torch.Tensor, rows: ForecastRows, horizon: int) -> torch.Tensor:
        """Normalised forecasts [R, horizon], each step fed back (no numerals, no stop token)."""
        if not 1 <= horizon <= self.max_horizon:
            raise ValueError(f"horizon {horizon} is outside 1..model.timeseries.max_horizon ({self.max_horizon})")
        values, valid = rows.history, rows.history_valid
        slots = cond[rows.series]
        lag = seasonal_lag(rows.history, rows.history_valid)
        for _ in range(horizon):
            nxt = self.forecaster(values, valid, rows.channel, slots, lag)[:, -1:]
            values = torch.cat([values, nxt], dim=1)
            valid = torch.cat([valid, torch.ones_like(nxt, dtype=torch.bool)], dim=1)
        return values[:, self.context:]

    def denormalise(self, normalised: torch.Tensor, rows: ForecastRows) -> torch.Tensor:
        """Real values: ``normalised * (sigma + eps) + mu`` with the encoder's retained stats."""
        return denormalise(normalised, rows.mu[:, None], rows.sigma[:, None], self.eps)
