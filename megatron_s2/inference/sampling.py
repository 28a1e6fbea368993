"""Sampling parameters and the sampler: temperature, top-k, top-p, per-request seeds, log-probs.

A token is drawn from the *sampling distribution* — logits / temperature, restricted to the
top-k and then the top-p nucleus, renormalised; greedy decoding (``temperature == 0``) takes the
arg-max. What is reported for it (and for its top-N alternatives) is vLLM's ``logprobs_mode``:

==================== =====================================================================
``processed_logprobs`` log-probs of the sampling distribution (-inf outside the kept set): the
                     behaviour-policy probability an RL trainer needs (§5.2.2 importance
                     weights). The engine's default; post-training pins it.
``raw_logprobs``     ``log_softmax(logits)`` of the model, before temperature / top-k / top-p
                     (vLLM's default, and the server's: ``megatron-s2 serve --logprobs-mode``).
``processed_logits`` ``logits / temperature``, -inf outside the kept set.
``raw_logits``       the model's logits.
==================== =====================================================================

Greedy decoding samples from a point mass, so there "processed" is the unscaled distribution
(``log_softmax(logits)`` / the logits), as vLLM reports it.

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

from megatron_s2.config.engine import LOGPROBS_MODES
from megatron_s2.config.schema import ConfigError

__all__ = ["SamplingParams", "SampledToken", "constrain_logits", "sample_next", "sampled_token", "position_seed", "call_seed", "LOGPROBS_MODES"]


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
    """Seed of this request's draws, a 64-bit integer (-2**63 .. 2**64-1); None = derived from the
    engine seed."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded output contains one (finish reason "stop")."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to the tokenizer's end-of-sequence id)."""
    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token."""
    logprobs: int = 0
    """Also report the top-N log-probs of every generated position (0 = only the sampled token's)."""
    logprob_token_ids: tuple[int, ...] = ()
    """Report these tokens' values at every generated position instead of the top-N (vLLM's
    ``logprob_token_ids``: a fixed label set, e.g. the answer letters of a classifier)."""
    logprobs_mode: str = "processed_logprobs"
    """What the reported values are (module docstring): ``processed_logprobs`` (the sampling
    distribution), ``raw_logprobs``, ``processed_logits`` or ``raw_logits``."""
    record_routing: bool = False
    """Record the routed experts of every token fed to the model (Rollout Routing Replay, §5.2.1)."""
    record_indexer_topk: bool = False
    """Record every indexing layer's top-k entry ids of every token fed to the model."""
    banned_token_ids: tuple[int, ...] = ()
    """Tokens never drawn (their logits are -inf before sampling): the gateway's
    ``tool_choice: "none"`` bans the tool-call marker."""
    required_token_id: int | None = None
    """End-of-sequence and ``stop_token_ids`` cannot be drawn until this token has been generated
    (the gateway's ``tool_choice: "required"``: no answer ends before a tool call begins)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logprob_token_ids", tuple(int(t) for t in self.logprob_token_ids))
        object.__setattr__(self, "banned_token_ids", tuple(int(t) for t in self.banned_token_ids))
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k: must be >= 0 (0 or -1 = off), got {self.top_k}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:
            raise ConfigError(f"seed: must be a 64-bit integer, -2**63 .. 2**64-1 (draws are seeded from its 64 "
                              f"bits: a longer seed would give another seed's samples), got {self.seed}")
        if self.logprobs < 0:
            raise ConfigError(f"logprobs: must be >= 0, got {self.logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop: every stop string must be a non-empty string")

    @property
    def constrained(self) -> bool:
        """Some tokens are masked (:func:`constrain_logits`)."""
        return bool(self.banned_token_ids) or self.required_token_id is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    """The reported value of ``token_id`` (``params.logprobs_mode``; module docstring)."""
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    """The ``params.logprobs`` largest (token, value) pairs of the same values."""


def sampling_log_probs_rows(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log-probabilities [N, V] of the distribution a token is drawn from at each row of ``logits``
    under one request's ``params`` (-inf outside the support); speculative drafting and
    verification process several positions at once, plain sampling one."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    # shift by the maximum and divide in float64: the same distribution, but a temperature far
    # from 1 (1e-300 is 0 in float32) gives 0 at the arg-max and -inf / tiny values elsewhere
    # instead of 0 / 0 or inf - inf = NaN
    scaled = (logits - logits.max(-1, keepdim=True).values).double() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.size(-1):
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        order = scaled.argsort(dim=-1, descending=True)
        probs = torch.softmax(scaled.gather(-1, order), dim=-1)
        before = probs.cumsum(-1) - probs
        drop = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).float()


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log-probabilities [V] of the distribution a token is drawn from (-inf outside the support)."""
    return sampling_log_probs_rows(logits.unsqueeze(0), params)[0]


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """Seed of the draw at ``position`` of a request seeded with ``seed``: SplitMix64's finaliser
    over both, so neighbouring seeds and positions give unrelated streams."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: what manual_seed takes on every device


def call_seed(seed: int, call: int) -> int:
    """The request seed of model call ``call`` of an episode seeded with ``seed``: the episode's own
    seed for its first call (a single-call episode samples as before), a SplitMix64 mix for the
    later ones. Not ``seed + c * stride``: held-out episodes are seeded ``stride * key``, so call
    ``c`` of episode ``key`` would draw exactly episode ``key + c``'s random numbers."""
    # offset far beyond any token position, so a call's seed is never one of its own draws' seeds
    return int(seed) % (2 ** 63) if call == 0 else position_seed(seed, (1 << 40) + int(call))


def reported_values(logits: torch.Tensor, params: SamplingParams, sampling_logp: torch.Tensor) -> torch.Tensor:
    """The values [V] reported for a position under ``params.logprobs_mode`` (``sampling_logp``:
    the position's :func:`sampling_log_probs`, which is the processed log-probs)."""
    mode = params.logprobs_mode
    if mode == "processed_logprobs":
        return sampling_logp
    if mode == "raw_logprobs":
        return torch.log_softmax(logits.float(), dim=-1)
    if mode == "raw_logits":
        return logits.float()
    temperature = 1.0 if params.greedy else params.temperature  # processed_logits: what is sampled from
    outside = torch.isneginf(sampling_logp)  # dropped by top-k / top-p
    return (logits.double() / temperature).masked_fill(outside, float("-inf")).float()


def constrain_logits(logits: torch.Tensor, params: SamplingParams, generated, end_ids) -> torch.Tensor:
    """``logits`` [V] with the tokens ``params`` forbids at this position set to -inf: its
    ``banned_token_ids``, and ``end_ids`` (end-of-sequence and stop tokens) while
    ``required_token_id`` is not among the ``generated`` ids. The model's logits otherwise, so the
    reported log-probs are those of the distribution actually sampled from."""
    banned = set(params.banned_token_ids)
    if params.required_token_id is not None and params.required_token_id not in generated:
        banned.update(int(t) for t in end_ids)
        banned.update(params.stop_token_ids)
    banned = sorted(t for t in banned if 0 <= t < logits.size(-1))
    if not banned:
        return logits
    return logits.float().index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> SampledToken:
    """Draw one token from ``logits`` [V] (full vocabulary, float32)."""
    logp = sampling_log_probs(logits, params)
    if params.greedy:
        token = int(logits.argmax())
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return sampled_token(logits, params, token, logp)


def sampled_token(logits: torch.Tensor, params: SamplingParams, token: int,
                  logp: torch.Tensor | None = None) -> SampledToken:
    """What is reported for ``token`` drawn from ``logits`` [V] (its value and the top-N under
    ``params.logprobs_mode``) — also for a token chosen by speculative verification."""
    if logp is None:
        logp = sampling_log_probs(logits, params)
    values = reported_values(logits, params, logp)
    top = []
    if params.logprob_token_ids:  # a fixed label set, in the order asked (impossible ones included)
        top = [(token_id, float(values[token_id])) for token_id in params.logprob_token_ids]
    elif params.logprobs:
        best, ids = values.topk(min(params.logprobs, values.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, best) if math.isfinite(float(v))]
    return SampledToken(token, float(values[token]), top)
