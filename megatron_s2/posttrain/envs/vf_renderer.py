"""A ``renderers`` renderer that bridges turns for a prefix-stable chat template (token-in/token-out
multi-turn sessions; issue 14 "a session's turns form one training sample").

verifiers' training client renders each model call with a renderer. ``renderers``'
``DefaultRenderer`` (the tokenizer's own Jinja template) cannot *bridge*: for the second call it
re-renders the whole history, so a sampled reply that re-tokenises differently (BPE is not
injective) or that the length limit cut (the template closes it with ``eos``) no longer matches
the ids the engine generated — verifiers then starts a new branch, and the session is not one
training sample.

:class:`ChatTemplateBridgeRenderer` is ``DefaultRenderer`` plus
:meth:`bridge_to_next_turn`: the next prompt is ``previous prompt + previous completion`` kept
verbatim, the template's assistant close if the completion did not end with it, and the tokens
the template renders for the new messages (tool results / a user turn) and the generation
prompt. Both pieces are measured on the template itself with probe conversations, so it works for
any template that renders a conversation's prefix as a prefix of the whole (ours in
``recipes/tokenizers/tiny-bpe`` does); when the probes show it is not, it returns None and the
caller re-renders (the default behaviour). Select it with ``environment.renderer: bridge``.
"""

from __future__ import annotations

from renderers import DefaultRenderer, DefaultRendererConfig
from renderers.base import RenderedTokens, extract_message_tool_names

__all__ = ["ChatTemplateBridgeRenderer", "IMPORT_PATH"]

IMPORT_PATH = "megatron_s2.posttrain.envs.vf_renderer.ChatTemplateBridgeRenderer"
"""What ``renderers.CustomRendererConfig(import_path=...)`` names."""

_PROBE_A, _PROBE_B = "a", "b"


def _common_suffix(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[len(x) - 1 - n] == y[len(y) - 1 - n]:
        n += 1
    return n


class ChatTemplateBridgeRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def _assistant_close(self, tools) -> list[int] | None:
        """The tokens the template puts after an assistant message's content (e.g. ``[eos]``)."""
        one = self._apply([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE_A}], tools=tools)
        two = self._apply([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE_B}], tools=tools)
        n = _common_suffix(one, two)
        return None if n == min(len(one), len(two)) else one[len(one) - n:]

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
        close = self._assistant_close(tools)
        if close is None:
            return None
        head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE_A}]
        closed = self._apply(head, tools=tools)
        full = self._apply(head + list(new_messages), tools=tools, add_generation_prompt=True)
        if full[:len(closed)] != closed:
            return None  # the template re-renders earlier turns when later ones arrive: not bridgeable
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        done = next((k for k in range(len(close), -1, -1)
                     if k <= len(previous_completion_ids) and list(previous_completion_ids[len(previous_completion_ids) - k:]) == close[:k]), 0)
        prior += close[done:]  # a reply cut by the length limit gets the close the template would add
        indices = [-1] * len(prior)
        start = len(closed)
        for i in range(len(new_messages)):  # each new message's tokens, then the generation prompt (-1)
            upto = self._apply(head + list(new_messages[:i + 1]), tools=tools)
            if upto[:start] != closed[:start] or len(upto) < start:
                return None
            indices += [i] * (len(upto) - start)
            start = len(upto)
        fragment = full[len(closed):]
        indices += [-1] * (len(full) - start)
        if len(indices) != len(prior) + len(fragment):
            return None
        return RenderedTokens(token_ids=prior + fragment, message_indices=indices,
                              message_roles=[m.get("role") or "" for m in new_messages],
                              message_tool_names=extract_message_tool_names(list(new_messages)))
