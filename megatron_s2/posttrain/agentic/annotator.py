"""The deterministic process annotator (walkthrough Ch. 7, "Process-aware advantage control").

"A process annotator attaches an adv_penalty to the specific assistant message exhibiting a
deterministic process error." No model judges anything: per assistant segment, in this order,

=====================================================  =============================  =======
check                                                  category                       default
=====================================================  =============================  =======
a tool call does not parse (or there is none)         malformed output               0.0
a call names a tool not in the registry                invalid tool name              0.0
a call identical to an earlier call that failed        repeated failed call           -0.5
the session was cut after it (turns, context, time)    context/turn/session-limit     -0.5
otherwise                                                                             1.0
=====================================================  =============================  =======

(the walkthrough's ``annotate`` pseudocode; weights in ``process_annotator.*``). The weights feed
Eq. 30 (:func:`megatron_s2.posttrain.advantages.session_credit.segment_advantages`), which applies
them only to positive advantages: a failed session keeps its full negative signal on every
segment. The annotator never touches the reward, only the weight.
"""

from __future__ import annotations

from typing import Sequence

from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig
from megatron_s2.posttrain.agentic.tools import TOOLS
from megatron_s2.posttrain.agentic.transcript import Segment

__all__ = ["annotate", "process_weights", "LIMIT_STOPS"]

LIMIT_STOPS = ("turn_limit", "context_limit", "session_limit")
"""How a session can be cut short (walkthrough: "context-, turn-, or session-limit termination")."""


def annotate(segment: Segment, failed_before: set[str],
             config: ProcessAnnotatorConfig = ProcessAnnotatorConfig()) -> tuple[float, str]:
    """(weight, category) of one assistant segment; ``failed_before``: keys of the session's
    earlier calls that failed."""
    parsed = segment.parsed
    if parsed is None or parsed.malformed:
        return config.malformed, "malformed"
    if any(call.name not in TOOLS for call in parsed.calls):
        return config.invalid_tool, "invalid_tool"
    if any(call.key() in failed_before for call in parsed.calls):
        return config.repeated_failed_call, "repeated_failed_call"
    if segment.stop in LIMIT_STOPS:
        return config.limit_stop, "limit_stop"
    return config.clean, "clean"


def process_weights(transcript: Sequence[Segment],
                    config: ProcessAnnotatorConfig = ProcessAnnotatorConfig()) -> list[tuple[float, str]]:
    """(weight, category) of every trainable segment of a session, in order."""
    out, failed = [], set()
    for segment in transcript:
        if not segment.trainable:
            continue
        out.append(annotate(segment, failed, config))
        calls = segment.parsed.calls if segment.parsed else []
        failed |= {call.key() for call, result in zip(calls, segment.results) if not result.ok}
    return out
