"""Inference: continuous batching with token-level interruption and per-token policy versions
(report §5.2.3) over a model family's exact KV-cached executor (V4.1's: ``models/v41/inference``,
its packed KV formats and tiers, §2.4.4, §3.2).

Entry points: :class:`InferenceEngine` (the token-level core, + :class:`EngineConfig`,
:class:`SamplingParams`), :class:`EngineDriver` (the one loop that runs it: server, rollouts,
``generate``). Module map: ``engine`` (admission, scheduling, sampling, stops), ``driver``,
``request``, ``sampling``, ``detokenizer`` (incremental text and stop strings), ``weights``
(weight updates from checkpoints), ``memory_decoder`` (a Memory Decoder plug-in the engine mixes
in every step).
"""

from megatron_s2.config.engine import EngineConfig
from megatron_s2.inference.driver import DriverStopped, EngineDriver
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

__all__ = ["InferenceEngine", "EngineDriver", "DriverStopped", "EngineConfig", "SamplingParams", "RequestOutput", "CompletedRequest", "RequestHandle",
           "FinishReason", "QueueFull", "PromptTooLong"]
