"""Full-vocabulary on-policy distillation with many teachers (report §5.2.4).

The final OPD stage of the report trains on every domain against 40+ teachers: the best
teacher of a domain may come from another stage of development and differ in architecture
and size from the student and from each other; they share the tokenizer. The loss per
position is the reverse KL over the full vocabulary, KL(pi_theta || pi_T(sample)), computed
on vocabulary-parallel shards (:func:`~megatron_s2.posttrain.vocab_parallel.vocab_parallel_kl`,
loss term ``full_vocab_kl``).

:class:`TeacherPool` holds the loaded teachers in process, each a callable ``tokens [b, s] ->
logits shard [b, s, V/tp]`` (our model, or any other architecture split the same way over the
vocabulary), and assembles one teacher-logit tensor for a micro-batch whose rows belong to
different teachers: each teacher runs once on its own rows. Switching teachers between
samples is an index choice — nothing is reloaded.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.vocab_parallel import token_log_probs

__all__ = ["TeacherPool"]

TeacherFn = Callable[[torch.Tensor], torch.Tensor]


class TeacherPool:
    """In-process teachers sharing the student's tokenizer and vocabulary split."""

    def __init__(self, teachers: Mapping[str, TeacherFn], domain_to_teacher: Mapping[str, str]):
        unknown = sorted(set(domain_to_teacher.values()) - set(teachers))
        if unknown:
            raise ValueError(f"domains are assigned to teachers that are not loaded: {unknown}")
        self.teachers, self.domain_to_teacher = dict(teachers), dict(domain_to_teacher)

    def teacher_of(self, domain: str) -> str:
        try:
            return self.domain_to_teacher[domain]
        except KeyError:
            raise KeyError(f"no teacher supervises domain '{domain}' "
                           f"(known: {', '.join(sorted(self.domain_to_teacher))})") from None

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, domains: Sequence[str]) -> torch.Tensor:
        """Teacher logits [b, s, V/tp] for each row from the teacher of its domain."""
        if len(domains) != tokens.size(0):
            raise ValueError(f"{len(domains)} domains for {tokens.size(0)} rows")
        names = [self.teacher_of(d) for d in domains]
        out: torch.Tensor | None = None
        for name in sorted(set(names)):
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], device=tokens.device)
            part = self.teachers[name](tokens.index_select(0, rows))
            if out is None:
                out = part.new_empty(tokens.size(0), *part.shape[1:])
            elif part.shape[1:] != out.shape[1:]:
                raise ValueError(f"teacher '{name}' returns logits of shape {tuple(part.shape[1:])}, others "
                                 f"{tuple(out.shape[1:])}: teachers must share the tokenizer and tp split")
            out.index_copy_(0, rows, part.to(out.dtype))
        return out

    @torch.no_grad()
    def token_logprobs(self, tokens: torch.Tensor, labels: torch.Tensor, domains: Sequence[str], tp: Group,
                       temperature: float = 1.0) -> torch.Tensor:
        """Sampled-token teacher log-probabilities [b, s] (Eq. 33's log pi_T) from in-process teachers."""
        return token_log_probs(self.logits(tokens, domains), labels, tp, temperature)
