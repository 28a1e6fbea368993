"""When drafting pays, and how far each request verifies: the engine's adaptive DSpark schedule
(report 003 §2.4.3, DeepSeek-V4.1-Flash "DSpark": confidence-scheduled verification).

The report's scheduler "combines [the confidence head's prefix-survival] estimates with profiled
engine throughput curves to dynamically select the verification length for each request, aiming
to maximize expected system-wide token throughput under the current system load". Taken
literally, that trusts the confidence head; a drafter whose head is wrong (an untrained one, or
one that lags the policy during RL) then drafts at every step and decodes several times slower
than plain decode. Three measured things make the schedule safe for any drafter:

1. :class:`AcceptanceEstimate` — per draft position ``i``, the measured *conditional* acceptance
   rate: rounds that accepted position ``i`` among those that verified it with positions
   ``0 .. i-1`` accepted. Counts decay exponentially (half-life :attr:`~AcceptanceEstimate.HALF_LIFE`
   request-rounds) so the estimate follows a drafter that improves (the online draft update in RL)
   or a workload that changes; each position starts from one pseudo-round at the head's own mean
   prediction there. The head's per-request estimates are *calibrated* by it:
   ``c'[r, i] = min(1, c[r, i] * rate_i / head_mean_i)`` (``head_mean_i`` over the same rounds,
   same prior): the head ranks requests, the measurement sets the level.
2. :class:`StepCosts` — the engine's own step times, the minimum per point and made monotone
   from above (noise on a shared machine only ever adds time): the decode forward by the tokens it carries (plain decodes and
   verification forwards alike — the report's "throughput curve", ``F``), and the rest of a step by
   batch size: plain decode's sampling and bookkeeping (``A``), a speculative step's drafting,
   scheduling, acceptance and rollback (``D``).
3. :class:`DraftGate` — *before* drafting, with ``B`` requests ready to decode and ``s_j`` the
   measured prefix survival, compare the best expected speculative rate over uniform lengths,
   ``max_k B (1 + s_0 + .. + s_{k-1}) / (F(B (1 + k)) + D(B))``, with plain decode's
   ``B / (F(B) + A(B))``. While drafting does not pay, decode plainly and *probe* (draft, verify at
   least one draft per request, refresh the estimate) after a back-off that doubles from
   :attr:`~DraftGate.BACKOFF_MIN` to :attr:`~DraftGate.BACKOFF_MAX` decode steps: a bad drafter
   costs one probe per back-off period, a good one speculates at every step. Until both kinds of
   step have been timed the gate measures the missing one (a plain step first, then a probe).
   The exploration runs both ways: while drafting pays, a plain step is taken after a back-off
   that doubles the same way (a *refresh*). Without it plain decode's costs would rest on the
   few plain steps timed before drafting began — the first of them a cold start — while the
   speculative costs keep their minimum over hundreds of steps: a bias towards drafting that,
   measured with a trained tiny drafter at batch 16 (greedy, acceptance 0.48 at the first
   position), drafted at 217 of 278 steps and decoded at 0.92x plain.

After a draft, :func:`~.speculative.choose_verification_lengths` picks each request's length
from the calibrated head against ``F`` and ``D`` (maximum expected tokens per second over the
batch). None of this touches verification: the output is exactly plain decode's (greedy) or the
policy's distribution (sampling), whatever the schedule decides. A seeded sampled request is
reproducible in *distribution* only: rejection sampling draws differently on a drafted step than
on a plain one, and which steps draft follows measured times, so two runs of the same seed may
differ (greedy requests never do).
"""

from __future__ import annotations

import math

from megatron_s2.inference.speculative import ThroughputProfile

__all__ = ["AcceptanceEstimate", "MinimumCurve", "StepCosts", "DraftGate"]


