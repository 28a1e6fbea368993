"""The engine side of a family: what one inference engine caches per request, and one forward.

The engine core (:class:`megatron_s2.inference.engine.InferenceEngine`) works on token ids:
it queues, admits, schedules chunks, samples and finishes requests, and knows nothing of
attention. A family's :class:`ModelExecutor` (``ModelFamily.executor``) owns the per-request
state kinds its layers need — the V4.1 backbone's compressed global KV pages, SWA rings and KV
tiers; a dense transformer's paged KV — and runs the model over a batch of request chunks.

Shared building blocks for executors live here too: :class:`PagePool` (page ids with reference
counts and an LRU of cached prefix pages, vLLM's block pool), :func:`prefix_hashes` and the
row / output records of one forward.

**Images.** A request may carry images (:class:`ImageSpan`): each occupies a span of positions
of ``request.tokens`` whose ids are all the model's image placeholder, so the ids alone do not
say *which* image a span holds. The executor embeds each image once and overwrites the span's
positions in every chunk that reaches them; every cache key over tokens (prefix pages, SWA
snapshots) also covers the content digest of each image it reaches (:func:`prefix_hashes`) —
two prompts with the same placeholders but different pixels must never share a cached prefix.
"""

from __future__ import annotations

import abc
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ModelExecutor", "ResumableState", "SpeculativeExecutor", "Drafter", "Chunk", "RowOutput", "ImageSpan", "PagePool",
           "OutOfPages", "prefix_hashes", "image_key"]


class OutOfPages(RuntimeError):
    """No free page and no evictable cached page: the scheduler must wait or preempt."""


@dataclass
class Chunk:
    """One request's tokens in one forward: ``request.tokens[start:start + length]``."""

    request: Any
    """The engine's request (``tokens``, ``num_computed``, ``kv``: this executor's state)."""
    start: int
    length: int
    logits: str = "last"
    """Logits to return: "last" (of the chunk's last token), "all" or "none"."""
    hidden: bool = False
    """Also return the normalised last hidden state of the same rows (``RowOutput.hidden``: the
    Memory Decoder's router reads both models' hidden states)."""


@dataclass(eq=False)
class ImageSpan:
    """One image of a request: the positions it occupies in ``request.tokens`` and its content."""

    start: int
    """Position of the span's first token."""
    length: int
    """Positions of the span (delimiters included)."""
    key: bytes
    """Digest of the image's content (its model inputs: pixels / patches and grid), never of the
    placeholder ids: what cache keys over the span are made of (:func:`image_key`)."""
    data: Any
    """The family's prepared input (V4.1: the processor's ``ImageInput``)."""
    embeddings: torch.Tensor | None = None
    """[length, hidden] the span's input embeddings, computed once by the executor on first use."""

    @property
    def end(self) -> int:
        return self.start + self.length


