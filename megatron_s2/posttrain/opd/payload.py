"""How many bytes the teacher's signal takes per token (walkthrough Ch. 8, worked example 24: "the
communication payload, and why they cut it").

OPD gives the student a teacher opinion at every position of its own trajectory; that opinion
travels from a teacher-scoring worker to the learner. Per token, by what is sent:

* ``full_vocab`` — the whole distribution, ``V`` values: O(H V) per trajectory of H tokens
  (report §5.2.4's full-vocabulary KL; ``opd.mode: full_vocab``);
* ``top_k`` — the ``k`` most likely tokens, ``k`` values and their ``k`` token indices: O(H k)
  (the walkthrough's middle option, top-64; no mode of ours sends it);
* ``sampled_token`` — the teacher's log-probability of the token the student sampled, one value:
  O(H) (Eq. 33; ``opd.mode: sampled_token``). The token is the learner's own, so no index travels.

Worked example 24 takes H = 262,144 and V = 100,000. Its figures — 33.6 MB per trajectory for
top-64, ~275 GB for 8,192 of them, ~4.3 GB for sampled tokens, "64x smaller", "roughly
100,000x smaller" — all follow from 2-byte (bf16) values **with no index bytes** counted for
top-k (tests/posttrain/test_opd.py); carrying int32 indices as well would make top-64 three
times its figure and 192x the sampled-token signal.

Per optimiser step the trainer reports (``metrics.jsonl``, :func:`step_payload_metrics`):

* ``opd_teacher_signal_bytes`` — the signal of the step's loss tokens in the run's mode, at the
  precision the trainer holds it (float32 teacher log-probs or logits): what a teacher-scoring
  worker would send a learner as a tensor (zero network bytes for an in-process teacher);
* ``opd_teacher_http_bytes`` — with served teachers: the bytes of their HTTP answers to the
  step's scoring requests (vLLM's JSON ``prompt_logprobs``), what actually travelled.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["SignalMode", "SIGNAL_MODES", "signal_bytes_per_token", "signal_bytes", "step_payload_metrics"]

SignalMode = Literal["full_vocab", "top_k", "sampled_token"]
SIGNAL_MODES: tuple[str, ...] = ("full_vocab", "top_k", "sampled_token")


def signal_bytes_per_token(mode: SignalMode, *, vocab_size: int, value_bytes: int, top_k: int = 0,
                           index_bytes: int = 0) -> int:
    """Bytes of the teacher's signal for one token: ``vocab_size`` values (full_vocab), ``top_k``
    values plus their indices (top_k), or one value (sampled_token)."""
    if vocab_size < 1 or value_bytes < 1 or index_bytes < 0:
        raise ValueError(f"vocab_size and value_bytes must be >= 1, index_bytes >= 0; got {vocab_size}, "
                         f"{value_bytes}, {index_bytes}")
    if mode == "full_vocab":
        return vocab_size * value_bytes  # dense: the position in the row is the token
    if mode == "top_k":
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"top_k must be in 1..vocab_size = {vocab_size}, got {top_k}")
        return top_k * (value_bytes + index_bytes)
    if mode == "sampled_token":
        return value_bytes  # the sampled token is the learner's own: only its value travels
    raise ValueError(f"mode must be one of {', '.join(SIGNAL_MODES)}, got {mode!r}")


def signal_bytes(mode: SignalMode, tokens: int, **encoding) -> int:
    """Bytes of the signal for ``tokens`` positions (a trajectory, a batch)."""
    return tokens * signal_bytes_per_token(mode, **encoding)


def step_payload_metrics(mode: SignalMode, *, tokens: int, vocab_size: int, value_bytes: int, http_bytes: int,
                         served: bool, groups) -> dict[str, float]:
    """The step's ``opd_teacher_signal_bytes`` (``tokens``: the step's global loss tokens) and,
    with served teachers, ``opd_teacher_http_bytes`` (``http_bytes``: this rank's answers,
    summed over the world; only a replica's first rank sends requests)."""
    out = {"opd_teacher_signal_bytes": float(signal_bytes(mode, tokens, vocab_size=vocab_size,
                                                           value_bytes=value_bytes))}
    if served:
        import torch.distributed as dist

        total = torch.tensor([float(http_bytes)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_s2.posttrain.train_batch import g_device

            total = total.to(g_device(groups))
            dist.all_reduce(total)
        out["opd_teacher_http_bytes"] = float(total.cpu()[0])
    return out
