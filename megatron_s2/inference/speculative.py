"""Speculative decoding arithmetic: lossless verification, acceptance, and the DSpark
confidence-scheduled choice of verification lengths.

Verification (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1 / Thm. 1; Chen et al., 2023, "Accelerating LLM Decoding with Speculative
Sampling", Alg. 2). A drafter proposes ``k`` tokens ``d_0 .. d_{k-1}`` from its distributions
``q_0 .. q_{k-1}``; one target forward over them gives ``p_0 .. p_k`` (``p_i`` is the target's
next-token distribution after the context and ``d_0 .. d_{i-1}``):

- sampled (:func:`verify_sampled`): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
  at the first rejection emit a token drawn from ``normalize(max(0, p_i - q_i))``; if every draft
  is accepted emit a bonus token drawn from ``p_k``. The emitted sequence is distributed exactly
  as sampling from ``p`` token by token: the scheme is lossless, whatever ``q`` is.
- greedy (:func:`verify_greedy`): accept the longest prefix of drafts equal to the target's
  arg-max, emit the arg-max at the first mismatch (or row ``k``'s): the same rule as the engine's
  greedy sampler (:func:`megatron_s2.inference.sampling.sample_next`: ``logits.argmax()``, first
  index on ties), so greedy speculative decode equals plain greedy decode token for token.

Acceptance equals overlap (Intern-S2 walkthrough, Ch. 4, Eq. 21; "Worked example 12", in
``shared/seeds/intern-s2-report-walkthrough.txt``): a draft from ``q`` is accepted with
probability ``sum_x min(p(x), q(x)) = 1 - TV(p, q)``. For p = (.6, .3, .1), q = (.5, .2, .3):
overlap 0.80, TV 0.20. With a per-position acceptance ``a`` and ``k`` drafts a round emits
``(1 - a^(k+1)) / (1 - a)`` tokens on average (:func:`expected_tokens_per_round`).

Confidence-scheduled verification (DeepSeek-V4.1-Flash report §2.4.3, DSpark, in
``shared/seeds/deepseek-v4.1-flash-report.txt``): "a confidence head predicts per-position
conditional acceptance probabilities, which are used to estimate prefix survival probabilities"
(:func:`prefix_survival`); "the scheduler combines these estimates with profiled engine
throughput curves [:class:`ThroughputProfile`] to dynamically select the verification length for
each request, aiming to maximize expected system-wide token throughput under the current system
load" (:func:`choose_verification_lengths`).

Pure torch + stdlib: the engine and the drafter call into it; nothing here knows about them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = [
    "verify_greedy",
    "verify_sampled",
    "speculative_sample",
    "overlap",
    "total_variation",
    "expected_tokens_per_round",
    "prefix_survival",
    "ThroughputProfile",
    "choose_verification_lengths",
]


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------

def _check_draft_shapes(target: torch.Tensor, draft_tokens: torch.Tensor, what: str) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens: expected shape [k], got {tuple(draft_tokens.shape)}")
    k = draft_tokens.numel()
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"{what}: expected shape [k + 1, V] = [{k + 1}, V] for {k} drafts, "
                         f"got {tuple(target.shape)}")
    return k


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of ``k`` drafts against the target's logits ``[k + 1, V]``.

    Returns ``(accepted, token)``: the drafts ``draft_tokens[:accepted]`` equal the target's
    arg-max row by row, and ``token`` is the target's arg-max at row ``accepted`` (the first
    mismatch, or the bonus row ``k`` when all match). The caller emits
    ``draft_tokens[:accepted] + [token]``.
    """
    k = _check_draft_shapes(target_logits, draft_tokens, "target_logits")
    # float32 like the engine's sampler (an exact cast from bf16/fp16, so no new ties); argmax
    # takes the first maximal index, exactly as sample_next's `logits.argmax()` on each row
    best = target_logits.float().argmax(dim=-1)
    matches = (best[:k] == draft_tokens.to(best.device)).int()
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(best[accepted])


