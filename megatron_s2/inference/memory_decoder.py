"""A Memory Decoder plug-in next to a served backbone (Intern-S2 walkthrough Ch. 2, Eq. 3).

A ``memdec_router`` run's checkpoint is the plug-in: the memory decoder (a small model of the
backbone's tokenizer) and its router (``memdec_router.*``). :func:`load_memory_decoder` reads it
and refuses one that does not fit the served backbone; :class:`MemoryDecoder` holds it and owns
the one implementation of the per-token mix

    p_t = (1 - lambda_t) p_base,t + lambda_t p_mem,t,   lambda_t = router(h_base, h_mem, p_base, p_mem)

computed in log space (:func:`~megatron_s2.models.memory_decoder.interpolated_log_probs`), from
both models' final hidden states and logits — whether those come from one whole-sequence forward
(:meth:`MemoryDecoder.full_forward`: scoring, prompt log-probs, the held-out bench) or from the
inference engine, which runs the memory's own family executor over the same chunks as the
backbone's in every step (one cache state per model and request, admitted, preempted and
released together; ``InferenceEngine(..., memory_decoder=)``). Both give the same distribution
(tests/memory_decoder/test_memdec_engine.py): the cache changes the cost, not the mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family import family_of
from megatron_s2.models.memory_decoder import MemoryRouter, interpolated_log_probs, whole_sequence, whole_vocabulary
from megatron_s2.models.memory_decoder.router import NUM_UNCERTAINTY_FEATURES

__all__ = ["MemoryDecoder", "FusedLogProbs", "MemorySlot", "load_memory_decoder", "hidden_and_log_probs",
           "ROUTER_PREFIX"]

ROUTER_PREFIX = "memdec_router."
"""Names of the router's tensors in a ``memdec_router`` checkpoint (the rest is the memory decoder)."""


def hidden_and_log_probs(model, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [b, s, d] float32, log p [b, s, V] float32) of a family ``model`` on ``micro_batch``
    (``tokens`` and optionally ``position_ids`` / ``doc_ids``), one whole-sequence forward in a
    fresh context: the normalised last hidden state (datastore keys, router features) and the
    log-probabilities, whole on every rank of a tensor- / sequence-parallel model (gathered over
    tp, :mod:`megatron_s2.models.memory_decoder.whole`)."""
    ctx = model.make_context(micro_batch)
    hidden = model.run_layers(model.embed(micro_batch["tokens"]), ctx)
    final = whole_sequence(model.final_hidden(*hidden), model.groups).float()
    return final, torch.log_softmax(whole_vocabulary(model.head(*hidden), model.groups).float(), dim=-1)


@dataclass
class FusedLogProbs:
    backbone: torch.Tensor   # [..., V]
    memory: torch.Tensor     # [..., V]
    fused: torch.Tensor      # [..., V], log of Eq. (3)
    lam: torch.Tensor        # [...]


class MemoryDecoder:
    """The frozen memory decoder and its router (module docstring)."""

    def __init__(self, memory: nn.Module, router: MemoryRouter, description: str = "memory decoder", *,
                 tokenizer_fingerprint: str | None = None, backbone_config=None):
        self.memory, self.router, self.description = memory, router, description
        self.tokenizer_fingerprint = tokenizer_fingerprint
        """The plug-in run's tokenizer (None: it carries no tokenizer files)."""
        self.backbone_config = backbone_config
        """The model config of the backbone it was trained against, when that checkpoint is readable."""

    @torch.no_grad()
    def mix(self, h_base: torch.Tensor, base_logits: torch.Tensor, h_mem: torch.Tensor,
            mem_logits: torch.Tensor) -> FusedLogProbs:
        """Eq. (3) per position from each model's hidden states [..., d] and logits (or
        log-probabilities) [..., V]."""
        logp_base = torch.log_softmax(base_logits.float(), dim=-1)
        logp_mem = torch.log_softmax(mem_logits.float(), dim=-1)
        lam = self.router(h_base.float(), h_mem.float(), logp_base, logp_mem)
        return FusedLogProbs(logp_base, logp_mem, interpolated_log_probs(logp_base, logp_mem, lam), lam)

    @torch.no_grad()
    def full_forward(self, backbone, tokens: torch.Tensor) -> FusedLogProbs:
        """Every position of ``tokens`` [b, s] from one whole-sequence forward of each model."""
        h_base, logp_base = hidden_and_log_probs(backbone, {"tokens": tokens})
        h_mem, logp_mem = hidden_and_log_probs(self.memory, {"tokens": tokens})
        return self.mix(h_base, logp_base, h_mem, logp_mem)

    def check_backbone(self, backbone_config, tokenizer=None) -> None:
        """ConfigError (one line) unless this plug-in was made for a backbone like ``backbone_config``:
        the same vocabulary, the same tokenizer (when both carry one), a router reading the
        backbone's width, and — when the plug-in records the backbone it was trained against —
        the same architecture (:func:`~megatron_s2.inference.weights.check_same_architecture`)."""
        from megatron_s2.inference.weights import check_same_architecture

        mem = self.memory.config
        if mem.vocab_size != backbone_config.vocab_size:
            raise ConfigError(f"--memory-decoder: {self.description} has vocab_size {mem.vocab_size}, the backbone "
                              f"{backbone_config.vocab_size}; the memory must share the backbone's tokenizer")
        if self.tokenizer_fingerprint is not None and tokenizer is not None \
                and self.tokenizer_fingerprint != tokenizer.fingerprint():
            raise ConfigError(f"--memory-decoder: {self.description} was trained with another tokenizer than the "
                              "backbone's; its token ids mean other text")
        if self.router.in_features != backbone_config.hidden_size + mem.hidden_size + NUM_UNCERTAINTY_FEATURES:
            raise ConfigError(f"--memory-decoder: the router of {self.description} reads {self.router.in_features} "
                              f"features, made for a backbone of hidden_size "
                              f"{self.router.in_features - mem.hidden_size - NUM_UNCERTAINTY_FEATURES}, not "
                              f"{backbone_config.hidden_size}")
        if self.backbone_config is not None:
            try:
                check_same_architecture(backbone_config, self.backbone_config, f"the backbone {self.description} was trained for")
            except ConfigError as exc:
                raise ConfigError(f"--memory-decoder: {str(exc).removeprefix('checkpoint: ')}") from None


