"""Frozen in-process models next to the policy: OPD teachers (report §5.2.4, walkthrough Ch. 8), the
reference of a KL term, and the Memory Decoder's backbone (walkthrough Ch. 2; built with the training
layout's groups: every layer on each pipeline stage, read on the last, megatron_s2/posttrain/memdec).

A frozen model holds every layer on the rank (pp = cp = 1) with the rollout layout's tensor /
expert groups, so its vocabulary shard ``[b, s, V/tp]`` lines up with the policy's on every
tensor-parallel rank (the full-vocabulary KL never gathers the vocabulary). It is built with
the architecture saved in its own checkpoint — a teacher may be larger or smaller than the
student, it only has to share the tokenizer (the vocabulary size is checked) — and each rank
copies its slices of the checkpoint's full tensors (their ShardSpecs).

:class:`TeacherPool` routes each training row to the teacher of its dataset's domain; switching
teacher per sample is a different forward over resident weights, never a reload. Sampled-token
OPD teachers may also be remote (:class:`~megatron_s2.posttrain.opd.remote_teacher.RemoteTeacher`,
an OpenAI-compatible endpoint returning prompt log-probs); :meth:`TeacherPool.token_logprobs`
mixes both kinds row by row, in one layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.family import family_of
from megatron_s2.parallel.groups import ParallelGroups
from megatron_s2.parallel.sharding import shard_spec, slice_of
from megatron_s2.posttrain.vocab_parallel import token_log_probs

__all__ = ["load_frozen_model", "full_logits", "TeacherPool"]


def load_frozen_model(path: str | Path, groups: ParallelGroups, *, vocab_size: int, tokenizer, what: str,
                      device: torch.device | str = "cpu", layout=None) -> torch.nn.Module:
    """The model saved at ``path`` (run / checkpoints / step directory or Hugging Face export),
    this rank's slices, evaluation mode, no gradients; ``layout`` (the ParallelLayout of
    ``groups``), when given, must be able to split it (ParallelLayout.check_frozen_model)."""
    from megatron_s2.inference.weights import read_checkpoint

    try:
        loaded = read_checkpoint(path)
    except ConfigError as exc:  # its messages say "checkpoint:"; the recipe key is ``what``
        raise ConfigError(f"{what}: {str(exc).removeprefix('checkpoint: ')}") from None
    cfg = loaded.model_config
    if cfg.vocab_size != vocab_size:
        raise ConfigError(f"{what}: {path} has vocab_size {cfg.vocab_size}, the policy {vocab_size}; a teacher or "
                          "reference must share the policy's tokenizer")
    model = family_of(cfg).build_model(cfg, groups).to(device)
    model.apply_precision_map()
    model.set_token_map(tokenizer.compressed_token_map(num_ids=cfg.vocab_size))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if name not in loaded.state:
                raise ConfigError(f"{what}: {loaded.description} has no tensor '{name}'")
            full = loaded.state[name]
            local = slice_of(full, shard_spec(params[name])) if name in params else full
            target.copy_(local.to(device=target.device, dtype=target.dtype))
    model.eval().requires_grad_(False)
    return model


@torch.no_grad()
def full_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary shard of the logits [b, s, V/tp] of a whole-model forward (the
    sequence padded to a multiple of tp for the tensor-parallel MoE token split)."""
    s = tokens.size(1)
    pad = -s % model.groups.tp.size
    if pad:
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.size(0), pad)], dim=1)
    logits = model(tokens, model.make_context({"tokens": tokens}))
    return logits[:, :s].float()


class TeacherPool:
    """Teachers by name — in-process models and remote endpoints — and the teacher of every domain."""

    def __init__(self, teachers: Mapping[str, torch.nn.Module], domain_teacher: Mapping[str, str],
                 temperatures: Mapping[str, float], remote: Mapping | None = None):
        self.teachers, self.domain_teacher, self.temperatures = dict(teachers), dict(domain_teacher), dict(temperatures)
        self.remote = dict(remote or {})
        """Remote teachers (RemoteTeacher) by name: sampled-token log-probs only, no logits."""

    @torch.no_grad()
    def token_logprobs(self, tokens: torch.Tensor, labels: torch.Tensor, domains: Sequence[str], tp,
                       loss_mask: torch.Tensor | None = None, replica: ParallelGroups | None = None) -> torch.Tensor:
        """Sampled-token teacher log-probs [b, s] float32 (walkthrough Eq. 33's log pi_T of every
        label) from each row's domain teacher at its temperature: in process through the
        vocabulary shard, or from a remote teacher's prompt log-probs (0 after the row's last
        ``loss_mask`` label, which the advantage never reads), requested once per data-parallel
        replica (``replica``: the trainer's groups; every rank of a replica holds this batch)."""
        from megatron_s2.posttrain.opd.remote_teacher import once_per_replica

        names = [self.domain_teacher[d] for d in domains]
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        for name in sorted(set(names)):
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], device=tokens.device)
            toks, labs = tokens.index_select(0, rows), labels.index_select(0, rows)
            if name in self.remote:
                mask = None if loss_mask is None else loss_mask.index_select(0, rows)
                teacher = self.remote[name]
                part = once_per_replica(lambda: teacher.token_logprobs(toks, labs, mask), tuple(toks.shape), replica)
            else:
                logits = full_logits(self.teachers[name], toks) / self.temperatures[name]
                part = token_log_probs(logits, labs, tp, 1.0)
            out.index_copy_(0, rows, part.to(out.dtype))
        return out

    def logits(self, tokens: torch.Tensor, domains: Sequence[str]) -> torch.Tensor:
        """Teacher logits shard [b, s, V/tp] of each row, from its domain's teacher (at the
        teacher's temperature)."""
        out = None
        names = [self.domain_teacher[d] for d in domains]
        for name in sorted(set(names)):
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], device=tokens.device)
            part = full_logits(self.teachers[name], tokens.index_select(0, rows)) / self.temperatures[name]
            if out is None:
                out = part.new_zeros(tokens.size(0), tokens.size(1), part.size(-1))
            out.index_copy_(0, rows, part)
        return out