class AcceptanceEstimate:
    """Measured per-position conditional acceptance with the confidence head as its prior."""

    HALF_LIFE = 256
    """Request-rounds after which a round's weight in the estimate has halved."""
    PRIOR_ROUNDS = 1.0
    """Weight of the head's mean prediction before anything is measured (pseudo-rounds)."""

    def __init__(self, positions: int):
        self.positions = positions
        self.decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self.reached = [0.0] * positions      # rounds that verified i with 0 .. i-1 accepted (decayed)
        self.accepted = [0.0] * positions     # ... and accepted i
        self.head_reached = [0.0] * positions  # the head's prediction summed over those rounds
        self.head_all = [0.0] * positions     # the head's prediction summed over every drafted round
        self.drafted = [0.0] * positions

    def record(self, verified: int, accepted: int, head: list[float]) -> None:
        """One request's round: ``verified`` drafts, the first ``accepted`` kept; ``head`` the
        confidence head's conditional acceptance probabilities of its drafts (all positions)."""
        for counts in (self.reached, self.accepted, self.head_reached, self.head_all, self.drafted):
            for i in range(self.positions):
                counts[i] *= self.decay
        for i, c in enumerate(head[:self.positions]):
            self.head_all[i] += c
            self.drafted[i] += 1.0
        for i in range(min(verified, accepted + 1)):  # positions reached: the accepted ones and the first rejection
            self.reached[i] += 1.0
            self.head_reached[i] += head[i]
            self.accepted[i] += 1.0 if i < accepted else 0.0

    def _prior(self, i: int) -> float:
        return self.head_all[i] / self.drafted[i] if self.drafted[i] else 0.5

    def rates(self) -> list[float]:
        """Conditional acceptance per position (the measurement, shrunk towards the head's mean)."""
        w = self.PRIOR_ROUNDS
        return [(self.accepted[i] + w * self._prior(i)) / (self.reached[i] + w) for i in range(self.positions)]

    def survival(self) -> list[float]:
        """Prefix survival per position from :meth:`rates`: ``s_j = rate_0 * .. * rate_j``."""
        out, running = [], 1.0
        for rate in self.rates():
            running *= rate
            out.append(running)
        return out

    def calibration(self) -> list[float]:
        """Per position, the factor that scales the head's predictions to the measured level."""
        w, rates = self.PRIOR_ROUNDS, self.rates()
        factors = []
        for i, rate in enumerate(rates):
            head_mean = (self.head_reached[i] + w * self._prior(i)) / (self.reached[i] + w)
            factors.append(rate / head_mean if head_mean > 1e-6 else 1.0)
        return factors


class MinimumCurve:
    """Seconds as a function of a count (tokens, requests): the fastest time seen per count, made
    monotone (more work never costs less) by *lowering* a count's time to the fastest time seen
    at any larger count — noise only adds time, so a slow outlier is what gets corrected, never
    spread to the counts above it — piecewise-linear between counts seen, the last segment
    continued beyond them, flat below the first (plain Python: it is read at every decode step)."""

    def __init__(self):
        self.best: dict[int, float] = {}
        self._points: list[tuple[int, float]] | None = None  # the monotone curve, rebuilt on change

    def observe(self, count: int, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds) and seconds < self.best.get(count, math.inf):
            self.best[count] = seconds
            self._points = None

    @property
    def known(self) -> bool:
        return bool(self.best)

    def points(self) -> list[tuple[int, float]]:
        if self._points is None:
            running, points = math.inf, []
            for count in sorted(self.best, reverse=True):
                running = min(running, self.best[count])
                points.append((max(count, 1), running))
            self._points = points[::-1]
        return self._points

    def profile(self) -> ThroughputProfile:
        """The curve as a :class:`ThroughputProfile` (none seen: a flat 1 s, every count costs the same)."""
        return ThroughputProfile(tuple(self.points()) or ((1, 1.0),))

    def __call__(self, count: float) -> float:
        points = self.points()
        if not points:
            return 1.0
        if len(points) == 1 or count <= points[0][0]:
            return points[0][1]
        i = next((j for j in range(1, len(points)) if points[j][0] >= count), len(points) - 1)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return y0 + (count - x0) * (y1 - y0) / (x1 - x0)


