"""Rendered pages for visual next-patch pre-training (Intern-S2 walkthrough Ch. 3).

The walkthrough trains on scientific PDFs rendered as page images; with no download, the pages
here are drawn from the embedded procedural source (:mod:`.procedural_images`): each page is
white paper with a few rendered pictures (shapes, digits, words) at random places, so a good part
of it is blank margin — what the foreground mask exists to drop.

Each micro-batch holds the visual rows of ``documents_per_micro_batch`` documents of
``pages_per_document`` pages. A document becomes rows the way the walkthrough builds its
sequences: every page is cut into patches, the blank ones are dropped and the rest kept in
raster order (Eq. 5, :func:`~megatron_s2.models.next_patch.raster_scan` on the pixels — the
encoder works patch by patch, so scanning before encoding is the same and encodes no paper),
the pages are concatenated in document order, and the sequence is split into chunks of at most
``max_patches`` sharing ``chunk_overlap`` patches (:mod:`.chunking`). A micro-batch is
``patches`` [rows, max_patches, 3 * p * p] (pixels in [0, 1]) and ``patch_valid`` [rows,
max_patches].

Document ``i`` depends on (seed, i) only, and the stream on the count of documents consumed, so
it resumes on any data-parallel layout with the same global batch.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megatron_s2.config.next_patch import VisualNextPatchConfig
from megatron_s2.data.chunking import chunk_spans
from megatron_s2.data.errors import DataError
from megatron_s2.data.procedural_images import MIN_SIZE, procedural_item

__all__ = ["render_page", "document_patches", "PageDocuments", "TextWithPages"]

_STATE_VERSION = 1


def render_page(index: int, *, seed: int, size: int, items: int) -> torch.Tensor:
    """Page ``index``: [3, size, size] float in [0, 1], white paper with ``items`` procedural pictures."""
    item_size = max(MIN_SIZE, size // 2)
    if item_size > size:
        raise DataError(f"a {size}-pixel page cannot hold a procedural picture ({MIN_SIZE} pixels a side)")
    rng = random.Random(f"pages/{seed}/{index}")  # str seeds hash with SHA-512: stable across runs
    page = np.full((size, size, 3), 255, dtype=np.uint8)
    for k in range(items):
        art = procedural_item(index * items + k, seed=seed, size=item_size, as_array=True).image
        y, x = rng.randint(0, size - item_size), rng.randint(0, size - item_size)
        page[y:y + item_size, x:x + item_size] = art
    return torch.from_numpy(page).permute(2, 0, 1).float() / 255.0


def document_patches(pages: torch.Tensor, cfg: VisualNextPatchConfig) -> torch.Tensor:
    """A document's pages [n, 3, H, W] -> its kept patches [L, 3 * p * p], page after page, each
    page in raster order with blank paper dropped (Eq. 5)."""
    from megatron_s2.models.next_patch import foreground_mask, patchify, raster_scan

    patches = patchify(pages, cfg.patch_size)
    mask = foreground_mask(patches, threshold=cfg.foreground_threshold)
    scanned, valid = raster_scan(patches, mask)
    return scanned[valid]


class PageDocuments:
    """This data-parallel rank's visual rows, one optimiser step at a time (module docstring)."""

    def __init__(self, cfg: VisualNextPatchConfig, *, seed: int, dp_rank: int, dp_size: int,
                 micro_batches_per_rank: int):
        self.cfg, self.seed = cfg, seed
        self.dp_rank, self.micro_batches = dp_rank, micro_batches_per_rank
        self.per_step = dp_size * micro_batches_per_rank * cfg.documents_per_micro_batch
        self.consumed_documents = 0
        self._identity = {"seed": seed, "next_patch": {k: getattr(cfg, k) for k in (
            "patch_size", "page_size", "items_per_page", "pages_per_document", "max_patches", "chunk_overlap",
            "foreground_threshold")}}

    def document(self, index: int) -> torch.Tensor:
        cfg = self.cfg
        first = index * cfg.pages_per_document
        return torch.stack([render_page(first + k, seed=self.seed, size=cfg.page_size, items=cfg.items_per_page)
                            for k in range(cfg.pages_per_document)])

    def rows(self, documents: list[int]) -> dict[str, torch.Tensor]:
        """The chunks of ``documents`` as one micro-batch's ``patches`` / ``patch_valid``."""
        cfg = self.cfg
        width = 3 * cfg.patch_size ** 2
        chunks = []
        for index in documents:
            sequence = document_patches(self.document(index), cfg)
            chunks += [sequence[a:b] for a, b in chunk_spans(len(sequence), cfg.max_patches, cfg.chunk_overlap)]
        patches = torch.zeros(len(chunks), cfg.max_patches, width)
        valid = torch.zeros(len(chunks), cfg.max_patches, dtype=torch.bool)
        for row, chunk in enumerate(chunks):
            patches[row, :len(chunk)], valid[row, :len(chunk)] = chunk, True
        return {"patches": patches, "patch_valid": valid}

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        per_micro = self.cfg.documents_per_micro_batch
        first = self.consumed_documents + self.dp_rank * self.micro_batches * per_micro
        self.consumed_documents += self.per_step
        return [self.rows(list(range(first + k * per_micro, first + (k + 1) * per_micro)))
                for k in range(self.micro_batches)]

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "consumed_documents": self.consumed_documents, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise DataError(f"page stream state: version {state.get('version')!r}, expected {_STATE_VERSION}")
        mismatched = [f"{key} (saved {state.get(key)!r}, now {value!r})"
                      for key, value in self._identity.items() if state.get(key) != value]
        if mismatched:
            raise DataError("page stream state was saved for different pages: " + "; ".join(mismatched)
                            + ". Resume with the same phase.next_patch settings and seed.")
        self.consumed_documents = int(state["consumed_documents"])


class TextWithPages:
    """The phase's data: the recipe's text micro-batches, each given the page rows of the same
    index (Eq. 9 interleaves the two objectives in every step)."""

    def __init__(self, text, pages: PageDocuments):
        self.text, self.pages = text, pages

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        text, pages = self.text.next_step(), self.pages.next_step()
        if len(text) != len(pages):
            raise DataError(f"{len(text)} text micro-batches but {len(pages)} of pages in this step")
        return [{**t, **p} for t, p in zip(text, pages)]

    def state_dict(self) -> dict[str, Any]:
        return {"text": self.text.state_dict(), "pages": self.pages.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"text", "pages"}:
            raise DataError("data state was not saved by a visual_next_patch phase (no 'text' / 'pages' entries)")
        self.text.load_state_dict(state["text"])
        self.pages.load_state_dict(state["pages"])
