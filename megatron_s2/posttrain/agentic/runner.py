"""One agentic episode end to end: sandbox -> policy/tool loop -> grading -> process weights.

The policy is a plain callable ``messages -> assistant text`` (chat messages ``{"role",
"content"}`` and, canonically, ``tool_calls`` / ``tool_call_id``; tool calls written in the chat
template's format of :mod:`.tools`, the gateway's), so anything can drive it — a
scripted agent in tests, an engine, a client of the HTTP gateway — and this module knows nothing
of HTTP or of the trainer. :func:`run_episode` returns what a trainer consumes: the transcript
labelled policy / observation per segment, the session's reward (grading, :mod:`.grading`) and
the annotator's weight per policy segment (:mod:`.annotator`); with the group-relative
advantage A_i of the session, :meth:`EpisodeResult.segment_advantages` gives Eq. 30's value of
every segment (0 on observations); :func:`group_segment_advantages` does both steps for a group
of sessions of one task. On the token side, each policy segment is one
``SessionBuilder.add_model_call(..., process_weight=w)`` (:mod:`megatron_s2.posttrain.multiturn`).

An episode that crashes its sandbox is a failed trajectory (report §5.1.3: "we treat the crash
as a failed trajectory"): reward 0, status ``sandbox_crashed``, training goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig
from megatron_s2.posttrain.agentic.annotator import LIMIT_STOPS, process_weights
from megatron_s2.posttrain.agentic.grading import Grade, grade_workspace, workspace_tar
from megatron_s2.posttrain.agentic.sandbox import SandboxCrashed, SandboxRuntime
from megatron_s2.posttrain.agentic.tasks import AgenticTask
from megatron_s2.posttrain.agentic.tools import execute, format_call, malformed_observation, parse_tool_calls, tools_prompt
from megatron_s2.posttrain.agentic.transcript import Segment

__all__ = ["Policy", "EpisodeResult", "run_episode", "scripted_policy", "group_segment_advantages"]

Policy = Callable[[list[dict]], str]

GIT_INIT = ("command -v git >/dev/null || exit 0; git init -q && git add -A && "
            "git -c user.name=task -c user.email=task@sandbox commit -qm 'task: starting state'")
"""The workspace as a fresh one-commit repository: the agent may diff its work, and there is no
history that could hold the fix (the seed's SWE-Bench Pro git-log leak)."""


@dataclass
class EpisodeResult:
    """What a trainer consumes from one episode (module docstring)."""

    task: str
    transcript: list[Segment]
    reward: float
    status: str
    """'passed', 'failed', 'grader_error' (from grading) or 'sandbox_crashed'."""
    stop_reason: str
    """'submitted', 'turn_limit', 'context_limit', 'session_limit' or 'sandbox_crashed'."""
    weights: list[float] = field(default_factory=list)
    """Process weight of each policy segment, in order (Eq. 30's w_{i,k})."""
    categories: list[str] = field(default_factory=list)
    """The annotator's category of each policy segment ('clean', 'malformed', ...)."""
    grade: Grade | None = None

    @property
    def labels(self) -> list[str]:
        """'policy' or 'observation' per transcript segment."""
        return [s.label for s in self.transcript]

    def segment_advantages(self, advantage: float) -> list[float]:
        """Eq. 30 per transcript segment for session advantage ``advantage``: w * A on policy
        segments when A > 0, A when A <= 0; 0 on observations."""
        # imported here: the advantages package imports torch, which an episode never needs
        from megatron_s2.posttrain.advantages.session_credit import labelled_segment_advantages

        return labelled_segment_advantages(advantage, [s.trainable for s in self.transcript], self.weights)

    def to_dict(self) -> dict:
        return {"task": self.task, "reward": self.reward, "status": self.status, "stop_reason": self.stop_reason,
                "segments": [{"role": s.role, "label": s.label, "text": s.text} for s in self.transcript],
                "weights": self.weights, "categories": self.categories,
                "tests": self.grade.results if self.grade else {}}


def _observe(segment: Segment, box) -> list[Segment]:
    """Run the tool calls of an assistant segment; their observations, in order."""
    out = []
    for reason in segment.parsed.malformed:
        out.append(Segment("tool", malformed_observation(reason)))
    for k, call in enumerate(segment.parsed.calls):
        result = execute(call, box)
        segment.results.append(result)
        out.append(Segment("tool", result.observation, call_id=f"{segment.call_id}-{k}"))
        if result.done:
            break
    return out


def run_episode(task: AgenticTask, policy: Policy, runtime: SandboxRuntime, *, max_turns: int = 16,
                max_context_chars: int = 64_000, max_session_s: float | None = None,
                annotator: ProcessAnnotatorConfig = ProcessAnnotatorConfig()) -> EpisodeResult:
    """Roll ``policy`` out on ``task`` in a fresh sandbox of ``runtime`` and grade it. The session
    stops at ``max_turns`` answers, at ``max_context_chars`` of transcript, or after
    ``max_session_s`` seconds from the moment its workspace is ready (the walkthrough's "context-,
    turn-, or session-limit termination")."""
    transcript = [Segment("system", tools_prompt()), Segment("user", task.prompt)]
    stop, agent_tar = "turn_limit", None
    try:
        with runtime.open() as box:
            box.import_tar(workspace_tar(task))
            box.run(GIT_INIT)
            # the agent's clock starts once its workspace is ready: setting the sandbox up is the
            # infrastructure's time, and on a loaded machine it would eat a short budget whole
            session_end = None if max_session_s is None else time.monotonic() + max_session_s
            for turn in range(max_turns):
                if sum(len(s.text) for s in transcript) > max_context_chars:
                    stop = "context_limit"
                    break
                if session_end is not None and time.monotonic() >= session_end:
                    stop = "session_limit"
                    break
                text = policy([s.message() for s in transcript])
                segment = Segment("assistant", text, parse_tool_calls(text), call_id=f"call_{turn}")
                transcript.append(segment)
                transcript += _observe(segment, box)
                if any(r.done for r in segment.results):
                    stop = "submitted"
                    break
            agent_tar = box.export_tar()
    except SandboxCrashed:
        stop = "sandbox_crashed"
    if stop in LIMIT_STOPS:
        last_policy = next((s for s in reversed(transcript) if s.trainable), None)
        if last_policy is not None:
            last_policy.stop = stop
    # the agent's sandbox is closed: nothing it started still runs while it is graded
    grade = grade_workspace(task, agent_tar, runtime) if agent_tar is not None else None
    status = grade.status if grade else "sandbox_crashed"
    annotated = process_weights(transcript, annotator)
    return EpisodeResult(task.name, transcript, grade.reward if grade else 0.0, status, stop,
                         [w for w, _ in annotated], [c for _, c in annotated], grade)


def group_segment_advantages(group: Sequence[EpisodeResult]) -> list[list[float]]:
    """Credit for a group of sessions of one task (walkthrough Ch. 7): the leave-one-out advantage
    of each complete-session reward (Eq. 27, worked example 22), broadcast through Eq. 30 to every
    segment of that session (0 on observations)."""
    from megatron_s2.posttrain.advantages.group import leave_one_out_advantages  # torch: only when training

    advantages = leave_one_out_advantages([result.reward for result in group]).tolist()
    return [result.segment_advantages(a) for result, a in zip(group, advantages)]


def scripted_policy(calls: Sequence[dict]) -> Policy:
    """A policy that makes ``calls`` (``{"name", "arguments"}``) one per turn, then submits —
    the tasks' reference solutions, and the attacks of the integrity tests."""
    def policy(messages: list[dict]) -> str:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn < len(calls):
            return format_call(calls[turn]["name"], calls[turn].get("arguments", {}))
        return format_call("submit", {})
    return policy
