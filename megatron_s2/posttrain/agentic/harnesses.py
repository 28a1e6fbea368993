"""Real, unmodified third-party agent harnesses playing the embedded tasks through the gateway.

Walkthrough Ch. 6 ("White box and black box"): the harness runs its *own* loop, prompts, tool
plumbing and stop rule, and thinks it calls an ordinary model API; it is pointed at a session
base URL of the gateway (:mod:`megatron_s2.serve.gateway.routes`), which captures every call
token-in / token-out into the PrefixTree store. What each harness is given:

==================  ==================================================  ==========================
harness             the library, as installed from the package index     protocol
==================  ==================================================  ==========================
``openai_agents``   OpenAI Agents SDK (``openai-agents``): ``Agent`` +    Chat Completions
                    ``FunctionTool`` + ``Runner``, stops at ``submit``   (``api="responses"``:
                    (``StopAtTools``)                                    Responses)
``anthropic``       the ``anthropic`` client's Messages API in the       Anthropic Messages
                    canonical client tool loop (``tool_use`` ->
                    ``tool_result``)
``smolagents``      ``smolagents.ToolCallingAgent`` with its own          Chat Completions
                    ReAct prompts and ``OpenAIModel``
``builtin``         our own minimal Chat Completions tool loop (the      Chat Completions
                    white-box reference)
==================  ==================================================  ==========================

The sandbox's tools (:data:`~.tools.TOOLS`: bash, read_file, write_file, submit) are declared as
each harness's **native function tools**; invoking one runs it in the episode's sandbox through
:class:`EpisodeTools`, which logs every call and its result (what the process annotator weighs).
No harness code is patched: only its public extension points are used (function tools, model
classes, step callbacks). Each ``run`` returns why the harness stopped: ``submitted``,
``answered`` (it ended its loop without submitting), ``turn_limit``, ``context_limit`` (the
gateway refused a call for the context length and the harness gave up on that error — smolagents
wraps it in its own ``AgentGenerationError``: :func:`ran_out_of_context`) or ``harness_error``.
Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from megatron_s2.posttrain.agentic.sandbox import Sandbox
from megatron_s2.posttrain.agentic.tools import (ToolCall, ToolResult, execute, malformed_observation, tool_schemas,
                                                 tools_prompt)

__all__ = ["HarnessSettings", "EpisodeTools", "Harness", "HARNESSES", "make_harness", "ran_out_of_context",
           "session_urls"]

CONTEXT_LIMIT_MESSAGE = "maximum context length"
"""What the gateway's 400 says when a call does not fit the engine's context (vLLM's words,
:func:`megatron_s2.serve.sampling.check_prompt_length`)."""


def ran_out_of_context(exc: BaseException) -> bool:
    """Whether ``exc`` is the gateway's context-length refusal, or wraps one: a harness library may
    re-raise the client's error as its own (smolagents: ``AgentGenerationError("Error while generating
    output: ...") from e``), so the chain of causes is read, not only the outermost error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if CONTEXT_LIMIT_MESSAGE in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class HarnessSettings:
    """What every harness is told about the model it calls."""

    model: str = "policy"
    """The served model id."""
    max_turns: int = 8
    """Model calls the harness may make (its own turn limit where it has one)."""
    max_tokens: int = 128
    """Tokens per model call."""
    temperature: float = 1.0
    timeout_s: float = 600.0
    """Per HTTP request."""
    declare_tools: bool = True
    """``anthropic``: send the tools as the request's ``tools`` (JSON schemas the chat template
    renders into the prompt); False: declare none and name them in the system message only, as the
    builtin harness does (the gateway parses tool calls either way)."""


