"""Sampling parameters and the sampler: temperature, top-k, top-p, per-request seeds, log-probs.

The log-prob reported for a sampled token is taken under the distribution it was *sampled
from* — logits / temperature, restricted to the top-k and then the top-p nucleus,
renormalised — which is the behaviour-policy probability an RL trainer needs (§5.2.2
importance weights). Greedy decoding (``temperature == 0``) samples from a point mass, so
there the log-prob (and the optional top-N) is reported under the model's unscaled
distribution ``log_softmax(logits)``, as vLLM does.

Each request owns a ``torch.Generator`` on the model's device and a seed (its ``seed``, or one
derived from the engine's seed and the request's arrival number). The token at position ``i``
of the request's sequence (prompt included) is drawn with that generator reseeded from
:func:`position_seed` ``(seed, i)``: a sample depends only on its own logits, seed and position
— not on which other requests share the batch, nor on how many draws came before it — so a
request re-submitted with its generated prefix appended (a rollout resumed after a restart,
report §5.2.1) continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatron_s2.config.schema import ConfigError

__all__ = ["SamplingParams", "SampledToken", "sample_next", "position_seed"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops."""

    max_tokens: int = 16
    """Generated tokens at most (finish reason "length")."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (arg-max)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) = all."""
    seed: int | None = None
    """Seed of this request's generator, -2**63 .. 2**64-1; None = derived from the engine seed."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded output contains one (finish reason "stop")."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to the tokenizer's end-of-sequence id)."""
    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token."""
    logprobs: int = 0
    """Also report the top-N log-probs of every generated position (0 = only the sampled token's)."""
    record_routing: bool = False
    """Record the routed experts of every token fed to the model (Rollout Routing Replay, §5.2.1)."""
    record_indexer_topk: bool = False
    """Record every indexing layer's top-k entry ids of every token fed to the model."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k: must be >= 0 (0 or -1 = off), got {self.top_k}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:
            raise ConfigError(f"seed: must be in -2**63 .. 2**64-1 (what a torch.Generator takes), got {self.seed}")
        if self.logprobs < 0:
            raise ConfigError(f"logprobs: must be >= 0, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop: every stop string must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    """Log-probability of ``token_id`` under the sampling distribution (module docstring)."""
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    """The ``params.logprobs`` most likely (token, log-prob) pairs of that distribution."""


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log-probabilities [V] of the distribution a token is drawn from (-inf outside the support)."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    # shift by the maximum and divide in float64: the same distribution, but a temperature far
    # from 1 (1e-300 is 0 in float32) gives 0 at the arg-max and -inf / tiny values elsewhere
    # instead of 0 / 0 or inf - inf = NaN
    scaled = (logits - logits.max()).double() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        order = scaled.argsort(descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        before = probs.cumsum(0) - probs            # mass of the strictly more likely tokens
        drop = order[before >= params.top_p]         # the most likely token is always kept
        scaled = scaled.index_fill(0, drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).float()


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """Seed of the draw at ``position`` of a request seeded with ``seed``: SplitMix64's finaliser
    over both, so neighbouring seeds and positions give unrelated streams."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: what manual_seed takes on every device


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> SampledToken:
    """Draw one token from ``logits`` [V] (full vocabulary, float32)."""
    logp = sampling_log_probs(logits, params)
    if params.greedy:
        token = int(logits.argmax())
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    top = []
    if params.logprobs:
        values, ids = logp.topk(min(params.logprobs, logp.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, values) if math.isfinite(float(v))]
    return SampledToken(token, float(logp[token]), top)
