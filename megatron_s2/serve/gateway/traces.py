"""The PrefixTree trace store: each session's model calls as one incremental tree of token spans.

Intern-S2 walkthrough, Ch. 6 ("The PrefixTree: storing a branching session without storing it
twice"): *"The Trace Store organizes each session as an incremental PrefixTree. Each node
represents a newly appended context delta or assistant response and stores its token IDs,
labels, rollout log probabilities, and router experts. Longest-prefix matching reuses the stable
history of a session and appends only newly observed segments."* Sessions of one **group** (the
G rollouts of one task: session ids ``<group>@<member>``) share one tree, so rollouts that agree
on their first turns share that trunk (worked example 19, :func:`worked_example_19`).

A node is a **context delta** (system / user / tool text and the template's framing: label
``masked``) or an **assistant response** (the engine's sampled ids with their log-probs: label
``trainable``). A response can be marked ``skip`` (step-level curation, Ch. 6: it stays in the
context of later steps but is excluded from the loss). Every node keeps the rendered text it
covers (a response: the chat template's rendering of the message the gateway returned), which
is what the gateway matches a later request against (:mod:`megatron_s2.serve.gateway.tito`). A
context node that a later request shares only in part is split at a token boundary
(:meth:`TraceStore.split`), so the tree shares every common token prefix of context; responses
are never split (two different samples are two nodes).

On disk, no pickle anywhere::

    DIR/<group>/trace.jsonl          append-only events, one JSON object a line:
                                     {"event": "node", "id", "parent", "kind", "label", "n_tokens", "text",
                                      "alt_text"}
                                     {"event": "call", "session", "call", "context", "response",
                                      "prompt_tokens", "output_tokens", "finish_reason", "protocol"}
                                     {"event": "skip", "node", "skip"}
                                     {"event": "split", "node", "parent", "drop", "chars", "before"}
    DIR/<group>/nodes/<id>.npz       token_ids int64, logprobs float32 (NaN: not sampled),
                                     experts int16 [n, MoE layers, top-k] (-1: no record; absent
                                     for a dense model); read with allow_pickle=False

Crash safety: a node's arrays are written to a temporary file, fsynced and renamed before its
event line is appended (+ fsync), so a crash leaves at worst a torn last line or an orphan array
file; :class:`TraceStore` and :func:`read_samples` skip both (and a node whose parent is missing),
and a restarted server continues the stored trees (its first append cuts the torn line). A write
that fails (a full disk) is cut back, so the call fails and the file stays whole.

Post-training reads the store with :func:`read_samples`: one :class:`TrainableSample` per session
branch (token ids, loss mask, log-probs, experts and segment boundaries).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["TraceNode", "TraceStore", "TrainableSample", "Segment", "read_samples", "group_of",
           "check_session_id", "flat_and_tree_tokens", "worked_example_19", "ROOT"]

ROOT = -1
"""Parent id of a tree's first nodes."""
CONTEXT, RESPONSE = "context", "response"
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(@[A-Za-z0-9._-]{1,64})?$")


def check_session_id(session: str) -> str | None:
    """Why ``session`` is not a usable session id, or None (ids name directories on disk)."""
    if not _SESSION_ID.match(session):
        return ("a session id is 1-128 characters of letters, digits, '.', '_' and '-' (not starting with '.', "
                "'_' or '-'), optionally '@member' to put several sessions into one group")
    return None


def group_of(session: str) -> str:
    """The group (one PrefixTree) a session belongs to: the id before ``@``, else the id itself."""
    return session.split("@", 1)[0]


@dataclass
class TraceNode:
    """One node of a PrefixTree (module docstring)."""

    id: int
    parent: int
    kind: str
    """``context`` (masked) or ``response`` (trainable unless ``skip``)."""
    text: str
    """The rendered text this node covers (what a later request is matched against)."""
    token_ids: list[int]
    logprobs: np.ndarray
    """float32 per token, NaN where not sampled (context)."""
    experts: np.ndarray | None
    """int16 [tokens, MoE layers, top-k], -1 where no forward recorded it; None for a dense model."""
    alt_text: str | None = None
    """A response's rendering without its reasoning (a harness may not send reasoning back)."""
    skip: bool = False
    children: list[int] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.kind == RESPONSE and not self.skip

    def matches(self, text: str, at: int) -> int:
        """Characters of ``text`` from ``at`` this node covers (0: it does not continue ``text``)."""
        for candidate in (self.text, self.alt_text):
            if candidate is not None and text.startswith(candidate, at):
                return len(candidate)
        return 0


@dataclass
class Call:
    """One model call of a session: the context node its prompt ended with and its response."""

    session: str
    call: int
    context: int
    response: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    protocol: str