@dataclass
class EpisodeTools:
    """The sandbox's tools as a harness calls them: each call runs in ``box``; all are logged."""

    box: Sandbox
    log: list[tuple[ToolCall, ToolResult]] = field(default_factory=list)
    error: str = ""
    """Why the harness gave up, when it did ('harness_error')."""

    def failed(self, exc: BaseException) -> str:
        self.error = f"{type(exc).__name__}: {exc}"[:1000]
        return "harness_error"

    @property
    def submitted(self) -> bool:
        return any(result.done for _, result in self.log)

    def call(self, name: str, arguments) -> str:
        """Run one call (``arguments``: a dict or its JSON text); the observation text."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            result = ToolResult(f"error: {name} needs a JSON object of arguments", ok=False)
        elif self.submitted:  # the harness went on after submit: nothing more reaches the workspace
            result = ToolResult("error: already submitted", ok=False)
        else:
            result = execute(ToolCall(name, arguments), self.box)
        self.log.append((ToolCall(name, arguments if isinstance(arguments, dict) else {}), result))
        return result.observation


def session_urls(server_url: str, session: str) -> tuple[str, str]:
    """(OpenAI base URL, Anthropic base URL) of ``session`` on the gateway at ``server_url``."""
    root = f"{server_url.rstrip('/')}/sessions/{session}"
    return f"{root}/v1", root


class Harness(Protocol):
    name: str

    def run(self, objective: str, tools: EpisodeTools, server_url: str, session: str,
            settings: HarnessSettings) -> str:
        """Play one episode against ``session``; why it stopped (module docstring)."""


class OpenAIAgentsHarness:
    """The OpenAI Agents SDK (``agents``), Chat Completions or Responses."""

    name = "openai_agents"

    def __init__(self, api: str = "chat"):
        self.api = api

    def run(self, objective, tools, server_url, session, settings):
        import agents
        import openai

        agents.set_tracing_disabled(True)  # no export of traces to OpenAI's servers
        client = openai.AsyncOpenAI(base_url=session_urls(server_url, session)[0], api_key="unused",
                                    max_retries=0, timeout=settings.timeout_s)
        model_class = agents.OpenAIResponsesModel if self.api == "responses" else agents.OpenAIChatCompletionsModel

        def invoke(name: str):
            async def on_invoke(_ctx, arguments: str) -> str:
                return tools.call(name, arguments)  # blocking: one episode per event loop
            return on_invoke

        function_tools = [agents.FunctionTool(name=s["function"]["name"], description=s["function"]["description"],
                                              params_json_schema=s["function"]["parameters"],
                                              on_invoke_tool=invoke(s["function"]["name"]), strict_json_schema=False)
                          for s in tool_schemas()]
        agent = agents.Agent(name="solver", instructions=tools_prompt(), tools=function_tools,
                             model=model_class(model=settings.model, openai_client=client),
                             model_settings=agents.ModelSettings(max_tokens=settings.max_tokens,
                                                                 temperature=settings.temperature),
                             tool_use_behavior=agents.StopAtTools(stop_at_tool_names=["submit"]))
        try:
            agents.Runner.run_sync(agent, objective, max_turns=settings.max_turns)
        except agents.MaxTurnsExceeded:
            return "turn_limit"
        except agents.AgentsException as exc:  # e.g. a call of a tool it does not have
            return tools.failed(exc)
        return "submitted" if tools.submitted else "answered"


class AnthropicHarness:
    """The ``anthropic`` client's Messages API in the canonical client-side tool loop."""

    name = "anthropic"

    def run(self, objective, tools, server_url, session, settings):
        import anthropic

        client = anthropic.Anthropic(base_url=session_urls(server_url, session)[1], api_key="unused", max_retries=0,
                                     timeout=settings.timeout_s)
        declared = [{"name": s["function"]["name"], "description": s["function"]["description"],
                     "input_schema": s["function"]["parameters"]} for s in tool_schemas()]
        history: list[dict] = [{"role": "user", "content": objective}]
        for _ in range(settings.max_turns):
            reply = client.messages.create(model=settings.model, max_tokens=settings.max_tokens, system=tools_prompt(),
                                           tools=declared if settings.declare_tools else anthropic.NOT_GIVEN,
                                           messages=history,
                                           extra_body={"temperature": settings.temperature})  # not a 2.15 kwarg
            history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                return "answered"
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": tools.call(use.name, use.input)}
                for use in uses]})
            if tools.submitted:
                return "submitted"
        return "turn_limit"


