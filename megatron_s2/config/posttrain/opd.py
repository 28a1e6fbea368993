"""The ``opd:`` section: on-policy distillation as rollout source x advantage x loss.

Two modes (the rollout source is the student in both — on-policy):

* ``sampled_token`` (walkthrough Ch. 8, Eq. 31-36): the advantage of each sampled token is
  sg[log pi_T - log pi_prox] (Eq. 33), the loss is the shared truncated-importance-weighted
  policy-gradient term (Eq. 34-36), teachers are chosen per domain with weights lambda_d.
  A teacher is loaded in process (``checkpoint``) or reached over an OpenAI-compatible
  ``endpoint`` that returns prompt log-probs (``megatron-s2 serve``, vLLM); both kinds mix.
* ``full_vocab`` (report §5.2.4): reverse KL over the full vocabulary against one of several
  teachers sharing the tokenizer (possibly of another architecture/size), chosen per sample.

Example::

    opd:
      mode: sampled_token
      teachers:
        - {name: reasoning, domains: [math, science], checkpoint: runs/rl_reasoning/checkpoints}
        - {name: agentic, domains: [swe], endpoint: http://teacher:8000/v1}   # megatron-s2 serve / vLLM
      domain_weights: {math: 1.0, science: 1.0, swe: 0.5}
      proximal: snapshot
      rollout: {group_size: 1, max_in_flight: 64, batch_groups: 64}
      loss: {terms: [{kind: policy_gradient}]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.posttrain.checks import positive
from megatron_s2.config.posttrain.loss import LossConfig
from megatron_s2.config.posttrain.rl import check_staleness_pairing
from megatron_s2.config.posttrain.environment import EvaluationConfig
from megatron_s2.config.posttrain.rollout import RolloutConfig

__all__ = ["TeacherConfig", "SftWarmupConfig", "OPDConfig"]


def _check_url(teacher: str, url: str) -> None:
    """An http(s) base URL with a host (the value only; reachability is checked at start-up)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise ConfigError(f"endpoint: teacher '{teacher}': {url!r} is not an http(s) URL; give the teacher server's "
                          "base URL, e.g. http://host:8000/v1")


