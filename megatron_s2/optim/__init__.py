"""Optimisers and learning-rate schedule of the DeepSeek-V4.1-Flash report (§2.5, §4.2.2).

* :mod:`.newton_schulz`, :mod:`.muon`: Muon and head-wise Muon.
* :mod:`.sinkhorn`: Sinkhorn-balanced momentum update (Eq. 7) for embeddings, prediction head
  and Engram tables.
* :mod:`.param_groups`: the ordered rule table that assigns each parameter its update rule.
* :mod:`.hybrid`: :func:`build_optimizer`, one object driving Muon, Sinkhorn and AdamW.
* :mod:`.clip`, :mod:`.lr_schedule`: gradient clipping and the warm-up/constant/cosine schedule.

The maths (``newton_schulz``, ``muon_update``, ``sinkhorn_balance``) are plain functions so the
distributed runtime can apply them to gathered or sharded matrices.
"""

from megatron_s2.optim.clip import clip_grad_norm_
from megatron_s2.optim.hybrid import HybridOptimizer, build_optimizer
from megatron_s2.optim.lr_schedule import LRSchedule, steps_for_tokens
from megatron_s2.optim.muon import Muon, as_matrix_batch, muon_update
from megatron_s2.optim.newton_schulz import (
    MUON_QUINTIC_COEFFICIENTS,
    POLAR_QUINTIC_COEFFICIENTS,
    POLISH_QUINTIC_COEFFICIENTS,
    newton_schulz,
)
from megatron_s2.optim.param_groups import ParamAssignment, assign_param_groups, describe_param_groups
from megatron_s2.optim.sinkhorn import SinkhornMomentum, sinkhorn_balance, sinkhorn_update

__all__ = [
    "HybridOptimizer",
    "LRSchedule",
    "MUON_QUINTIC_COEFFICIENTS",
    "Muon",
    "POLAR_QUINTIC_COEFFICIENTS",
    "POLISH_QUINTIC_COEFFICIENTS",
    "ParamAssignment",
    "SinkhornMomentum",
    "as_matrix_batch",
    "assign_param_groups",
    "build_optimizer",
    "clip_grad_norm_",
    "describe_param_groups",
    "muon_update",
    "newton_schulz",
    "sinkhorn_balance",
    "sinkhorn_update",
    "steps_for_tokens",
]