class SmolagentsHarness:
    """``smolagents.ToolCallingAgent`` (its own system prompt, memory and ReAct loop)."""

    name = "smolagents"

    def run(self, objective, tools, server_url, session, settings):
        import smolagents

        class GatewayModel(smolagents.OpenAIModel):
            """smolagents' own path for a server without ``stop``: it cuts the text client-side.
            The gateway refuses stop sequences (the parsed text and the captured tokens would
            disagree), so the harness is told, through its documented switch, not to send them."""

            @property
            def supports_stop_parameter(self) -> bool:
                return False

        def smol_tool(schema: dict):
            fn = schema["function"]

            class SandboxTool(smolagents.Tool):
                name, description, output_type = fn["name"], fn["description"], "string"
                inputs = {p: {"type": "string", "description": p} for p in fn["parameters"]["properties"]}
                skip_forward_signature_validation = True

                def forward(self, **arguments):
                    return tools.call(self.name, arguments)
            return SandboxTool()

        def stop_after_submit(_step, agent) -> None:
            if tools.submitted:
                agent.interrupt()

        base_url = session_urls(server_url, session)[0]
        model = GatewayModel(model_id=settings.model, api_base=base_url, api_key="unused",
                             client_kwargs={"max_retries": 0, "timeout": settings.timeout_s},
                             max_tokens=settings.max_tokens, temperature=settings.temperature)
        agent = smolagents.ToolCallingAgent(tools=[smol_tool(s) for s in tool_schemas()], model=model,
                                            instructions=tools_prompt(), max_steps=settings.max_turns,
                                            verbosity_level=smolagents.LogLevel.OFF,
                                            step_callbacks=[stop_after_submit])
        try:
            result = agent.run(objective, return_full_result=True)
        except smolagents.AgentError as exc:  # the interrupt after submit, or an error it gave up on
            if tools.submitted:
                return "submitted"
            # a refused call is re-raised wrapped (AgentGenerationError): a limit stop, not the harness's error
            return "context_limit" if ran_out_of_context(exc) else tools.failed(exc)
        if tools.submitted:
            return "submitted"
        return "turn_limit" if result.state == "max_steps_error" else "answered"


class BuiltinHarness:
    """Our own Chat Completions tool loop: the in-process runner's loop (:func:`.runner.run_episode`)
    over the gateway — an answer without a call is told so and the loop goes on, until ``submit``
    or ``max_turns`` — the white-box reference next to the black boxes. Like the runner it names the
    tools once, in the system message (:func:`.tools.tools_prompt`), and declares no JSON schemas:
    the chat template would render them again (~890 more tokens of a ~400-token opening with the
    tiny 512-id tokenizer). The gateway parses tool calls either way."""

    name = "builtin"

    def run(self, objective, tools, server_url, session, settings):
        import openai

        client = openai.OpenAI(base_url=session_urls(server_url, session)[0], api_key="unused", max_retries=0,
                               timeout=settings.timeout_s)
        history: list[dict] = [{"role": "system", "content": tools_prompt()}, {"role": "user", "content": objective}]
        for _ in range(settings.max_turns):
            reply = client.chat.completions.create(model=settings.model, messages=history,
                                                   max_tokens=settings.max_tokens, temperature=settings.temperature)
            message = reply.choices[0].message
            history.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:  # as the in-process runner: say so and go on
                history.append({"role": "tool", "content": malformed_observation("no tool call")})
                continue
            for call in message.tool_calls:
                history.append({"role": "tool", "tool_call_id": call.id,
                                "content": tools.call(call.function.name, call.function.arguments)})
            if tools.submitted:
                return "submitted"
        return "turn_limit"


HARNESSES = {"openai_agents": OpenAIAgentsHarness, "anthropic": AnthropicHarness, "smolagents": SmolagentsHarness,
             "builtin": BuiltinHarness}
"""Harness name (``rl.rollout.environment.harness``) -> its adapter."""


def make_harness(name: str) -> Harness:
    if name not in HARNESSES:
        raise ValueError(f"harness: unknown harness {name!r}; known: {', '.join(HARNESSES)}")
    return HARNESSES[name]()
