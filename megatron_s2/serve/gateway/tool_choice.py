"""``tool_choice`` on the gateway's three protocols: enforced by masking tokens, or refused.

The tool-call format opens every call list with one special token (``tool_calls_begin``,
:mod:`.tool_format`), so two of the OpenAI / vLLM / Anthropic choices are enforced at sampling
time by the engine's per-request masks (:func:`megatron_s2.inference.sampling.constrain_logits`);
the captured log-probs are those of the masked distribution actually sampled from:

=====================================================  ==========================================
choice (chat / responses ; messages)                   enforcement
=====================================================  ==========================================
absent, ``"auto"`` ; ``{"type": "auto"}``              none: the model decides
``"none"`` ; ``{"type": "none"}``                      the call markers are banned: no tool call
                                                       (the tools stay in the prompt, as vLLM's
                                                       default)
``"required"`` ; ``{"type": "any"}``                   end-of-sequence and stop tokens are banned
                                                       until a call list has begun: the answer
                                                       ends with a call or at ``max_tokens``
                                                       (finish ``length``); the call's arguments
                                                       are not grammar-constrained, so a
                                                       malformed one is relayed as text
named function ; ``{"type": "tool", "name": ...}``     refused (400 naming ``tool_choice``): forcing
                                                       a name needs constrained decoding
=====================================================  ==========================================

``"required"`` and a named tool need declared ``tools`` (400 otherwise), as vLLM answers.
"""

from __future__ import annotations

import dataclasses

from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.serve.fields import shown
from megatron_s2.serve.gateway.conversation import Turn

__all__ = ["tool_choice_mode", "apply_tool_choice"]

_MESSAGES = {"auto": "auto", "none": "none", "any": "required"}


def tool_choice_mode(turn: Turn) -> str:
    """``auto``, ``none`` or ``required`` for ``turn``'s ``tool_choice`` (400 for anything else)."""
    f = turn.fields
    choice = f.raw("tool_choice")
    if choice is None:
        return "auto"
    if turn.protocol == "messages":
        kind = choice.get("type") if isinstance(choice, dict) else None
        mode = _MESSAGES.get(kind)
        if mode is None:
            if kind == "tool":
                f.fail("tool_choice", "a named tool ({\"type\": \"tool\"}) is not supported: forcing a tool's name "
                                      "needs constrained decoding; send {\"type\": \"any\"} or {\"type\": \"auto\"}")
            f.fail("tool_choice", f"must be {{\"type\": \"auto\" | \"any\" | \"none\"}}, got {shown(choice)}")
    elif isinstance(choice, str) and choice in ("auto", "none", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        f.fail("tool_choice", "a named function is not supported: forcing a function's name needs constrained "
                              "decoding; send \"required\" or \"auto\"")
    else:
        f.fail("tool_choice", f"must be \"auto\", \"none\" or \"required\", got {shown(choice)}")
    if mode == "required" and not turn.tools:
        f.fail("tool_choice", "requires a tool call but no tools are declared; declare tools or leave it out")
    return mode


def apply_tool_choice(params: SamplingParams, mode: str, tokenizer) -> SamplingParams:
    """``params`` with the masks that enforce ``mode`` (module docstring)."""
    if mode == "auto":
        return params
    ids = tokenizer.special_ids
    if mode == "none":
        return dataclasses.replace(params, banned_token_ids=(ids["tool_calls_begin"], ids["tool_call_begin"]))
    return dataclasses.replace(params, required_token_id=ids["tool_calls_begin"])
