"""One whole-model forward that returns what the Memory Decoder reads of a family model: the
normalised last hidden state (datastore keys, router features) and the log-probabilities — the
inference side's function (:func:`megatron_s2.inference.memory_decoder.hidden_and_log_probs`), so
the datastore, the training objectives and the served mix read the same states."""

from __future__ import annotations

from megatron_s2.inference.memory_decoder import hidden_and_log_probs

__all__ = ["hidden_and_log_probs"]
