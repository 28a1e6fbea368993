"""``phase.next_patch``: visual next-patch pre-training (``phase.kind: visual_next_patch``).

Intern-S2 walkthrough Ch. 3, Eq. (5)–(9): rendered pages, a frozen encoder, the foreground mask
and raster scan, the backbone continuing the visual sequence patch by patch, scored
contrastively and added to the text loss with its weights. Documents of several pages are
scanned in order and split into chunks of at most ``max_patches`` sharing ``chunk_overlap``
patches (the walkthrough's chunking rule, :mod:`megatron_s2.data.chunking`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError

__all__ = ["VisualNextPatchConfig"]


@dataclass(frozen=True)
class VisualNextPatchConfig:
    lambda_text: float = 1.0
    """lambda_text of Eq. (9): weight of the text cross-entropy."""
    lambda_vis: float = 1.0
    """lambda_vis of Eq. (9): weight of the contrastive next-patch loss L_VP."""
    temperature: float = 0.07
    """tau of Eq. (7): the cosine similarities are divided by it before the in-batch softmax."""
    patch_size: int = 8
    """Pixels per side of one patch (one visual latent)."""
    latent_dim: int = 64
    """Width Dv of the frozen encoder's latents (the prediction head's output)."""
    page_size: int = 64
    """Pixels per side of a rendered page (a multiple of ``patch_size``)."""
    items_per_page: int = 2
    """Procedural pictures (shapes, digits, words) drawn on each page; the rest is blank paper."""
    pages_per_document: int = 2
    """Pages of one document, scanned in order into one visual sequence."""
    documents_per_micro_batch: int = 2
    """Documents rendered for each micro-batch (their chunks are its visual rows)."""
    max_patches: int = 64
    """Chunk cap: the longest visual sequence the backbone sees (walkthrough: 256k tokens)."""
    chunk_overlap: int = 8
    """Patches shared by consecutive chunks of a document (walkthrough: 512 tokens)."""
    foreground_threshold: float = 0.1
    """A patch is ink (m_i = 1) when a pixel differs from white paper by more than this (pixels in [0, 1])."""

    def __post_init__(self) -> None:
        where = "phase.next_patch"
        for name in ("lambda_text", "lambda_vis"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.lambda_text == 0 and self.lambda_vis == 0:
            raise ConfigError(f"{where}: lambda_text and lambda_vis are both 0; nothing would train")
        if not self.temperature > 0:
            raise ConfigError(f"{where}.temperature: must be positive, got {self.temperature}")
        for name in ("patch_size", "latent_dim", "page_size", "items_per_page", "pages_per_document",
                     "documents_per_micro_batch", "max_patches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        if self.page_size % self.patch_size:
            raise ConfigError(f"{where}.page_size: {self.page_size} is not a multiple of patch_size "
                              f"{self.patch_size}; pick a page that tiles into whole patches")
        if not 0 <= self.chunk_overlap < self.max_patches:
            raise ConfigError(f"{where}.chunk_overlap: must be in [0, max_patches={self.max_patches}), got "
                              f"{self.chunk_overlap}")
        if not 0 <= self.foreground_threshold < 1:
            raise ConfigError(f"{where}.foreground_threshold: must be in [0, 1), got {self.foreground_threshold}")