class StepCosts:
    """The engine's decode-step times (module docstring, 2)."""

    def __init__(self, fixed_forward: ThroughputProfile | None = None):
        self.fixed_forward = fixed_forward
        """A profile file's throughput curve, used instead of the measured one."""
        self.forward = MinimumCurve()
        """F: seconds of a decode / verification forward by the tokens it carries."""
        self.plain_rest = MinimumCurve()
        """A: the rest of a plain decode step (sampling, bookkeeping) by batch size."""
        self.speculative_rest = MinimumCurve()
        """D: the rest of a speculative step (drafting, scheduling, acceptance, rollback) by batch size."""

    def forward_profile(self) -> ThroughputProfile:
        return self.fixed_forward or self.forward.profile()

    def forward_seconds(self, tokens: int) -> float:
        return self.fixed_forward(tokens) if self.fixed_forward is not None else self.forward(tokens)

    def observe_plain(self, batch: int, forward_s: float, step_s: float) -> None:
        self.forward.observe(batch, forward_s)
        self.plain_rest.observe(batch, step_s - forward_s)

    def observe_speculative(self, batch: int, tokens: int, forward_s: float, step_s: float) -> None:
        self.forward.observe(tokens, forward_s)
        self.speculative_rest.observe(batch, step_s - forward_s)


class DraftGate:
    """Whether the next decode step drafts (module docstring, 3)."""

    BACKOFF_MIN = 4
    """Plain decode steps before the first probe once drafting stopped paying."""
    BACKOFF_MAX = 256
    """The longest back-off between probes."""
    MARGIN = 1.05
    """Drafting must promise this much over plain decode: the estimates are noisy, and a drafter
    that would gain less than the margin is not worth the risk of losing more."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.backoff = self.BACKOFF_MIN
        self.waited = 0
        self.probing = False
        """The step being decided is a probe: it drafts although drafting does not pay."""
        self.probes = 0
        self.plain_steps = 0
        self.refresh_backoff = self.BACKOFF_MIN
        self.drafted_run = 0
        self.refreshes = 0
        """Plain steps taken while drafting paid, to keep plain decode's measured costs current."""

    @staticmethod
    def speedup(batch: int, survival: list[float], costs: StepCosts) -> float:
        """Expected speculative tokens/s over plain decode's at ``batch`` (best uniform length)."""
        forward = costs.forward_seconds
        plain = batch / (forward(batch) + costs.plain_rest(batch))
        rest, expected, best = costs.speculative_rest(batch), 1.0, 0.0
        for k, survive in enumerate(survival, start=1):  # k drafts per request: 1 + s_0 + .. + s_{k-1} tokens
            expected += survive
            best = max(best, batch * expected / (forward(batch * (1 + k)) + rest))
        return best / plain

    def decide(self, batch: int, estimate: AcceptanceEstimate, costs: StepCosts) -> bool:
        """True: draft this step (``probing`` says whether only to refresh the estimate)."""
        self.probing = False
        if not costs.plain_rest.known:  # time a plain step first: the baseline everything is compared with
            return self._plain()
        if not costs.speculative_rest.known:
            return self._probe()
        if self.speedup(batch, estimate.survival()[:self.max_drafts], costs) > self.MARGIN:
            self.backoff, self.waited = self.BACKOFF_MIN, 0
            self.drafted_run += 1
            if self.drafted_run > self.refresh_backoff:  # re-time plain decode (module docstring, 3)
                self.refresh_backoff = min(2 * self.refresh_backoff, self.BACKOFF_MAX)
                self.drafted_run = 0
                self.refreshes += 1
                return self._plain()
            return True
        self.drafted_run = 0
        self.waited += 1
        if self.waited > self.backoff:
            self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)
            return self._probe()
        return self._plain()

    def _plain(self) -> bool:
        self.plain_steps += 1
        return False

    def _probe(self) -> bool:
        self.probing, self.waited = True, 0
        self.probes += 1
        return True
