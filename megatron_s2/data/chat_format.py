"""The V4-style chat format: special tokens and the Jinja chat template (report §5.1.4).

DeepSeek's chat models frame a conversation with dedicated special tokens — begin/end of
sentence, ``<｜User｜>`` / ``<｜Assistant｜>`` role markers, ``<think>`` / ``</think>`` around the
reasoning, and tool-call / tool-output delimiters. :data:`SPECIAL_TOKENS` lists ours in id order
(bos 0, eos 1, pad 2 as in the released tokenizer, so the released ``engram_pad_token_id`` 2 is
the pad token here too); ``tools/train_tokenizer.py`` puts them first in every tokenizer it
trains and writes :data:`CHAT_TEMPLATE` into ``tokenizer_config.json``.

Rendered conversation (no separators between messages)::

    <｜begin▁of▁sentence｜>{header}
    <｜User｜>{user}
    <｜Assistant｜>[<think>{reasoning}</think>]{content}[<｜tool▁calls▁begin｜>
        <｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments JSON}<｜tool▁call▁end｜>...
    <｜tool▁calls▁end｜>]<｜end▁of▁sentence｜>
    <｜tool▁output▁begin｜>{tool result}<｜tool▁output▁end｜>
    ...
    <｜Assistant｜>                                  (add_generation_prompt)

``{header}`` joins with newlines: the reasoning-effort line of §5.1.4 when
``reasoning_effort`` is given — ``Reasoning Effort: {effort} (range 1–100; higher values
request more thorough reasoning)``, prepended to the system prompt —, ``## Tools`` followed by
one JSON tool schema per line, and the leading system message (a later system message is
plain text where it stands). Every message is rendered the same
wherever it stands, so the rendering of a conversation's first *k* messages is a prefix of
the rendering of the whole: that is what lets :mod:`megatron_s2.data.chat` attribute every
token to its message (and role) for SFT loss masks.
"""

from __future__ import annotations

__all__ = ["BOS", "EOS", "PAD", "USER", "ASSISTANT", "THINK_BEGIN", "THINK_END", "SPECIAL_TOKENS",
           "SPECIAL_TOKEN_NAMES", "REASONING_EFFORT_LINE", "reasoning_effort_line", "CHAT_TEMPLATE"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

SPECIAL_TOKEN_NAMES: dict[str, str] = {
    "bos": BOS, "eos": EOS, "pad": PAD, "user": USER, "assistant": ASSISTANT,
    "think_begin": THINK_BEGIN, "think_end": THINK_END,
    "tool_calls_begin": TOOL_CALLS_BEGIN, "tool_calls_end": TOOL_CALLS_END,
    "tool_call_begin": TOOL_CALL_BEGIN, "tool_call_end": TOOL_CALL_END, "tool_sep": TOOL_SEP,
    "tool_output_begin": TOOL_OUTPUT_BEGIN, "tool_output_end": TOOL_OUTPUT_END,
}
"""Role of each special token (the key names the tokenizer's ``special_ids`` use)."""
SPECIAL_TOKENS: tuple[str, ...] = tuple(SPECIAL_TOKEN_NAMES.values())
"""Special tokens in id order (ids 0 .. 13 of a trained tokenizer)."""

REASONING_EFFORT_LINE = "Reasoning Effort: {effort} (range 1–100; higher values request more thorough reasoning)"
"""The instruction of report §5.1.4 prepended to the system prompt."""


def reasoning_effort_line(effort: int) -> str:
    """The §5.1.4 line for an effort level b in 1..100."""
    if isinstance(effort, bool) or not isinstance(effort, int) or not 1 <= effort <= 100:
        raise ValueError(f"reasoning_effort: must be an integer in 1..100 (report §5.1.4), got {effort!r}")
    return REASONING_EFFORT_LINE.format(effort=effort)


_HEADER_EFFORT = REASONING_EFFORT_LINE.replace("{effort}", "' ~ reasoning_effort ~ '")

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(header='') -%}"
    "{%- if reasoning_effort is defined and reasoning_effort is not none -%}"
    "{%- set ns.header = '" + _HEADER_EFFORT + "' -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns.header = (ns.header ~ '\\n' if ns.header else '') ~ '## Tools' -%}"
    "{%- for tool in tools -%}{%- set ns.header = ns.header ~ '\\n' ~ (tool | tojson) -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{- ns.header -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- ('\\n' if loop.first and ns.header else '') ~ message['content'] -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '" + USER + "' ~ message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' -}}"
    "{%- if message.get('reasoning_content') -%}"
    "{{- '" + THINK_BEGIN + "' ~ message['reasoning_content'] ~ '" + THINK_END + "' -}}"
    "{%- endif -%}"
    "{{- message['content'] or '' -}}"
    "{%- if message.get('tool_calls') -%}"
    "{{- '" + TOOL_CALLS_BEGIN + "' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{- '" + TOOL_CALL_BEGIN + "' ~ fn['name'] ~ '" + TOOL_SEP + "' -}}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -}}"
    "{{- '" + TOOL_CALL_END + "' -}}"
    "{%- endfor -%}"
    "{{- '" + TOOL_CALLS_END + "' -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '" + TOOL_OUTPUT_BEGIN + "' ~ message['content'] ~ '" + TOOL_OUTPUT_END + "' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT + "' -}}{%- endif -%}"
)
"""Jinja chat template of the format above (``tokenizer_config.json`` ``chat_template``)."""
