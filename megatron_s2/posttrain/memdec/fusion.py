"""The trained plug-in next to its backbone: Eq. (3) per token, and held-out perplexities.

A ``memdec_router`` run's checkpoint holds the memory decoder and its router (``memdec_router.*``,
read by :func:`megatron_s2.inference.memory_decoder.load_memory_decoder`);
:func:`load_fused` reads it with the backbone's checkpoint into a :class:`FusedModel`, whose
:meth:`~FusedModel.log_probs` returns, for every position, the backbone's, the memory's and the
fused log-distribution and the router's lambda — the full-forward reference that engine
interpolation must reproduce, and what bench/memory_decoder.py measures.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_s2.inference.memory_decoder import (ROUTER_PREFIX, FusedLogProbs, MemoryDecoder,
                                                  load_memory_decoder)
from megatron_s2.posttrain.memdec.datastore import document_windows

__all__ = ["FusedModel", "FusedLogProbs", "load_fused", "held_out_nll", "ROUTER_PREFIX"]


class FusedModel:
    """A frozen backbone next to its plug-in (:class:`~megatron_s2.inference.memory_decoder.MemoryDecoder`,
    which owns the mix): whole-sequence forwards of both."""

    def __init__(self, backbone, plugin: MemoryDecoder):
        self.backbone, self.plugin = backbone, plugin
        self.memory, self.router = plugin.memory, plugin.router

    def log_probs(self, tokens: torch.Tensor) -> FusedLogProbs:
        return self.plugin.full_forward(self.backbone, tokens)


def load_fused(backbone_path: str | Path, plugin_path: str | Path, device: str | torch.device = "cpu"):
    """(:class:`FusedModel`, tokenizer) from the backbone's and the plug-in's checkpoints; a
    plug-in that does not fit the backbone is a ConfigError."""
    from megatron_s2.inference.weights import load_model

    backbone, tokenizer, _ = load_model(str(backbone_path), device=str(device))
    plugin = load_memory_decoder(plugin_path, device)
    plugin.check_backbone(backbone.config, tokenizer)
    return FusedModel(backbone.requires_grad_(False), plugin), tokenizer


@torch.no_grad()
def held_out_nll(fused: FusedModel, stores, *, seq_length: int, pad_id: int, batch_size: int = 16,
                 skip_document_start: bool = False) -> dict:
    """{"backbone" | "memory" | "fused": (summed NLL, tokens), "lambda": (summed lambda, tokens)}
    over the target tokens of ``stores`` (DocumentStores), windows of ``seq_length``;
    ``skip_document_start``: leave out each document's first token (predicted from ``bos`` alone,
    where nothing tells the router which corpus the document is from)."""
    sums = {name: [0.0, 0] for name in ("backbone", "memory", "fused", "lambda")}
    windows = list(document_windows(stores, seq_length))
    device = next(fused.backbone.parameters()).device
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        tokens = torch.full((len(batch), seq_length), pad_id, dtype=torch.long)
        labels = torch.zeros_like(tokens)
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        for row, (offset, window, is_target) in enumerate(batch):
            n = len(window) - 1
            tokens[row, :n] = torch.from_numpy(window[:-1].copy())
            labels[row, :n] = torch.from_numpy(window[1:].copy())
            mask[row, :n] = torch.from_numpy(is_target[:n].copy())
            if skip_document_start and offset == 0:
                mask[row, 0] = False
        out = fused.log_probs(tokens.to(device))
        labels, mask = labels.to(device), mask.to(device)
        for name in ("backbone", "memory", "fused"):
            nll = -getattr(out, name).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            sums[name][0] += float(nll[mask].sum())
            sums[name][1] += int(mask.sum())
        sums["lambda"][0] += float(out.lam[mask].sum())
        sums["lambda"][1] += int(mask.sum())
    return {name: tuple(value) for name, value in sums.items()}