def image_key(*parts) -> bytes:
    """Content digest of an image's model inputs (tensors are hashed by dtype, shape and bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().to("cpu").contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            digest.update(repr(part).encode())
    return digest.digest()


@dataclass
class RowOutput:
    logits: torch.Tensor | None = None
    """[V] (last) or [s, V] (all), float32, full vocabulary."""
    hidden: torch.Tensor | None = None
    """[d] / [s, d] float32: the hidden state the head projected for those logits (``Chunk.hidden``)."""
    routing: torch.Tensor | None = None
    """[s, num_layers, top_k] int32 expert ids per token and layer (-1: layer not run)."""
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    """Family-specific per-layer selections (V4.1: the indexer's top-k entry ids per token)."""


class Drafter(abc.ABC):
    """A family's speculative drafter in the engine (V4.1: DSpark, report §2.4.3): it proposes
    ``block_size`` draft positions for every decoding request from the request's own drafter
    state, which the executor keeps up to date with every token the backbone computes."""

    block_size: int

    @abc.abstractmethod
    def propose(self, requests: list) -> tuple[torch.Tensor, torch.Tensor]:
        """For requests whose last token (the *seed*, at position ``num_computed``) is not computed
        yet: (base logits [R, K, V] float32 of positions ``num_computed + 1 ..``, hidden [R, K, h]
        for :meth:`confidence`)."""

    @abc.abstractmethod
    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequential part of drafting: previous tokens [R] -> (logit bias [R, V], the
        embedding [R, r] the confidence head reads)."""

    @abc.abstractmethod
    def confidence(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Per-position conditional acceptance probabilities [R, K]."""


class ModelExecutor(abc.ABC):
    """Per-request model state of one engine and the forward over it."""

    image_token_id: int | None = None
    """The image placeholder id of prompts (:meth:`prepare_images`); None: the model takes no images."""

    @abc.abstractmethod
    def can_admit(self) -> bool:
        """A new request can get its per-request state now."""

    @abc.abstractmethod
    def admit(self, request) -> None:
        """Give ``request`` its state (``request.kv``); may resume a cached prefix by raising
        ``request.num_computed``."""

    @abc.abstractmethod
    def release(self, request, *, snapshot: bool = True) -> None:
        """Free the request's state now (``snapshot``: offer it to the cache tiers first)."""

    @abc.abstractmethod
    def pages_needed(self, request, tokens: int) -> int:
        """New pages that ``tokens`` more tokens of ``request`` would take."""

    @abc.abstractmethod
    def free_pages(self) -> int: ...

    def prepare_images(self, prompt: list[int], images: list) -> tuple[list[int], list[ImageSpan]]:
        """``prompt`` with each image placeholder expanded to its image's span, and the spans;
        ValueError when the model takes no images or they do not match the placeholders."""
        raise ValueError(f"{type(self).__name__}: this model family takes no images")

    def limit_chunk(self, request, tokens: int) -> int:
        """The chunk length the state allows (e.g. a replay boundary); default: unchanged."""
        return tokens

    def after_forward(self, request) -> None:
        """After a chunk of ``request`` ran (e.g. index full prefix pages)."""

    def reclaim(self) -> bool:
        """Free memory held for reuse (snapshots) before requests are preempted; True if any."""
        return False

    @abc.abstractmethod
    def forward(self, chunks: list[Chunk], *, record_routing: bool = False, record_topk: bool = False
                ) -> list[RowOutput]: ...

    @abc.abstractmethod
    def stats(self) -> dict: ...


class ResumableState(abc.ABC):
    """An executor that can hand an admitted request's cache state over to another engine of the
    same configuration (a rollout resumed after a restart, report §5.2.3: rollout states persisted at
    token granularity). Families without it simply do not mix it in: the engine then exports no
    state and refuses one on submission."""

    @abc.abstractmethod
    def export_state(self, request) -> dict[str, torch.Tensor] | None:
        """The admitted ``request``'s cache state as host tensors; None when it holds none yet."""

    @abc.abstractmethod
    def check_state(self, state: dict[str, torch.Tensor]) -> int:
        """The tokens ``state`` (from :meth:`export_state`) covers; ValueError when it does not
        fit this executor."""

    @abc.abstractmethod
    def import_state(self, request, state: dict[str, torch.Tensor]) -> None:
        """Admit ``request`` with ``state`` instead of :meth:`ModelExecutor.admit` (sets
        ``request.kv`` and ``request.num_computed``)."""


class SpeculativeExecutor(ModelExecutor):
    """An executor whose family can speculate: it owns a :class:`Drafter` (None when the model
    has none or speculation is off) and can drop the tail of a verification forward."""

    drafter: Drafter | None = None

    @abc.abstractmethod
    def begin_speculation(self, request, length: int) -> None:
        """The next forward of ``request`` carries ``length`` tokens of which only a prefix will be
        kept (speculative verification); :meth:`rollback` then drops the rest."""

    @abc.abstractmethod
    def rollback(self, request, keep: int) -> None:
        """After the forward announced by :meth:`begin_speculation`: keep its first ``keep``
        tokens; the cache of the others is restored byte for byte to what it held before."""


class PagePool:
    """Page ids with reference counts; unreferenced pages that hold a cached prefix stay
    resident (LRU) until a new allocation needs them (report §3.2.1: global KV under LRU)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, 0, -1))  # page 0 is the reserved zero page
        self.page_hash: dict[int, bytes] = {}           # page -> prefix hash (cached pages)
        self.by_hash: dict[bytes, int] = {}             # prefix hash -> page
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with refs == 0, LRU first

    def allocate(self) -> int:
        if self.free:
            page = self.free.pop()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.page_hash.pop(page)]
        else:
            raise OutOfPages("the KV page pool is exhausted")
        self.refs[page] = 1
        return page

    def retain(self, page: int) -> None:
        if self.refs[page] == 0:
            self.evictable.pop(page, None)
        self.refs[page] += 1

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.page_hash:
                self.evictable[page] = None  # stays cached, newest at the end
            else:
                self.free.append(page)

    def register(self, page: int, prefix_hash: bytes) -> None:
        """Mark a full page as holding the prefix ``prefix_hash`` (first writer wins)."""
        if prefix_hash in self.by_hash or page in self.page_hash:
            return
        self.page_hash[page] = prefix_hash
        self.by_hash[prefix_hash] = page

    def lookup(self, prefix_hash: bytes) -> int | None:
        return self.by_hash.get(prefix_hash)

    @property
    def num_free(self) -> int:
        """Pages an allocation can still obtain (free + evictable cached)."""
        return len(self.free) + len(self.evictable)


def prefix_hashes(tokens: list[int], page_tokens: int, pages: int, images: tuple | list = ()) -> list[bytes]:
    """Chained digests of the first ``pages`` complete pages of ``tokens`` (a page's digest
    stands for the whole prefix it ends). A page some of whose positions belong to an image
    (:class:`ImageSpan` in ``images``) also digests that image's offset and content key: the
    placeholder ids are the same for every image."""
    out, parent = [], b""
    for i in range(pages):
        lo, hi = i * page_tokens, (i + 1) * page_tokens
        chunk = array("q", tokens[lo:hi]).tobytes()
        for image in images:
            if image.start < hi and image.end > lo:
                chunk += array("q", [image.start - lo]).tobytes() + image.key
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out