@dataclass(frozen=True)
class Segment:
    """A node's span in a :class:`TrainableSample`: tokens ``[start, end)``."""

    start: int
    end: int
    kind: str
    node: int
    trainable: bool
    skip: bool


@dataclass
class TrainableSample:
    """One session branch, as post-training consumes it (root to the session's last response)."""

    session: str
    group: str
    token_ids: np.ndarray
    """int64 [T]"""
    loss_mask: np.ndarray
    """bool [T]: True on trainable response tokens (not on masked context, not on skipped steps)."""
    logprobs: np.ndarray
    """float32 [T]: rollout log-probs of sampled tokens, NaN elsewhere."""
    experts: np.ndarray | None
    """int16 [T, MoE layers, top-k] routed experts (R3), -1 where unrecorded; None: dense model."""
    segments: list[Segment]
    calls: int
    """Model calls of the session that lie on this branch."""


class _Tree:
    """One group's nodes and calls, in memory, mirrored to its directory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.nodes: dict[int, TraceNode] = {}
        self.roots: list[int] = []
        self.calls: list[Call] = []
        self.next_id = 0

    def children(self, parent: int) -> list[int]:
        return self.roots if parent == ROOT else self.nodes[parent].children

    def attach(self, node: TraceNode) -> None:
        self.nodes[node.id] = node
        self.children(node.parent).append(node.id)
        self.next_id = max(self.next_id, node.id + 1)

    def path(self, node: int) -> list[int]:
        """Node ids from the root down to ``node``."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]


def _atomic_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: do not keep holding the space a half file took
        raise


def _complete_lines_end(fd: int, end: int) -> int:
    """The offset just past the file's last newline (0: none): where a torn last line begins."""
    at = end
    while at > 0:
        step = min(at, 1 << 16)
        chunk = os.pread(fd, step, at - step)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return at - step + newline + 1
        at -= step
    return 0


def _append_line(path: Path, event: dict) -> None:
    """Append one event line, never after a torn one and never leaving one: a line torn by a
    crash (kill -9 mid-write) is cut before appending, else the next event would be glued onto it
    and unreadable; a write that fails (a full disk) is cut back to where it started."""
    line = (json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        whole = _complete_lines_end(fd, end) if end and os.pread(fd, 1, end - 1) != b"\n" else end
        if whole != end:
            os.ftruncate(fd, whole)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, whole)
            raise
    finally:
        os.close(fd)


def _load_tree(directory: Path) -> _Tree:
    """A group's tree from disk, skipping a torn last line, orphan arrays and orphaned nodes."""
    tree = _Tree(directory)
    log = directory / "trace.jsonl"
    if not log.is_file():
        return tree
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        kind = event.get("event")
        if kind == "node":
            if event["parent"] != ROOT and event["parent"] not in tree.nodes:
                continue
            arrays = directory / "nodes" / f"{event['id']}.npz"
            try:
                with np.load(arrays, allow_pickle=False) as data:
                    ids, logprobs = data["token_ids"].tolist(), data["logprobs"]
                    experts = data["experts"] if "experts" in data.files else None
            except (OSError, KeyError, ValueError):
                continue
            tree.attach(TraceNode(event["id"], event["parent"], event["kind"], event["text"], ids, logprobs,
                                  experts, event.get("alt_text")))
        elif kind == "split" and event["node"] in tree.nodes and event["parent"] in tree.nodes:
            node = tree.nodes[event["node"]]
            tree.children(node.parent).remove(node.id)
            tree.nodes[event["parent"]].children.append(node.id)
            node.parent, node.text = event["parent"], node.text[event["chars"]:]
            if len(node.token_ids) == event["before"]:  # the arrays were not rewritten yet (a crash)
                _drop_front(node, event["drop"])
        elif kind == "call" and event["response"] in tree.nodes:
            tree.calls.append(Call(**{k: event[k] for k in Call.__dataclass_fields__}))
        elif kind == "skip" and event["node"] in tree.nodes:
            tree.nodes[event["node"]].skip = bool(event["skip"])
    return tree


def _drop_front(node: TraceNode, count: int) -> None:
    node.token_ids = node.token_ids[count:]
    node.logprobs = node.logprobs[count:]
    node.experts = None if node.experts is None else node.experts[count:]


def _node_arrays(node: TraceNode) -> dict[str, np.ndarray]:
    arrays = {"token_ids": np.asarray(node.token_ids, np.int64), "logprobs": node.logprobs}
    if node.experts is not None:
        arrays["experts"] = node.experts
    return arrays


