"""Inference for the V4.1 backbone: exact KV-cached decode through the training modules and
parallel groups, the report's packed KV formats and KV tiers (§2.4.4, §3.2), continuous
batching with token-level interruption and per-token policy versions (§5.2.3).

Entry points: :class:`InferenceEngine` (+ :class:`EngineConfig`, :class:`SamplingParams`),
``megatron-s2 generate``. Module map: ``kv_formats`` (packed vectors), ``kv_store`` (pages,
SWA rings), ``kv_step`` (the attention layers' cache hooks), ``runner`` (one forward),
``tiers`` (prefix cache, SWA pool, bounded replay), ``sampling``, ``request``, ``engine``,
``weights`` (checkpoints), ``cli``.
"""

from megatron_s2.config.engine import EngineConfig
from megatron_s2.inference.engine import InferenceEngine
from megatron_s2.inference.request import (
    CompletedRequest,
    FinishReason,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    RequestOutput,
)
from megatron_s2.inference.sampling import SamplingParams

__all__ = ["InferenceEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletedRequest", "RequestHandle",
           "FinishReason", "QueueFull", "PromptTooLong"]
