"""One harness episode through the gateway: a trainable trace, graded, annotated, credited.

The walkthrough's ``rollout(harness, task)`` (Ch. 6, "The contract, as code")::

    env = task.setup()                                   # a fresh sandbox with the workspace
    harness.run(task.objective, env, model_url=gateway.url(session))
    reward = task.verify(env)                            # graded after the agent stops
    notes  = process_annotator.scan(session)             # deterministic, per policy segment

:func:`run_harness_episode` does exactly that with a :mod:`.harnesses` adapter and a gateway
that captures into a PrefixTree store (``megatron-s2 serve --gateway-traces DIR``, or a server
started in-process). The episode's
trace is the session's branches as :func:`~megatron_s2.serve.gateway.traces.read_samples` yields them:
the engine's exact token ids, the loss mask (context masked, responses trainable, skip-marked
steps out), log-probs, routed experts and segment boundaries. The process annotator
(:mod:`.annotator`) reads each policy segment in the one tool-call format (:mod:`.tools`) from
the node's rendered text, with the results of the calls the harness ran in the sandbox, and
gives its weight; :meth:`HarnessEpisode.token_advantages` is Eq. 30 on the exact token spans and
:func:`group_token_advantages` does the group-relative step over the sessions of one task.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig
from megatron_s2.posttrain.agentic.annotator import LIMIT_STOPS, process_weights
from megatron_s2.posttrain.agentic.grading import Grade, grade_workspace, workspace_tar
from megatron_s2.posttrain.agentic.harnesses import EpisodeTools, Harness, HarnessSettings
from megatron_s2.posttrain.agentic.runner import GIT_INIT
from megatron_s2.posttrain.agentic.sandbox import SandboxCrashed, SandboxRuntime
from megatron_s2.posttrain.agentic.tasks import AgenticTask
from megatron_s2.posttrain.agentic.tools import ToolCall, ToolResult, parse_tool_calls
from megatron_s2.posttrain.agentic.transcript import Segment
from megatron_s2.serve.gateway.traces import RESPONSE, TraceStore, TrainableSample, group_of, read_samples

__all__ = ["HarnessEpisode", "run_harness_episode", "group_token_advantages", "policy_segments", "session_samples"]


@dataclass
class HarnessEpisode:
    """What a trainer consumes from one harness episode (module docstring)."""

    task: str
    harness: str
    session: str
    reward: float
    status: str
    """'passed', 'failed', 'grader_error' or 'sandbox_crashed'."""
    stop_reason: str
    """The harness's: 'submitted', 'answered', 'turn_limit', 'context_limit', 'harness_error'; or 'sandbox_crashed'."""
    samples: list[TrainableSample] = field(default_factory=list)
    """The session's trace: one sample per branch, in call order (:func:`session_samples`); empty
    when the harness made no model call."""
    transcript: list[Segment] = field(default_factory=list)
    """One assistant segment per policy segment of ``samples`` (those they train), in order."""
    weights: list[float] = field(default_factory=list)
    """Process weight of each of those segments (Eq. 30's w_{i,k})."""
    categories: list[str] = field(default_factory=list)
    grade: Grade | None = None
    tool_log: list[tuple[ToolCall, ToolResult]] = field(default_factory=list)
    error: str = ""
    """The harness's error when it stopped with 'harness_error'."""

    def token_advantages(self, advantage: float) -> list[np.ndarray]:
        """Eq. 30 per token of each sample for session advantage ``advantage``: w * A on the tokens
        of each trainable response segment when A > 0, A when A <= 0; 0 on context and skipped steps."""
        from megatron_s2.posttrain.advantages.session_credit import segment_advantages  # torch: training only

        values = iter(segment_advantages(advantage, self.weights))
        out = []
        for sample in self.samples:
            adv = np.zeros(len(sample.token_ids), np.float32)
            for segment in sample.segments:
                if segment.kind == RESPONSE and segment.trainable:
                    adv[segment.start:segment.end] = next(values)
            out.append(adv)
        return out