class TraceStore:
    """PrefixTrees of every group under ``directory`` (module docstring); thread-safe.

    The gateway holds one; nodes stay in memory (the matching index) and are written as they are
    added. Loading an existing directory continues its trees (a restarted server)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self._trees: dict[str, _Tree] = {}

    def tree(self, group: str) -> _Tree:
        with self.lock:
            if group not in self._trees:
                self._trees[group] = _load_tree(self.directory / group)
            return self._trees[group]

    def groups(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir() if (p / "trace.jsonl").is_file())

    def forget(self, group: str) -> None:
        """Drop ``group``'s tree from memory and disk — a trainer that has consumed a finished
        session's trace (its sessions must make no further calls): the store otherwise holds every
        tree it ever matched against, for as long as the server runs."""
        with self.lock:
            self._trees.pop(group, None)
            shutil.rmtree(self.directory / group, ignore_errors=True)

    # ---- matching ----------------------------------------------------------------------------
    def longest_prefix(self, group: str, text: str, start: int = ROOT) -> tuple[list[int], int]:
        """(path of nodes, characters matched): the longest chain of nodes whose texts spell the
        beginning of ``text``, from the tree's root (or below node ``start``)."""
        tree = self.tree(group)
        with self.lock:
            path, at, parent = [], 0, start
            while True:
                best, best_len = None, 0
                for child in tree.children(parent):
                    covered = tree.nodes[child].matches(text, at)
                    if covered > best_len:
                        best, best_len = child, covered
                if best is None:
                    return path, at
                path.append(best)
                at += best_len
                parent = best

    # ---- writing -----------------------------------------------------------------------------
    def add_node(self, group: str, parent: int, kind: str, text: str, token_ids: list[int],
                 logprobs: np.ndarray | None = None, experts: np.ndarray | None = None,
                 alt_text: str | None = None) -> int:
        """The id of the child of ``parent`` with these contents: an existing one (two sessions
        that produced the same span share it), else a new node, written to disk first."""
        tree = self.tree(group)
        with self.lock:
            for child in tree.children(parent):
                node = tree.nodes[child]
                if node.kind == kind and node.text == text and node.token_ids == list(token_ids):
                    return child
            n = len(token_ids)
            logprobs = np.full(n, np.nan, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
            node = TraceNode(tree.next_id, parent, kind, text, list(map(int, token_ids)), logprobs,
                             None if experts is None else np.asarray(experts, np.int16), alt_text)
            (tree.directory / "nodes").mkdir(parents=True, exist_ok=True)
            _atomic_npz(tree.directory / "nodes" / f"{node.id}.npz", _node_arrays(node))
            _append_line(tree.directory / "trace.jsonl",
                         {"event": "node", "id": node.id, "parent": parent, "kind": kind,
                          "label": "trainable" if kind == RESPONSE else "masked", "n_tokens": n, "text": text,
                          "alt_text": alt_text})
            tree.attach(node)
            return node.id

    def fill_experts(self, group: str, node_id: int, rows: np.ndarray) -> None:
        """Complete a node's routing record where it has none (-1) and ``rows`` has one: a
        response's last sampled token is first fed, and routed, by the session's next call. The
        node's arrays are rewritten atomically."""
        tree = self.tree(group)
        with self.lock:
            node = tree.nodes[node_id]
            if node.experts is None or rows.shape != node.experts.shape:
                return
            missing = (node.experts < 0) & (rows >= 0)
            if not missing.any():
                return
            node.experts = np.where(missing, rows, node.experts).astype(np.int16)
            _atomic_npz(tree.directory / "nodes" / f"{node_id}.npz", _node_arrays(node))

    def split(self, group: str, node_id: int, tokens: int, chars: int, parent: int) -> int | None:
        """Cut context node ``node_id`` after its first ``tokens`` tokens (``chars`` characters of
        its text), so a request that shares only that much of it can share it: a new node holds
        the front, the node keeps the rest under it. None when the node moved since the request
        was matched (another split got there first). Crash-safe: the ``split`` event is written
        before the node's arrays are rewritten, and the loader cuts arrays that were not."""
        tree = self.tree(group)
        with self.lock:
            node = tree.nodes[node_id]
            if node.parent != parent or node.kind != CONTEXT or not 0 < tokens < len(node.token_ids):
                return None
            front = self.add_node(group, parent, CONTEXT, node.text[:chars], node.token_ids[:tokens],
                                  experts=None if node.experts is None else node.experts[:tokens])
            _append_line(tree.directory / "trace.jsonl",
                         {"event": "split", "node": node_id, "parent": front, "drop": tokens, "chars": chars,
                          "before": len(node.token_ids)})
            tree.children(parent).remove(node_id)
            tree.nodes[front].children.append(node_id)
            node.parent, node.text = front, node.text[chars:]
            _drop_front(node, tokens)
            _atomic_npz(tree.directory / "nodes" / f"{node_id}.npz", _node_arrays(node))
            return front

    def add_call(self, call: Call) -> None:
        tree = self.tree(group_of(call.session))
        with self.lock:
            _append_line(tree.directory / "trace.jsonl", {"event": "call", **call.__dict__})
            tree.calls.append(call)

    def session_calls(self, session: str) -> list[Call]:
        return [c for c in self.tree(group_of(session)).calls if c.session == session]

    def mark_skip(self, session: str, call: int, skip: bool = True) -> int:
        """Step-level curation: the response of the session's ``call``-th model call (0-based)
        stays in the context of later calls but leaves the loss. Returns its node id."""
        calls = self.session_calls(session)
        if not 0 <= call < len(calls):
            raise IndexError(f"session {session!r} has {len(calls)} model calls; no call {call}")
        tree = self.tree(group_of(session))
        node = calls[call].response
        with self.lock:
            _append_line(tree.directory / "trace.jsonl", {"event": "skip", "node": node, "skip": skip})
            tree.nodes[node].skip = skip
        return node

    # ---- accounting --------------------------------------------------------------------------
    def token_counts(self, group: str) -> tuple[int, int]:
        """(flat, tree) tokens of a group: every call stored as its own flat context (prompt +
        response) versus every tree node once (worked example 19)."""
        tree = self.tree(group)
        flat = sum(c.prompt_tokens + c.output_tokens for c in tree.calls)
        return flat, sum(len(n.token_ids) for n in tree.nodes.values())


def _sample(tree: _Tree, group: str, session: str, leaf: int, calls: int) -> TrainableSample:
    ids, mask, logprobs, experts, segments = [], [], [], [], []
    for node_id in tree.path(leaf):
        node = tree.nodes[node_id]
        start = len(ids)
        ids += node.token_ids
        mask += [node.trainable] * len(node.token_ids)
        logprobs.append(node.logprobs)
        experts.append(node.experts)
        segments.append(Segment(start, len(ids), node.kind, node_id, node.trainable, node.skip))
    dense = any(e is None for e in experts)
    return TrainableSample(session, group, np.asarray(ids, np.int64), np.asarray(mask, bool),
                           np.concatenate(logprobs).astype(np.float32),
                           None if dense else np.concatenate(experts), segments, calls)


def read_samples(directory: str | os.PathLike, groups: list[str] | None = None) -> Iterator[TrainableSample]:
    """Per-session trainable samples of a stored trace directory, for post-training.

    A session yields one sample per branch it took: the path from the root to each of its
    responses that no later response of the same session extends (a harness that rewrote its
    history made a new branch). Loss masks follow the node labels and ``skip`` marks."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory}: no trace store here (megatron-s2 serve --gateway-traces DIR writes one)")
    store = TraceStore(directory)
    for group in groups if groups is not None else store.groups():
        tree = store.tree(group)
        by_session: dict[str, list[Call]] = {}
        for call in tree.calls:
            by_session.setdefault(call.session, []).append(call)
        for session, calls in sorted(by_session.items()):
            paths = [(c.response, set(tree.path(c.response))) for c in calls]
            for leaf, nodes in paths:
                if any(leaf in other and leaf != end for end, other in paths):
                    continue  # a later response of this session continues this one
                on_branch = sum(1 for end, _ in paths if end in nodes)
                yield _sample(tree, group, session, leaf, on_branch)


def flat_and_tree_tokens(sessions: int, turns: int, header: int, per_turn: int, shared_turns: int) -> tuple[int, int]:
    """Worked example 19's arithmetic: tokens stored flat (one full context per model call,
    turn ``t`` holding ``header + per_turn * t``) vs in a PrefixTree (the trunk of the header and
    the shared turns once, then each session's divergent turns once)."""
    flat_session = sum(header + per_turn * t for t in range(1, turns + 1))
    trunk = header + per_turn * shared_turns
    return sessions * flat_session, trunk + sessions * per_turn * (turns - shared_turns)


def worked_example_19() -> dict[str, float]:
    """The walkthrough's numbers: G = 8 sessions x 10 turns, a 3,000-token header, 1,200 tokens
    per turn, the first two turns shared."""
    flat, tree = flat_and_tree_tokens(8, 10, 3_000, 1_200, 2)
    one_flat, one_tree = flat_and_tree_tokens(1, 10, 3_000, 1_200, 0)
    return {"flat": flat, "tree": tree, "saving": flat / tree, "one_session_flat": one_flat,
            "one_session_tree": one_tree, "one_session_saving": one_flat / one_tree}
