"""Speculative decoding in the engine: draft, schedule, verify in one forward, keep, roll back
(DSpark, report §2.4.3; lossless verification, Leviathan et al. / Chen et al., 2023).

One decode step of the requests that speculate:

1. **Draft.** The executor's :class:`~megatron_s2.models.family.engine.Drafter` proposes base
   logits for ``K`` positions of every request at once; the Markov bias of the previous token
   is added position by position while the drafts are drawn from ``q`` = the request's
   sampling distribution (temperature / top-k / top-p) of those logits (greedy: arg-max).
2. **Schedule.** Before drafting, :class:`~.speculation_schedule.DraftGate` decides whether
   drafting pays at the current batch size — the measured per-position acceptance against the
   engine's measured step times, plain vs speculative — and otherwise decodes plainly, probing
   with exponential back-off (:mod:`~.speculation_schedule`). After drafting, the confidence
   head's per-position acceptance probabilities, calibrated by the measured acceptance, give
   prefix survival; with the engine's throughput curve (measured from its own forwards, or a
   profile file) :func:`~.speculative.choose_verification_lengths` picks how many drafts each
   request verifies so that expected tokens per second over the batch is largest
   (``speculative_schedule: fixed`` drafts at every step and verifies all of them).
3. **Verify.** One forward over ``[seed, d_1 .. d_k]`` per request returns the policy's logits at
   every position; greedy keeps the drafts equal to the arg-max (the same tokens as plain greedy
   decode), sampling keeps each with probability ``min(1, p/q)`` and draws the first rejected
   position from ``normalize(max(0, p - q))`` — or a bonus token from the last row — so the
   output follows the policy's distribution exactly.
4. **Keep.** The executor rolls its cache back to the kept tokens (:meth:`rollback`: rejected
   positions leave no KV behind); every emitted token carries its log-prob from the policy's
   logits, the policy version and — for routing replay — the routing of the forward's kept rows.

Every draw is seeded from (request seed, position) like the plain sampler, with one stream for
drafting and one for verification, so a request's output does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference.sampling import position_seed, sampling_log_probs_rows
from megatron_s2.inference.speculation_schedule import AcceptanceEstimate, DraftGate, StepCosts
from megatron_s2.inference.speculative import (ThroughputProfile, choose_verification_lengths, prefix_survival,
                                               speculative_sample, verify_greedy)

__all__ = ["SpeculativeDecoder", "SpeculationStats"]

_DRAFT_STREAM = 0x2545F4914F6CDD1D   # seed salts: drafting and verification draw from their own streams
_VERIFY_STREAM = 0x5851F42D4C957F2D


@dataclass
class SpeculationStats:
    """What speculation achieved since the engine started."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    """Rounds whose position i draft was accepted (index i)."""
    verified_at: list[int] = field(default_factory=list)
    """Rounds that verified a draft at position i."""

    def record(self, verified: int, accepted: int, emitted: int) -> None:
        k = max(verified, len(self.verified_at))
        self.verified_at += [0] * (k - len(self.verified_at))
        self.accepted_at += [0] * (k - len(self.accepted_at))
        for i in range(verified):
            self.verified_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        self.rounds += 1
        self.drafted += verified
        self.accepted += accepted
        self.emitted += emitted

    def as_dict(self) -> dict:
        per_position = [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at)]
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "acceptance_per_position": per_position,
                "tokens_per_round": self.emitted / self.rounds if self.rounds else 0.0}


class SpeculativeDecoder:
    def __init__(self, executor, config, device: torch.device):
        self.executor, self.drafter, self.config, self.device = executor, executor.drafter, config, device
        if config.speculative_tokens > self.drafter.block_size:   # was capped without a word (review57)
            raise ConfigError(f"speculative_tokens: {config.speculative_tokens} drafts a round asked, but this "
                              f"checkpoint's drafter proposes at most {self.drafter.block_size} "
                              f"(model.dspark_block_size); give 1..{self.drafter.block_size}, or 0 for all")
        self.max_drafts = config.speculative_tokens or self.drafter.block_size
        self.stats = SpeculationStats()
        fixed_profile = None
        if config.speculative_profile:
            try:
                fixed_profile = ThroughputProfile.from_json(Path(config.speculative_profile))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"speculative_profile: {exc}") from None
        self.costs = StepCosts(fixed_profile)
        self.estimate = AcceptanceEstimate(self.max_drafts)
        self.gate = DraftGate(self.max_drafts)
        self.speculative_steps = 0

    def report(self) -> dict:
        """What speculation achieved (:class:`SpeculationStats`: ``rounds`` counts requests'
        verifications), the decode steps that drafted and those the gate left plain, its probes,
        and the measured conditional acceptance per position."""
        return {**self.stats.as_dict(), "speculative_steps": self.speculative_steps,
                "plain_steps": self.gate.plain_steps, "probes": self.gate.probes,
                "refreshes": self.gate.refreshes,
                "estimated_acceptance": [round(r, 4) for r in self.estimate.rates()]}

    def should_draft(self, batch: int) -> bool:
        """Whether this decode step of ``batch`` requests drafts (``fixed``: always)."""
        drafts = self.config.speculative_schedule == "fixed" or self.gate.decide(batch, self.estimate, self.costs)
        self.speculative_steps += drafts
        return drafts

    # ---- 1. draft ---------------------------------------------------------------------------------
    def draft(self, reqs) -> tuple[list[list[int]], list[torch.Tensor | None], torch.Tensor]:
        """Per request: K draft tokens, their draft distributions [K, V] (None for greedy), and
        the confidence head's acceptance probabilities [R, K]."""
        base, hidden = self.drafter.propose(reqs)
        k = self.max_drafts
        prev = torch.tensor([r.tokens[r.num_computed] for r in reqs], dtype=torch.long, device=self.device)
        drafts = [[] for _ in reqs]
        dists = [[] if not r.params.greedy else None for r in reqs]
        embeds = []
        # requests sharing their sampling settings are processed as one batch of rows
        by_params: dict = {}
        for r, req in enumerate(reqs):
            by_params.setdefault(req.params.greedy or (req.params.temperature, req.params.top_k, req.params.top_p),
                                 []).append(r)
        for i in range(k):
            bias, emb = self.drafter.markov(prev)
            embeds.append(emb)
            logits = base[:, i] + bias
            nxt = [0] * len(reqs)
            for key, rows in by_params.items():
                if key is True:  # greedy
                    for r, tok in zip(rows, logits[rows].argmax(-1).tolist()):
                        nxt[r] = tok
                    continue
                q = sampling_log_probs_rows(logits[rows], reqs[rows[0]].params).exp()
                # one uniform per request from its own (seed, position) stream: inverse CDF
                u = torch.empty(len(rows), dtype=q.dtype, device=q.device)
                for j, r in enumerate(rows):
                    req = reqs[r]
                    req.generator.manual_seed(position_seed(req.seed ^ _DRAFT_STREAM, req.num_computed + 1 + i))
                    u[j] = torch.rand((), generator=req.generator, device=q.device, dtype=q.dtype)
                cdf = q.cumsum(-1)
                picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                picks = torch.minimum(picks, (q > 0).cumsum(-1).argmax(-1))  # never past the last kept token
                for j, (r, tok) in enumerate(zip(rows, picks.tolist())):
                    nxt[r] = tok
                    dists[r].append(q[j])
            for r, tok in enumerate(nxt):
                drafts[r].append(tok)
            prev = torch.tensor(nxt, dtype=torch.long, device=self.device)
        confidence = self.drafter.confidence(hidden[:, :k], torch.stack(embeds, dim=1))
        return drafts, [torch.stack(d) if d is not None else None for d in dists], confidence

    # ---- 2. schedule ------------------------------------------------------------------------------
    def lengths(self, reqs, confidence: torch.Tensor, limits: list[int]) -> list[int]:
        """Drafts each request verifies: at most ``limits[r]`` (its room to max_tokens /
        max_model_len / the page pool); a probe verifies at least one where there is room."""
        if self.config.speculative_schedule == "fixed":
            return [min(self.max_drafts, lim) for lim in limits]
        # the head ranks requests and positions; the measured acceptance sets its level
        factors = torch.tensor(self.estimate.calibration(), dtype=torch.float32)
        calibrated = (confidence.float().cpu().clamp(0, 1) * factors).clamp(0, 1)  # no-ops on the engine's host copy
        rest = self.costs.speculative_rest
        chosen = choose_verification_lengths(prefix_survival(calibrated), self.costs.forward_profile(),
                                             draft_seconds=rest(len(reqs)) if rest.known else 0.0)
        floor = 1 if self.gate.probing else 0
        return [min(max(c, floor), lim) for c, lim in zip(chosen, limits)]

    # ---- 3. verify ------------------------------------------------------------------------------
    def accept(self, req, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None
               ) -> tuple[int, int]:
        """(drafts kept, the token emitted after them) from the policy's logits [k+1, V]."""
        k = len(drafts)
        d = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        if req.params.greedy:
            return verify_greedy(logits, d)
        p = sampling_log_probs_rows(logits, req.params).exp()
        req.generator.manual_seed(position_seed(req.seed ^ _VERIFY_STREAM, len(req.tokens)))
        accepted, token = speculative_sample(p.unsqueeze(0), q[:k].unsqueeze(0) if k else p[:0].unsqueeze(0),
                                             d.unsqueeze(0), req.generator)
        return int(accepted[0]), int(token[0])

    def record(self, verified: int, accepted: int, head: list[float]) -> None:
        """One request's verification: statistics and the acceptance estimate."""
        self.stats.record(verified, accepted, accepted + 1)
        self.estimate.record(verified, accepted, head)

    def observe_plain(self, batch: int, forward_s: float, step_s: float) -> None:
        """A plain decode step of ``batch`` requests: its forward and its whole time."""
        self.costs.observe_plain(batch, forward_s, step_s)

    def observe_speculative(self, batch: int, tokens: int, forward_s: float, step_s: float) -> None:
        """A speculative step: its verification forward over ``tokens`` tokens and its whole time."""
        self.costs.observe_speculative(batch, tokens, forward_s, step_s)