def session_samples(trace_dir: str | Path, session: str) -> list[TrainableSample]:
    """The session's branches (:func:`~megatron_s2.serve.gateway.traces.read_samples`), each response
    trainable in exactly one of them: a harness that keeps its history verbatim leaves one branch; one
    that re-renders it (smolagents writes earlier calls back as its own text) leaves one branch per
    call, and a response two branches share trains in the first only (context in the others: a
    tree node's prefix is unique, so the copies would be the same computation; training one counts
    every sampled token once — :mod:`~megatron_s2.posttrain.episode_rows`)."""
    seen, out = set(), []
    for sample in read_samples(trace_dir, [group_of(session)]):
        if sample.session != session:
            continue
        for k, segment in enumerate(sample.segments):
            if segment.kind == RESPONSE and segment.trainable and segment.node in seen:
                sample.loss_mask[segment.start:segment.end] = False
                sample.segments[k] = replace(segment, trainable=False)
            seen.add(segment.node)
        out.append(sample)
    return out


def policy_segments(samples: list[TrainableSample], store: TraceStore,
                    tool_log: list[tuple[ToolCall, ToolResult]], stop_reason: str) -> list[Segment]:
    """The samples' trainable response segments as annotator input: each node's rendered text parsed
    in the one tool-call format, with the results of the calls the harness ran, matched in order."""
    pending, out = list(tool_log), []
    for sample in samples:
        tree = store.tree(sample.group)
        for span in sample.segments:
            if span.kind != RESPONSE or not span.trainable:
                continue
            text = tree.nodes[span.node].text
            segment = Segment("assistant", text, parse_tool_calls(text))
            for call in segment.parsed.calls:
                if pending and pending[0][0].key() == call.key():
                    segment.results.append(pending.pop(0)[1])
            out.append(segment)
    if out and stop_reason in LIMIT_STOPS:
        out[-1].stop = stop_reason
    return out


def run_harness_episode(task: AgenticTask, harness: Harness, runtime: SandboxRuntime, *, server_url: str,
                        session: str, trace_dir: str | Path, settings: HarnessSettings = HarnessSettings(),
                        annotator: ProcessAnnotatorConfig = ProcessAnnotatorConfig()) -> HarnessEpisode:
    """Play ``task`` with ``harness`` against gateway session ``session`` (module docstring)."""
    stop, agent_tar, tools = "harness_error", None, None
    try:
        with runtime.open() as box:
            box.import_tar(workspace_tar(task))
            box.run(GIT_INIT)
            tools = EpisodeTools(box)
            stop = harness.run(task.prompt, tools, server_url, session, settings)
            agent_tar = box.export_tar()
    except SandboxCrashed:
        stop = "sandbox_crashed"
    # the agent's sandbox is closed: nothing it started still runs while it is graded
    grade = grade_workspace(task, agent_tar, runtime) if agent_tar is not None else None
    log, error = (tools.log, tools.error) if tools is not None else ([], "")
    samples = session_samples(trace_dir, session)
    episode = HarnessEpisode(task.name, harness.name, session, grade.reward if grade else 0.0,
                             grade.status if grade else "sandbox_crashed", stop, samples, grade=grade, tool_log=log,
                             error=error)
    if samples:
        episode.transcript = policy_segments(samples, TraceStore(trace_dir), log, stop)
        annotated = process_weights(episode.transcript, annotator)
        episode.weights, episode.categories = [w for w, _ in annotated], [c for _, c in annotated]
    return episode


def group_token_advantages(group: list[HarnessEpisode]) -> list[list[np.ndarray]]:
    """Credit for a group of sessions of one task (walkthrough Ch. 7): the leave-one-out advantage
    of each complete-session reward (worked example 22) through Eq. 30 onto the exact token spans
    of that session's policy segments."""
    from megatron_s2.posttrain.advantages.group import leave_one_out_advantages  # torch: training only

    advantages = leave_one_out_advantages([episode.reward for episode in group]).tolist()
    return [episode.token_advantages(a) for episode, a in zip(group, advantages)]