@dataclass(frozen=True)
class TeacherConfig:
    """One teacher; it shares the student's tokenizer but may differ in architecture and size."""

    name: str
    """Teacher name (metrics, logs)."""
    domains: tuple[str, ...] = ()
    """Domains (rollout dataset domains) this teacher supervises; each domain has exactly one teacher."""
    checkpoint: str = ""
    """In-process teacher: checkpoint directory (switching teachers per sample costs no reload)."""
    model: str = ""
    """In-process teacher: model recipe (name in recipes/models or path) if it differs from the student's."""
    endpoint: str = ""
    """Remote teacher (sampled_token mode only): OpenAI-compatible base URL, e.g.
    ``http://teacher:8000/v1`` of ``megatron-s2 serve <teacher checkpoint> --port 8000`` (or vLLM),
    whose ``/completions`` returns vLLM's ``prompt_logprobs``; training rows are scored as token-id
    prompts (``max_tokens: 1``, ``prompt_logprobs: 0``), the SFT warm-up's trajectories and the
    evaluation's teacher answers are its completions, and the evaluation's KL reads its full
    distribution (serve it with ``--max-logprobs -1``). Checked once at start-up."""
    temperature: float = 1.0
    """Temperature of the teacher's distribution: log softmax(logits / T). A remote teacher's
    server applies it (``prompt_logprobs_temperature``, honoured by ``megatron-s2 serve``; vLLM
    returns T = 1 prompt log-probs, so keep 1.0 with a vLLM teacher)."""
    request_timeout_s: float = 60.0
    """Remote teacher: seconds one scoring request may take before it fails (after retries the step fails)."""
    max_concurrent_requests: int = 8
    """Remote teacher: scoring requests in flight at once (rows of a micro-batch are scored concurrently)."""
    rows_per_request: int = 8
    """Remote teacher: training rows (token-id prompts) per scoring request; the server scores them together."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name: every teacher needs a name")
        if not self.domains:
            raise ConfigError(f"domains: teacher '{self.name}' supervises no domain; list at least one")
        if bool(self.checkpoint) == bool(self.endpoint):
            raise ConfigError(f"checkpoint: teacher '{self.name}' needs exactly one of checkpoint (in-process) "
                              "or endpoint (OpenAI-compatible URL)")
        if self.model and not self.checkpoint:
            raise ConfigError(f"model: teacher '{self.name}' names a model recipe but no checkpoint to load into it")
        if self.endpoint:
            _check_url(self.name, self.endpoint)
        positive("temperature", self.temperature)
        positive("request_timeout_s", self.request_timeout_s)
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"max_concurrent_requests: must be >= 1, got {self.max_concurrent_requests}")
        if self.rows_per_request < 1:
            raise ConfigError(f"rows_per_request: must be >= 1, got {self.rows_per_request}")


@dataclass(frozen=True)
class SftWarmupConfig:
    """Lightweight SFT warm-up on teacher trajectories before OPD (walkthrough Ch. 8: "a lightweight
    SFT warmup on the original SFT model [...] becomes the initial student").

    The first ``steps`` optimiser steps of the phase (counted in ``training.train_steps``) are
    cross-entropy on the teachers' response tokens (prompt and environment tokens loss-masked),
    through the phase's trainer, optimiser, layout and checkpoints; OPD updates follow. The
    trajectories are generated by the teachers on the phase's training prompts (each prompt by its
    domain's teacher, in process or on its server when it is an endpoint), or come from ``data``.
    Implementation:
    :mod:`megatron_s2.posttrain.opd.warmup`.
    """

    steps: int = 0
    """Optimiser steps of SFT on teacher trajectories before OPD starts (part of training.train_steps); 0 = none."""
    data: str = ""
    """'' = the teachers (in process or served) generate the trajectories on the rollout datasets'
    training prompts; a path = a JSON-lines file of teacher trajectories instead, one object per
    line ``{"tokens": [ids], "loss_mask": [0/1 per token]}`` (1 on the teacher's response tokens)."""
    temperature: float = 0.0
    """Sampling temperature of the teachers' generations (0 = greedy, the teacher's best answer)."""
    verified_only: bool = False
    """Rejection sampling: only the generated trajectories the environment verified correct bear
    loss (the others stay in the batch fully masked, so the prompt order is unchanged)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps: must be >= 0, got {self.steps}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.verified_only and self.data:
            raise ConfigError("verified_only: a trajectories file carries no verdicts; set verified_only: false or "
                              "data: '' (trajectories generated and verified in process)")


@dataclass(frozen=True)
class OPDConfig:
    """On-policy distillation (walkthrough Ch. 8; report §5.2.4)."""

    mode: Literal["sampled_token", "full_vocab"] = "sampled_token"
    """'sampled_token': Eq. 33 advantage on the student's sampled tokens; 'full_vocab': reverse KL over the vocabulary."""
    teachers: tuple[TeacherConfig, ...] = ()
    """Teachers, each with the domains it supervises."""
    domain_weights: dict[str, float] = field(default_factory=dict)
    """lambda_d per domain (Eq. 36 loss weight); domains not listed weigh 1.0."""
    proximal: Literal["snapshot", "behaviour"] = "snapshot"
    """pi_prox of Eq. 33: 'snapshot' = the student's weights frozen at the start of each rollout
    batch (a no-grad forward); 'behaviour' = the rollout log-probabilities themselves."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Student rollouts (on-policy, asynchronous like RL); the OPD advantage is per token, so
    group_size may be 1."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The shared loss (full_vocab mode: terms [{kind: full_vocab_kl}])."""
    sft_warmup: SftWarmupConfig = field(default_factory=SftWarmupConfig)
    """Optional SFT warm-up on teacher trajectories."""
    eval: EvaluationConfig = field(default_factory=EvaluationConfig)
    """Held-out evaluation: the student's log-likelihood of the teacher's greedy answers and the
    verifiable accuracy (before, during, after)."""

    def __post_init__(self) -> None:
        if not self.teachers:
            raise ConfigError("opd.teachers: at least one teacher is needed")
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ConfigError(f"opd.teachers: duplicate teacher names {names}")
        owner: dict[str, str] = {}
        for t in self.teachers:
            if len(set(t.domains)) != len(t.domains):
                twice = sorted({d for d in t.domains if t.domains.count(d) > 1})
                raise ConfigError(f"opd.teachers: teacher '{t.name}' lists domain '{twice[0]}' twice; list each once")
            for d in t.domains:
                if d in owner:
                    raise ConfigError(f"opd.teachers: domain '{d}' is supervised by both '{owner[d]}' and "
                                      f"'{t.name}'; each query is assigned one teacher (walkthrough Ch. 8)")
                owner[d] = t.name
        for d, w in self.domain_weights.items():
            if d not in owner:
                raise ConfigError(f"opd.domain_weights: domain '{d}' has no teacher; known domains: "
                                  f"{', '.join(sorted(owner))}")
            if not (math.isfinite(w) and w >= 0):
                raise ConfigError(f"opd.domain_weights.{d}: must be a finite number >= 0, got {w}")
        if self.rollout.source != "policy":
            raise ConfigError("opd.rollout.source: OPD is on-policy; the student generates ('policy')")
        for slot in self.rollout.datasets:
            if (slot.domain or slot.name) not in owner:
                raise ConfigError(f"opd.rollout.datasets.{slot.name}: its domain '{slot.domain or slot.name}' has "
                                  f"no teacher; add it to a teacher's domains or set the dataset's domain")
        if not self.rollout.datasets and self.dataset_domain("default") not in owner:
            raise ConfigError(f"opd.teachers: the prompts of rollout.environment are domain 'default', which no "
                              f"teacher supervises (domains {sorted(owner)}); add 'default' to a teacher's domains, "
                              "or list rollout.datasets with their domain")
        if self.mode == "full_vocab":
            if not self.loss.has_term("full_vocab_kl"):
                raise ConfigError("opd.loss.terms: full_vocab mode needs a 'full_vocab_kl' term (report §5.2.4); "
                                  "set loss.terms: [{kind: full_vocab_kl}]")
            if self.loss.has_term("policy_gradient"):
                raise ConfigError("opd.loss.terms: full_vocab mode distils the whole distribution; drop the "
                                  "'policy_gradient' term (it belongs to mode: sampled_token)")
            remote = [t.name for t in self.teachers if t.endpoint]
            if remote:
                raise ConfigError(f"opd.teachers: full_vocab mode needs every teacher's full distribution; "
                                  f"{remote} are endpoints (give them a checkpoint or use mode: sampled_token)")
        else:
            if not self.loss.has_term("policy_gradient"):
                raise ConfigError("opd.loss.terms: sampled_token mode needs a 'policy_gradient' term (Eq. 36)")
            if self.loss.has_term("full_vocab_kl"):
                raise ConfigError("opd.loss.terms: 'full_vocab_kl' belongs to mode: full_vocab")
        check_staleness_pairing("opd", self.rollout, self.loss)

    def dataset_domain(self, dataset: str) -> str:
        """The domain of a rollout dataset's prompts: its ``domain`` (default: its name). The one
        dataset of a section without ``rollout.datasets`` is 'default', supervised by the teacher of
        the only domain when the teachers list exactly one."""
        for slot in self.rollout.datasets:
            if slot.name == dataset:
                return slot.domain or slot.name
        domains = [d for t in self.teachers for d in t.domains]
        if dataset == "default" and "default" not in domains and len(domains) == 1:
            return domains[0]
        return dataset

    def teacher_for(self, domain: str) -> TeacherConfig:
        for t in self.teachers:
            if domain in t.domains:
                return t
        raise KeyError(f"no teacher supervises domain '{domain}'")

    def weight_of(self, domain: str) -> float:
        return float(self.domain_weights.get(domain, 1.0))
