"""Token-in / token-out capture: the prompt ids of a session's next call, and the call's record.

Intern-S2 walkthrough Ch. 6 ("Token-in, token-out"): re-tokenising the text a harness sends back
does not reproduce the sampled ids (tokenisers are not injective over rendering round-trips),
so the gateway never re-tokenises a session's stable history. The new request is rendered with
the chat template; the longest chain of stored PrefixTree nodes whose texts spell its beginning
(:meth:`~.traces.TraceStore.longest_prefix`) contributes its stored ids verbatim — the exact
sampled ids of earlier responses included —, so do the first tokens of a context node the request
shares only in part (cut between two tokens; the node is split when the call is recorded), and
only the rest, the new context delta, is tokenised. The walkthrough's ``on_model_call``::

    prefix_ids = session.tokenised_prefix      # reused, never re-tokenised
    new_ids    = tokenize(new_context)         # only the delta
    out        = engine.generate(prefix_ids + new_ids)
    trace_store.append(session, token_ids=out.ids, labels="trainable", logprobs=out.logprobs,
                       experts=out.router_experts)                                   # R3

A harness that sends an answer back without its reasoning still matches (the node keeps the
rendering without it too), and the engine sees the stored ids, reasoning included: what the
policy actually conditioned on. After the call, :meth:`Capture.record` adds the delta (a masked context node), the response (a
trainable node: sampled ids, their log-probs, the experts routed at their positions) and — when
the sample ended without the template's end-of-message token (a length stop) — that token as a
masked closing node, so the tree spells exactly what the next prompt will hold. A response's last
sampled token is first fed by the session's next call: that call completes its routing record
(:meth:`~.traces.TraceStore.fill_experts`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from megatron_s2.serve.gateway.conversation import Turn, render_prompt, render_response
from megatron_s2.serve.gateway.traces import CONTEXT, RESPONSE, ROOT, Call, TraceStore, group_of

__all__ = ["PromptPlan", "Capture"]


@dataclass
class PromptPlan:
    """The prompt of one call: the reused node chain and the newly tokenised delta."""

    session: str | None
    text: str
    path: list[int]
    cut: tuple[int, int, int] | None
    """(context node, tokens, characters): the request shares that node's first tokens only; they are
    reused and the node is split there when the call is recorded."""
    delta_text: str
    delta_ids: list[int]
    ids: list[int]

    @property
    def parent(self) -> int:
        return self.path[-1] if self.path else ROOT


class Capture:
    """TITO over a :class:`TraceStore` (module docstring)."""

    def __init__(self, store: TraceStore):
        self.store = store

    @staticmethod
    def plain(tokenizer, turn: Turn, refuse_overlong: Callable[[str], None]) -> PromptPlan:
        """The prompt of a call outside any session: the rendered text, tokenised."""
        text = render_prompt(tokenizer, turn)
        refuse_overlong(text)
        ids = tokenizer.encode(text)
        return PromptPlan(None, text, [], None, text, ids, ids)

    def plan(self, tokenizer, turn: Turn, session: str, refuse_overlong: Callable[[str], None]) -> PromptPlan:
        """The prompt of ``session``'s next call; ``refuse_overlong`` sees the delta before it is
        tokenised (a delta that cannot fit the context is refused without tokenising it)."""
        text = render_prompt(tokenizer, turn)
        group = group_of(session)
        # match and read the matched nodes' ids as one step: a call of the group recorded in
        # between may split a node on the path, which would then hold only its back part
        with self.store.lock:
            path, matched = self.store.longest_prefix(group, text)
            tree = self.store.tree(group)
            reused = [t for node in path for t in tree.nodes[node].token_ids]
            cut = self._cut(tokenizer, group, path[-1] if path else ROOT, text, matched)
            if cut is not None:
                node, tokens, chars = cut
                reused += tree.nodes[node].token_ids[:tokens]
                matched += chars
        delta = text[matched:]
        refuse_overlong(delta)
        delta_ids = tokenizer.encode(delta) if delta else []
        return PromptPlan(session, text, path, cut, delta, delta_ids, reused + delta_ids)

    def _cut(self, tokenizer, group: str, parent: int, text: str, at: int) -> tuple[int, int, int] | None:
        """The context child of ``parent`` sharing the longest token-aligned prefix with
        ``text[at:]``: (node, tokens, characters), or None. A cut lies between two tokens whose
        character spans do not overlap, so the node's stored ids spell exactly the shared text."""
        tree, best = self.store.tree(group), None
        for child in tree.children(parent):
            node = tree.nodes[child]
            if node.kind != CONTEXT:
                continue
            common = len(os.path.commonprefix([node.text, text[at:at + len(node.text)]]))
            if common == 0:
                continue
            ids, offsets = tokenizer.encode_with_offsets(node.text)
            if list(ids) != node.token_ids:
                continue
            tokens = max((k for k in range(1, len(ids)) if offsets[k - 1][1] <= common
                          and offsets[k - 1][1] <= offsets[k][0]), default=0)
            if tokens and (best is None or offsets[tokens - 1][1] > best[2]):
                best = (child, tokens, offsets[tokens - 1][1])
        return best

    def record(self, tokenizer, turn: Turn, plan: PromptPlan, message: dict, result, finish_reason: str | None) -> int:
        """Store one finished call (module docstring); returns the response node's id."""
        group, store = group_of(plan.session), self.store
        ids, sampled = plan.ids, list(result.token_ids)
        rows = None if result.routed_experts is None else result.routed_experts.cpu().numpy()

        def experts(start: int, count: int):
            """Routed experts of positions [start, start + count), -1 past the record (the last
            sampled token was never fed)."""
            if rows is None:
                return None
            out = np.full((count, *rows.shape[1:]), -1, np.int16)
            have = rows[start:start + count]
            out[:len(have)] = have
            return out

        with store.lock:
            # reused nodes: routing this call recorded where they had none. Walk the tree as it is
            # now, not plan.path: a call of the group recorded since the plan may have split a
            # node on it, which spells the same tokens through one more node (shifted offsets)
            at, tree = 0, store.tree(group)
            for node_id in tree.path(plan.parent):
                size = len(tree.nodes[node_id].token_ids)
                if rows is not None:
                    store.fill_experts(group, node_id, experts(at, size))
                at += size
            parent, delta_text, delta_ids = plan.parent, plan.delta_text, plan.delta_ids
            if plan.cut is not None:
                node, tokens, chars = plan.cut
                front = store.split(group, node, tokens, chars, parent)
                if front is None:  # the node was split elsewhere meanwhile: the shared part is new here
                    delta_text = plan.text[len(plan.text) - len(plan.delta_text) - chars:]
                    delta_ids = ids[len(ids) - len(plan.delta_ids) - tokens:]
                else:
                    parent = front
            if delta_text:
                start = len(ids) - len(delta_ids)
                parent = store.add_node(group, parent, CONTEXT, delta_text, delta_ids,
                                        experts=experts(start, len(delta_ids)))
            context = parent
            text, alt_text = render_response(tokenizer, turn, message)
            eos_text = tokenizer.decode([tokenizer.eos_id], keep_special=True)
            closed = bool(sampled) and sampled[-1] == tokenizer.eos_id
            closing = not closed and text.endswith(eos_text)
            if closing:  # the template closes the message; the sample did not: a masked closing node
                text = text[:-len(eos_text)]
                alt_text = alt_text[:-len(eos_text)] if alt_text is not None else None
            response = store.add_node(group, context, RESPONSE, text, sampled, logprobs=result.logprobs,
                                      experts=experts(len(ids), len(sampled)), alt_text=alt_text)
            if closing:
                store.add_node(group, response, CONTEXT, eos_text, [tokenizer.eos_id],
                               experts=experts(len(ids) + len(sampled), 1))
            store.add_call(Call(plan.session, len(store.session_calls(plan.session)), context, response, len(ids),
                                len(sampled), finish_reason, turn.protocol))
        return response