def speculative_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator, lengths: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched exact speculative sampling (module docstring) for ``B`` requests at once.

    ``target_probs [B, K + 1, V]``, ``draft_probs [B, K, V]``, ``draft_tokens [B, K]``;
    ``lengths [B]`` (optional, each 0..K): request ``b`` verifies only its first ``lengths[b]``
    drafts and takes its bonus token from row ``lengths[b]``. Rows must be normalised
    distributions (the sampling distributions of target and drafter). Returns
    ``(accepted [B], token [B])`` as long tensors on the probabilities' device.

    Random draws: ``B * K`` uniforms, then one categorical draw per request, all from
    ``generator`` (on the probabilities' device): a fixed seed gives fixed results.
    """
    if target_probs.dim() != 3 or draft_probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(f"speculative_sample: expected target_probs [B, K+1, V], draft_probs [B, K, V], "
                         f"draft_tokens [B, K]; got {tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, "
                         f"{tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (batch, k + 1, vocab) or draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"speculative_sample: shapes disagree: target_probs {tuple(target_probs.shape)}, "
                         f"draft_probs {tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)} "
                         f"(want [B, K+1, V], [B, K, V], [B, K])")
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    if lengths is None:
        lengths = torch.full((batch,), k, dtype=torch.long, device=device)
    lengths = lengths.to(device=device, dtype=torch.long)
    if lengths.shape != (batch,) or bool(((lengths < 0) | (lengths > k)).any()):
        raise ValueError(f"lengths: expected shape [{batch}] with values in 0..{k}, got {lengths.tolist()}")
    # float64: ratios and residuals of probabilities that agree to float32 precision stay exact
    p = target_probs.double()
    q = draft_probs.to(device=device, dtype=torch.float64)
    tokens = draft_tokens.to(device=device, dtype=torch.long)
    p_of_draft = p[:, :k].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)   # [B, K]
    q_of_draft = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)          # [B, K]
    uniform = torch.rand((batch, k), generator=generator, device=device, dtype=torch.float64)
    # u < p/q without dividing: with u in [0, 1) this accepts with probability min(1, p/q), and a
    # draft the drafter gave probability 0 (impossible if it was sampled from q) is accepted iff
    # the target allows it (p > 0), never through 0/0
    accept = uniform * q_of_draft < p_of_draft
    accept &= torch.arange(k, device=device) < lengths.unsqueeze(-1)     # beyond a request's length
    accepted = accept.long().cumprod(-1).sum(-1)                         # leading acceptances

    # the distribution of the emitted token: the residual at a rejection, else the bonus row
    target_row = p[rows, accepted]                                       # [B, V]
    rejected = accepted < lengths
    if k:
        draft_row = q[rows, accepted.clamp(max=k - 1)]
        residual = (target_row - draft_row).clamp(min=0)
        # an all-zero residual means p == q (up to rounding), where a rejection has probability
        # 0; should rounding still reject, p itself is the limit of the residual's normalisation
        has_residual = residual.sum(-1, keepdim=True) > 0
        residual = torch.where(has_residual, residual, target_row)
        target_row = torch.where(rejected.unsqueeze(-1), residual, target_row)
    # multinomial normalises the residual itself, as sample_next draws from probabilities
    token = torch.multinomial(target_row, 1, generator=generator).squeeze(-1)
    return accepted, token


def verify_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """Exact speculative (rejection) sampling for one request: ``target_probs [k + 1, V]``,
    ``draft_probs [k, V]``, ``draft_tokens [k]``. Returns ``(accepted, token)``: emit
    ``draft_tokens[:accepted] + [token]``. The same draws as :func:`speculative_sample` with
    ``B = 1``."""
    k = _check_draft_shapes(target_probs, draft_tokens, "target_probs")
    if draft_probs.shape != (k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs: expected shape [k, V] = [{k}, {target_probs.shape[-1]}], "
                         f"got {tuple(draft_probs.shape)}")
    accepted, token = speculative_sample(target_probs.unsqueeze(0), draft_probs.unsqueeze(0),
                                         draft_tokens.unsqueeze(0), generator)
    return int(accepted[0]), int(token[0])


# ---------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------

def overlap(p: torch.Tensor, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``sum_x min(p(x), q(x))``: the probability that a draft from ``q`` is accepted when the
    target is ``p`` (walkthrough Eq. 21)."""
    return torch.minimum(p, q).sum(dim)


def total_variation(p: torch.Tensor, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``1/2 sum_x |p(x) - q(x)|`` (= 1 - overlap for normalised p, q)."""
    return 0.5 * (p - q).abs().sum(dim)


def expected_tokens_per_round(a, k: int):
    """Expected tokens emitted by one verification round of ``k`` drafts, each accepted with
    probability ``a`` independently: ``(1 - a^(k+1)) / (1 - a)``, ``k + 1`` at ``a = 1``.

    Computed as ``sum_{i=0..k} a^i`` (the same value, with no 0/0 at a = 1 nor cancellation
    near it). ``a``: a float or a tensor of acceptance probabilities.
    """
    if k < 0:
        raise ValueError(f"k: must be >= 0, got {k}")
    return sum(a ** i for i in range(k + 1))


def prefix_survival(accept_probs: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` conditional acceptance probabilities (the confidence head's, position ``j``
    given drafts ``< j`` accepted) -> ``[..., K]`` probabilities that the first ``j + 1`` drafts
    are all accepted: their cumulative product, non-increasing along the last dimension."""
    if bool(((accept_probs < 0) | (accept_probs > 1) | accept_probs.isnan()).any()):
        raise ValueError("accept_probs: conditional acceptance probabilities must lie in [0, 1]")
    return accept_probs.cumprod(dim=-1)


# ---------------------------------------------------------------------------------------------
# Throughput profile and the verification-length scheduler
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ThroughputProfile:
    """Measured seconds of one verification forward as a function of the tokens it carries.

    Piecewise-linear between the measured points; beyond the last point, the last segment's line
    (one point: a constant); below the first, the first point's time (a forward never costs less
    than its fixed overhead).
    """

    points: tuple[tuple[int, float], ...]
    """(tokens, seconds) pairs: tokens strictly increasing and >= 1, seconds > 0 and
    non-decreasing (a forward carrying more tokens does not cost less)."""

    def __post_init__(self) -> None:
        points = tuple((int(tokens), float(seconds)) for tokens, seconds in self.points)
        object.__setattr__(self, "points", points)
        if not points:
            raise ValueError("ThroughputProfile.points: needs at least one (tokens, seconds) point")
        for i, (tokens, seconds) in enumerate(points):
            if tokens < 1 or not (seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"ThroughputProfile.points[{i}] = ({tokens}, {seconds}): tokens must be >= 1 "
                                 f"and seconds a finite number > 0")
            if i and tokens <= points[i - 1][0]:
                raise ValueError(f"ThroughputProfile.points[{i}] = ({tokens}, {seconds}): tokens must increase "
                                 f"strictly (previous point has {points[i - 1][0]})")
            if i and seconds < points[i - 1][1]:
                raise ValueError(f"ThroughputProfile.points[{i}] = ({tokens}, {seconds}): seconds must not decrease "
                                 f"with more tokens (previous point: {points[i - 1][1]} s at {points[i - 1][0]} "
                                 f"tokens); re-measure, or take the running maximum")

    def __call__(self, tokens: float) -> float:
        """Seconds of a forward carrying ``tokens`` tokens."""
        return float(self.seconds(torch.tensor([float(tokens)], dtype=torch.float64))[0])

    def seconds(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vectorised :meth:`__call__` (float64)."""
        xs = torch.tensor([t for t, _ in self.points], dtype=torch.float64)
        ys = torch.tensor([s for _, s in self.points], dtype=torch.float64)
        tokens = tokens.to(torch.float64).clamp(min=xs[0])
        if len(self.points) == 1:
            return ys[0].expand_as(tokens).clone()
        # segment i spans xs[i] .. xs[i+1]; past the last point the last segment continues
        segment = (torch.searchsorted(xs, tokens, right=True) - 1).clamp(0, len(xs) - 2)
        x0, x1, y0, y1 = xs[segment], xs[segment + 1], ys[segment], ys[segment + 1]
        return y0 + (tokens - x0) * (y1 - y0) / (x1 - x0)

    def to_json(self, path: str | Path) -> None:
        """Write ``{"points": [[tokens, seconds], ...]}``."""
        Path(path).write_text(json.dumps({"points": [list(point) for point in self.points]}, indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> ThroughputProfile:
        """Read a file written by :meth:`to_json`; errors name the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{path}: cannot read a throughput profile: {error}") from None
        points = data.get("points") if isinstance(data, dict) else None
        if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
            raise ValueError(f'{path}: expected {{"points": [[tokens, seconds], ...]}}')
        try:
            return cls(tuple((p[0], p[1]) for p in points))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def measure(cls, fn: Callable[[int], object], token_counts: Sequence[int], repeats: int = 3,
                warmup: int = 1) -> ThroughputProfile:
        """Time ``fn(n_tokens)`` (which must block until its work is done, e.g. synchronise the
        device) for every count, interleaved: each repeat sweeps all counts, so slow drift of the
        machine touches every point alike. A point's time is the minimum over repeats (noise only
        adds time); the running maximum over counts removes what noise is left out of order."""
        counts = sorted(set(int(n) for n in token_counts))
        if not counts or repeats < 1:
            raise ValueError("ThroughputProfile.measure: needs at least one token count and repeats >= 1")
        for n in counts * warmup:
            fn(n)
        best = {n: math.inf for n in counts}
        for _ in range(repeats):
            for n in counts:
                start = time.perf_counter()
                fn(n)
                best[n] = min(best[n], time.perf_counter() - start)
        points, running = [], 0.0
        for n in counts:
            running = max(running, best[n], 1e-9)
            points.append((n, running))
        return cls(tuple(points))


def choose_verification_lengths(survival: torch.Tensor, profile: ThroughputProfile, draft_seconds: float = 0.0,
                                max_len: int | None = None) -> list[int]:
    """Per request, how many of its ``K`` drafts to verify (0..K), maximising the expected
    system-wide tokens per second of the next round (report §2.4.3)::

        sum_r (1 + sum_{j <= k_r} survival[r, j-1]) / (profile(sum_r (k_r + 1)) + draft_seconds)

    ``survival [B, K]``: prefix-survival probabilities (:func:`prefix_survival`), non-increasing
    along K. ``max_len`` caps every request's length.

    Why a greedy is exact: the denominator depends only on the total ``m = sum_r k_r``. For a
    fixed ``m`` the numerator is largest for the ``m`` largest survival entries, and because each
    row is non-increasing those can be taken prefix-closed (ties within a row in position order).
    So adding the globally next-largest entry one at a time visits the best choice of every
    ``m``; the best ``m`` (fewest tokens on ties) wins.
    """
    if survival.dim() != 2:
        raise ValueError(f"survival: expected shape [B, K], got {tuple(survival.shape)}")
    if max_len is not None and max_len < 0:
        raise ValueError(f"max_len: must be >= 0, got {max_len}")
    if draft_seconds < 0:
        raise ValueError(f"draft_seconds: must be >= 0, got {draft_seconds}")
    batch, k = survival.shape
    if batch == 0:
        return []
    survival = survival.detach().to("cpu", torch.float64)
    if bool(survival.isnan().any()):
        raise ValueError("survival: contains NaN")
    if k > 1 and bool((survival[:, 1:] > survival[:, :-1]).any()):
        raise ValueError("survival: prefix-survival probabilities must be non-increasing along K "
                         "(pass prefix_survival(conditional acceptance probabilities))")
    if max_len is not None:
        survival = survival[:, :max_len]
        k = survival.shape[1]
    # the stable descending sort keeps equal entries of a row in position order: every prefix of
    # the order is prefix-closed per request
    values, order = survival.reshape(-1).sort(descending=True, stable=True)
    expected_tokens = batch + torch.cat([values.new_zeros(1), values.cumsum(0)])       # m = 0 .. B*K
    verified_tokens = batch + torch.arange(batch * k + 1, dtype=torch.float64)
    throughput = expected_tokens / (profile.seconds(verified_tokens) + draft_seconds)
    best_m = int(throughput.argmax())                  # the first maximum: fewest tokens on ties
    rows = order[:best_m] // max(k, 1)
    return torch.bincount(rows, minlength=batch).tolist()
