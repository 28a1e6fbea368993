"""The trained plug-in next to its backbone: Eq. (3) per token, and held-out perplexities.

A ``memdec_router`` run's checkpoint holds the memory decoder and its router (``memdec_router.*``);
:func:`load_fused` reads it with the backbone's checkpoint into a :class:`FusedModel`, whose
:meth:`~FusedModel.log_probs` returns, for every position, the backbone's, the memory's and the
fused log-distribution and the router's lambda — the full-forward reference that engine
interpolation must reproduce, and what bench/memory_decoder.py measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family import family_of
from megatron_s2.models.memory_decoder import MemoryRouter, interpolated_log_probs
from megatron_s2.models.memory_decoder.router import NUM_UNCERTAINTY_FEATURES
from megatron_s2.posttrain.memdec.datastore import document_windows
from megatron_s2.posttrain.memdec.forward import hidden_and_log_probs

__all__ = ["FusedModel", "FusedLogProbs", "load_plugin", "load_fused", "held_out_nll"]

ROUTER_PREFIX = "memdec_router."


@dataclass
class FusedLogProbs:
    backbone: torch.Tensor   # [b, s, V]
    memory: torch.Tensor     # [b, s, V]
    fused: torch.Tensor      # [b, s, V], log of Eq. (3)
    lam: torch.Tensor        # [b, s]


class FusedModel:
    """A frozen backbone, a frozen memory decoder and its router (module docstring)."""

    def __init__(self, backbone, memory, router: MemoryRouter):
        self.backbone, self.memory, self.router = backbone, memory, router

    @torch.no_grad()
    def log_probs(self, tokens: torch.Tensor) -> FusedLogProbs:
        h_base, logp_base = hidden_and_log_probs(self.backbone, {"tokens": tokens})
        h_mem, logp_mem = hidden_and_log_probs(self.memory, {"tokens": tokens})
        lam = self.router(h_base, h_mem, logp_base, logp_mem)
        return FusedLogProbs(logp_base, logp_mem, interpolated_log_probs(logp_base, logp_mem, lam), lam)


def load_plugin(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, MemoryRouter]:
    """(memory decoder, router) of a ``memdec_router`` run / checkpoints / step directory, eval mode."""
    from megatron_s2.inference.weights import read_checkpoint

    loaded = read_checkpoint(str(path))
    cfg = loaded.model_config
    router_state = {k[len(ROUTER_PREFIX):]: v for k, v in loaded.state.items() if k.startswith(ROUTER_PREFIX)}
    if not router_state:
        raise ConfigError(f"memory decoder: {loaded.description} has no router tensors ({ROUTER_PREFIX}*); give the "
                          "checkpoint of a phase.kind: memdec_router run")
    memory = family_of(cfg).build_model(cfg)
    missing, unexpected = memory.load_state_dict(
        {k: v for k, v in loaded.state.items() if not k.startswith(ROUTER_PREFIX)}, strict=False)
    if missing or unexpected:
        raise ConfigError(f"memory decoder: {loaded.description} does not match model '{cfg.name}' "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if set(router_state) != {"inp.weight", "inp.bias", "out.weight", "out.bias"}:
        raise ConfigError(f"memory decoder: {loaded.description} holds router tensors {sorted(router_state)}, not this "
                          "version's MLP router (inp.*, out.*); retrain it with phase.kind: memdec_router")
    hidden, in_features = router_state["inp.weight"].shape
    router = MemoryRouter(in_features - cfg.hidden_size - NUM_UNCERTAINTY_FEATURES, cfg.hidden_size, hidden=hidden)
    router.load_state_dict(router_state)
    return memory.to(device).eval().requires_grad_(False), router.to(device).eval().requires_grad_(False)


def load_fused(backbone_path: str | Path, plugin_path: str | Path, device: str | torch.device = "cpu"):
    """(:class:`FusedModel`, tokenizer) from the backbone's and the plug-in's checkpoints."""
    from megatron_s2.inference.weights import load_model

    backbone, tokenizer, _ = load_model(str(backbone_path), device=str(device))
    memory, router = load_plugin(plugin_path, device)
    if memory.config.vocab_size != backbone.config.vocab_size:
        raise ConfigError(f"memory decoder: vocab_size {memory.config.vocab_size} differs from the backbone's "
                          f"{backbone.config.vocab_size}; the memory must share the backbone's tokenizer")
    if router.in_features != backbone.config.hidden_size + memory.config.hidden_size + NUM_UNCERTAINTY_FEATURES:
        raise ConfigError(f"memory decoder: the router of {plugin_path} was trained for another backbone width "
                          f"(it reads {router.in_features} features)")
    return FusedModel(backbone.requires_grad_(False), memory, router), tokenizer


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