class MemorySlot:
    """The memory executor's view of one engine request: the request's own token list (never a
    copy: what the backbone appends, the memory sees), the memory's own cache state and progress.
    Text only: the executors' image / series hooks see none."""

    images: tuple = ()
    series: tuple = ()
    content_spans: tuple = ()
    forecast = None

    def __init__(self, request):
        self.request, self.num_computed, self.kv = request, 0, None

    @property
    def tokens(self) -> list[int]:
        return self.request.tokens


def load_memory_decoder(path: str | Path, device: str | torch.device = "cpu") -> MemoryDecoder:
    """The plug-in of a ``memdec_router`` run / checkpoints / step directory, eval mode, on
    ``device``; ConfigError (one line) for a missing path or a checkpoint without a router.
    Check it against the served backbone with :meth:`MemoryDecoder.check_backbone`."""
    from megatron_s2.data.tokenizer_checks import find_checkpoint_tokenizer
    from megatron_s2.inference.weights import load_tokenizer, read_checkpoint
    from megatron_s2.runtime.device import build_on

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--memory-decoder: {path} does not exist; give the run (or checkpoint) directory of a "
                          "phase.kind: memdec_router run")
    try:
        loaded = read_checkpoint(str(path))
    except ConfigError as exc:
        raise ConfigError(f"--memory-decoder: {str(exc).removeprefix('checkpoint: ')}") from None
    cfg = loaded.model_config
    router_state = {k[len(ROUTER_PREFIX):]: v for k, v in loaded.state.items() if k.startswith(ROUTER_PREFIX)}
    if not router_state:
        raise ConfigError(f"--memory-decoder: {loaded.description} has no router tensors ({ROUTER_PREFIX}*); give "
                          "the checkpoint of a phase.kind: memdec_router run (the memdec run alone has no router)")
    if set(router_state) != {"inp.weight", "inp.bias", "out.weight", "out.bias"}:
        raise ConfigError(f"--memory-decoder: {loaded.description} holds router tensors {sorted(router_state)}, not "
                          "this version's MLP router (inp.*, out.*); retrain it with phase.kind: memdec_router")
    dev = torch.device(device)
    with build_on(dev):
        memory = family_of(cfg).build_model(cfg)
    memory.to(dev)
    missing, unexpected = memory.load_state_dict(
        {k: v for k, v in loaded.state.items() if not k.startswith(ROUTER_PREFIX)}, strict=False)
    if missing or unexpected:
        raise ConfigError(f"--memory-decoder: {loaded.description} does not match model '{cfg.name}' "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    hidden, in_features = router_state["inp.weight"].shape
    router = MemoryRouter(in_features - cfg.hidden_size - NUM_UNCERTAINTY_FEATURES, cfg.hidden_size, hidden=hidden)
    router.load_state_dict(router_state)
    fingerprint = None
    if find_checkpoint_tokenizer(loaded.directory) is not None:
        tokenizer = load_tokenizer(loaded.directory)
        fingerprint = tokenizer.fingerprint()
        memory.set_token_map(tokenizer.compressed_token_map(num_ids=cfg.vocab_size))
    return MemoryDecoder(memory.eval().requires_grad_(False), router.to(dev).eval().requires_grad_(False),
                         loaded.description, tokenizer_fingerprint=fingerprint,
                         backbone_config=_recorded_backbone(loaded))


def _recorded_backbone(loaded):
    """The model config of the backbone the plug-in was trained against (its run's
    ``phase.memdec_backbone``), when that checkpoint can still be read; else None."""
    from megatron_s2.inference.weights import read_model_config

    where = getattr(loaded.recipe.phase, "memdec_backbone", "") if loaded.recipe is not None else ""
    if not where:
        return None
    candidates = [Path(where)] if Path(where).is_absolute() else [Path.cwd() / where, loaded.directory / where,
                                                                  *(p / where for p in loaded.directory.parents)]
    for candidate in candidates:
        if candidate.exists():
            try:
                return read_model_config(candidate)
            except ConfigError:
                return None
    return None
