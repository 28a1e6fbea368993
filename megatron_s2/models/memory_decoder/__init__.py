"""The Memory Decoder (Intern-S2 walkthrough Ch. 2, Eq. 1-4): a small, separately trained decoder
that imitates a kNN-LM retrieval distribution over a domain corpus, plugged into a frozen
backbone by a learned per-token router.

* :mod:`.knn` — the token-level datastore (keys: the frozen backbone's final hidden states on the
  domain corpus, values: the next tokens), exact nearest-neighbour search, and the retrieval
  distribution of Eq. (1).
* :mod:`.objective` — the memory decoder's training loss, Eq. (2): beta KL(p_kNN || p_mem) +
  (1 - beta) CE(gold).
* :mod:`.router` — the fusion p = (1 - lambda) p_base + lambda p_mem of Eq. (3), the router that
  reads both models' hidden states and uncertainty features, and its loss, Eq. (4).
* :mod:`.whole` — those hidden states and distributions whole on every rank of a tensor- /
  sequence-parallel model (gathered over tp), so every layout computes the one-rank objective.

Family-agnostic: the backbone and the memory are any two family models with one vocabulary;
generic code reaches them through :mod:`megatron_s2.models.family`.
"""

from megatron_s2.models.memory_decoder.knn import Datastore, knn_distribution, knn_log_probs
from megatron_s2.models.memory_decoder.objective import memory_decoder_loss, memory_decoder_token_loss
from megatron_s2.models.memory_decoder.router import (MemoryRouter, interpolate, interpolated_log_probs,
                                                      router_features, router_loss, router_token_loss)
from megatron_s2.models.memory_decoder.whole import whole_sequence, whole_vocabulary

__all__ = ["Datastore", "knn_distribution", "knn_log_probs", "memory_decoder_loss", "memory_decoder_token_loss",
           "MemoryRouter", "interpolate", "interpolated_log_probs", "router_features", "router_loss", "router_token_loss",
           "whole_sequence", "whole_vocabulary"]
