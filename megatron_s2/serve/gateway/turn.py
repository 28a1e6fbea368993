"""One model call of any protocol: prompt (TITO), engine request, parsed events, capture.

:func:`start_turn` checks and submits the call; :class:`RunningTurn` yields the parsed
:class:`~.tool_format.TextDelta` / :class:`~.tool_format.ToolCall` events as tokens arrive
(streaming) or the whole :class:`TurnOutput`. When the call belongs to a session and it finished,
it is recorded in the trace store before the protocol's last event is sent. A call of an RL
rollout's session that sends no seed is seeded from its episode's (``ServerState.session_seeds``,
:func:`session_call_seed`), so the episode is reproducible whichever engine or server answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from http import HTTPStatus

from starlette.concurrency import run_in_threadpool

from megatron_s2.inference.request import CompletedRequest
from megatron_s2.inference.sampling import call_seed
from megatron_s2.serve.backend import Generation
from megatron_s2.serve.chat import _renders_text
from megatron_s2.serve.errors import BadRequest, HTTPError
from megatron_s2.serve.gateway.conversation import Turn, assistant_message
from megatron_s2.serve.gateway.tito import Capture, PromptPlan
from megatron_s2.serve.gateway.tool_choice import apply_tool_choice, tool_choice_mode
from megatron_s2.serve.gateway.tool_format import OutputParser, ToolCall
from megatron_s2.serve.sampling import build_sampling, refuse_unsupported_sampling
from megatron_s2.serve.state import ServerState, new_id

__all__ = ["TurnOutput", "RunningTurn", "start_turn", "check_gateway_tokenizer", "TraceWriteFailed", "session_call_seed"]


class TraceWriteFailed(HTTPError):
    """The call ran but the trace store could not write it (503: the server's disk, not the request)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    kind = "ServiceUnavailableError"


@dataclass
class TurnOutput:
    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    """The engine's: ``stop`` or ``length`` (each protocol names it its own way)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


class RunningTurn:
    def __init__(self, state: ServerState, turn: Turn, plan: PromptPlan, gen: Generation, capture: Capture | None):
        self.state, self.turn, self.plan, self.gen, self.capture = state, turn, plan, gen, capture
        self.parser = OutputParser(state.tokenizer)
        self.result = CompletedRequest(gen.request_id, plan.ids)
        self.output = TurnOutput(prompt_tokens=len(plan.ids))

    async def events(self):
        """Parsed events until the call finished (then :attr:`output` is complete and recorded)."""
        async for _, out in self.gen.events():
            self.result.add(out)
            for event in self.parser.push(out.token_ids, last=out.finished):
                yield event
        reason = self.result.finish_reason
        self.output = TurnOutput(self.parser.text["text"], self.parser.text["reasoning"], list(self.parser.calls),
                                 reason.value if reason is not None else None, len(self.plan.ids),
                                 len(self.result.token_ids), list(self.result.token_ids))
        if self.capture is not None and self.plan.session is not None:
            message = assistant_message(self.output.text, self.output.reasoning, self.output.calls)
            try:
                await run_in_threadpool(self.capture.record, self.state.tokenizer, self.turn, self.plan, message,
                                        self.result, self.output.finish_reason)
            except OSError as exc:  # a full or failing disk: the protocol's own error (an event mid-stream)
                raise TraceWriteFailed(f"the trace store could not record this call ({exc.strerror or exc}); it "
                                       "was not captured: free space in the --gateway-traces directory and retry"
                                       ) from None

    async def complete(self) -> TurnOutput:
        async for _ in self.events():
            pass
        return self.output


_NOT_HERE = {"logprobs": False, "top_logprobs": None, "echo": False, "prompt_logprobs": None,
             "response_format": None, "continue_final_message": False, "add_generation_prompt": True,
             "chat_template": None, "documents": None, "truncate_prompt_tokens": None, "guided_json": None,
             "guided_regex": None, "guided_choice": None, "guided_grammar": None, "best_of": None,
             "use_beam_search": False}
"""Chat Completions / vLLM fields the gateway's turns do not implement (refused unless neutral)."""


def session_call_seed(seed: int, call: int) -> int:
    """The seed of a rollout session's ``call``-th model call (``ServerState.session_seeds``): one
    stream per call of the episode, as the task episodes' calls are seeded (:func:`call_seed`)."""
    return call_seed(seed, call)


def check_gateway_tokenizer(tokenizer, field: str) -> None:
    if not _renders_text(tokenizer) or not OutputParser.supported(tokenizer):
        raise BadRequest(f"{field}: this model's tokenizer ({type(tokenizer).__name__}) has no text chat template with "
                         "the reasoning and tool-call tokens this endpoint parses; use /v1/completions or "
                         "/inference/v1/generate", param=field)


async def start_turn(state: ServerState, request, turn: Turn, session: str | None, capture: Capture | None):
    """Render (TITO in a session), check and submit ``turn``: a :class:`RunningTurn`."""
    check_gateway_tokenizer(state.tokenizer, turn.prompt_field)
    f = turn.fields
    if f.has("n") and f.raw("n") != 1:
        f.fail("n", "one choice per call on this endpoint; send n: 1 or leave it out")
    refuse_unsupported_sampling(f)
    choice = tool_choice_mode(turn)
    for key in _NOT_HERE:
        f.refuse_unless_default(key, _NOT_HERE[key], "not supported on the gateway protocols (tools or a session "
                                                     "endpoint); leave it out")
    for key in ("stop", "stop_sequences"):
        if f.raw(key) not in (None, [], ""):
            f.fail(key, "stop sequences are not supported on this endpoint (the parsed text and the captured tokens "
                        "would disagree); leave it out")
    tokenizer = state.tokenizer

    def refuse_overlong(text: str) -> None:
        state.refuse_overlong_text([text], turn.prompt_field)

    # rendering, matching and tokenising run on a worker thread, off the event loop all clients share
    if session is not None and capture is not None:
        plan = await run_in_threadpool(capture.plan, tokenizer, turn, session, refuse_overlong)
    else:
        plan = await run_in_threadpool(Capture.plain, tokenizer, turn, refuse_overlong)
    params = build_sampling(f, prompt_len=len(plan.ids), max_model_len=state.max_model_len,
                            vocab_size=state.vocab_size, logprobs=0, strict_total=True,
                            prompt_field=turn.prompt_field, max_tokens_keys=turn.max_tokens_keys,
                            max_stops=state.config.max_stops, logprobs_mode=state.config.logprobs_mode,
                            record_routing=plan.session is not None)
    params = apply_tool_choice(params, choice, tokenizer)
    episode_seed = state.session_seeds.get(plan.session) if plan.session is not None else None
    if params.seed is None and episode_seed is not None:  # .get: the episode may end (pop) meanwhile
        params = replace(params, seed=session_call_seed(episode_seed, len(capture.store.session_calls(plan.session))))
    gen = Generation(state.backend, new_id("turn"), request, state.config.disconnect_poll_s)
    gen.add(0, plan.ids, params)
    return RunningTurn(state, turn, plan, gen, capture)

