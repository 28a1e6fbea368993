"""Multi-turn sessions as one training sample, token-in/token-out (walkthrough Ch. 6-7; issue 14).

An agent session is a growing context: each model call sees the previous context plus a
*delta* (the environment's observation, a tool result, a user message) and appends its own
response. The trainer must consume exactly the token ids the engine saw and generated —
re-tokenising rendered text is not injective and silently corrupts the gradient — so the
session is assembled from token ids only:

* every call's prompt ids must **extend the session's ids exactly** (prefix property of
  token-in/token-out); the extension is the delta, recorded as non-policy tokens
  (``policy_mask`` False: never imitate the environment, walkthrough Ch. 6);
* the call's completion ids are appended with their behaviour log-probs and per-token
  versions (``policy_mask`` True) and form one trainable span (the unit of Eq. 30's process
  weights);
* the call's routing record (R3) is appended: an engine with persisted KV routes only the
  positions it had not fed before (the previous call's last token and the delta); a record
  starting earlier is cut to the new positions, one leaving a gap is an error.

A harness that re-renders history differently breaks the prefix property. ``on_mismatch``
chooses: ``error`` (default) or ``split`` — close the current sample and start a new one
from this call (prime-rl's approach to non-prefix histories); all pieces of a session share
its reward and advantage. Trailing non-policy tokens after the last call carry no loss and
are dropped from the sample.
"""

from __future__ import annotations

from typing import Literal, Sequence

from megatron_s2.posttrain.orchestrator.sample import RolloutSample
from megatron_s2.posttrain.routing import RoutingRecord

__all__ = ["TokenMismatch", "SessionBuilder"]


class TokenMismatch(ValueError):
    """A model call's prompt ids do not extend the session's ids (token-in/token-out broken)."""


class SessionBuilder:
    """Accumulates the model calls of one session into rollout samples."""

    def __init__(self, sample_id: int, *, on_mismatch: Literal["error", "split"] = "error"):
        if on_mismatch not in ("error", "split"):
            raise ValueError(f"on_mismatch must be 'error' or 'split', got {on_mismatch!r}")
        self.sample_id, self.on_mismatch = sample_id, on_mismatch
        self._pieces: list[RolloutSample] = []
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[int] = []
        self.policy_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self.weights: list[float] = []
        self.routing: list[RoutingRecord] = []
        self.prompt_length = 0

    @property
    def routed_end(self) -> int:
        return self.routing[-1].end if self.routing else 0

    def add_model_call(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float],
                       versions: Sequence[int] | int, routing: RoutingRecord | None = None,
                       process_weight: float = 1.0) -> None:
        """Append one engine call: its full prompt ids (the whole context it was given), the ids it
        generated with their log-probs and policy versions, and its routing record."""
        prompt_ids, completion_ids = list(prompt_ids), list(completion_ids)
        if isinstance(versions, int):
            versions = [versions] * len(completion_ids)
        if not (len(completion_ids) == len(logprobs) == len(versions)):
            raise ValueError(f"model call: {len(completion_ids)} completion ids, {len(logprobs)} log-probs, "
                             f"{len(versions)} versions")
        if prompt_ids[:len(self.tokens)] != self.tokens or len(prompt_ids) < len(self.tokens):
            at = next((i for i, (a, b) in enumerate(zip(prompt_ids, self.tokens)) if a != b),
                      min(len(prompt_ids), len(self.tokens)))
            if self.on_mismatch == "error":
                raise TokenMismatch(f"session {self.sample_id}: call {len(self.spans) + 1}'s prompt ids differ from "
                                    f"the session's ids at position {at} (history re-rendered or re-tokenised); "
                                    "pass token ids through unchanged, or use on_mismatch='split'")
            self._close_piece()
        first_call = not self.tokens
        delta = prompt_ids[len(self.tokens):]
        self.tokens += delta
        self.policy_mask += [False] * len(delta)
        self.logprobs += [0.0] * len(delta)
        self.versions += [-1] * len(delta)
        if first_call:
            self.prompt_length = len(prompt_ids)
        start = len(self.tokens)
        self.tokens += completion_ids
        self.policy_mask += [True] * len(completion_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.spans.append((start, len(self.tokens)))
        self.weights.append(float(process_weight))
        if routing is not None:
            self._add_routing(routing)
        elif self.routing:
            raise ValueError(f"session {self.sample_id}: call {len(self.spans)} has no routing record but earlier "
                             "calls had one; R3 needs every fed position")

    def _add_routing(self, record: RoutingRecord) -> None:
        fed_end = len(self.tokens) - 1  # the last generated token is not fed yet
        if record.start > self.routed_end:
            raise ValueError(f"session {self.sample_id}: routing record starts at position {record.start}, "
                             f"positions {self.routed_end}..{record.start - 1} were never routed")
        if record.end != fed_end:
            raise ValueError(f"session {self.sample_id}: routing record ends at {record.end}, the call fed "
                             f"positions up to {fed_end}")
        if self.routing and record.start < self.routed_end:
            record = record.slice(self.routed_end, record.end)
        elif not self.routing and record.start != 0:
            raise ValueError(f"session {self.sample_id}: the first routing record must start at position 0")
        if len(record):
            self.routing.append(record)

    def _close_piece(self) -> None:
        if self.spans:
            end = self.spans[-1][1]  # trailing environment tokens carry no loss: drop them
            routing = RoutingRecord.concatenate(self.routing).slice(0, end - 1) if self.routing else None
            self._pieces.append(RolloutSample(
                self.sample_id, self.tokens[:end], self.policy_mask[:end], self.logprobs[:end], self.versions[:end],
                prompt_length=self.prompt_length, routing=routing, spans=list(self.spans),
                process_weights=list(self.weights)))
        self._reset()

    def build(self, reward: float | None = None, finish_reason: str = "stop") -> list[RolloutSample]:
        """The session's samples (one unless a mismatch split it), all carrying ``reward``."""
        self._close_piece()
        pieces, self._pieces = self._pieces, []
        for p in pieces:
            p.reward, p.finish_reason = reward, finish_reason
        return pieces
