"""What every endpoint reads: the backend, the tokenizer, the served name and limits."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from megatron_s2.serve.backend import AsyncEngine
from megatron_s2.serve.config import ServeConfig
from megatron_s2.serve.errors import BadRequest, NotFound
from megatron_s2.serve.fields import Fields, shown_text
from megatron_s2.serve.media import ServedImages

__all__ = ["ServerState", "new_id", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    """One server-sent event as OpenAI and vLLM emit them: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass
class ServerState:
    backend: AsyncEngine
    tokenizer: Any
    config: ServeConfig
    model_name: str
    """The id clients send as ``model`` and ``/v1/models`` lists."""
    description: str
    """Where the weights came from (shown by ``/v1/models`` as ``root``)."""
    created: int = field(default_factory=lambda: int(time.time()))
    session_seeds: dict[str, int] = field(default_factory=dict)
    """Session id -> the seed of its episode, for the sessions of an RL rollout: call ``k`` of such
    a session samples with seed ``call_seed(seed, k)`` (:mod:`megatron_s2.inference.sampling`) when
    the request sends none (harnesses send none), so an episode is reproducible whichever server
    answers (:mod:`megatron_s2.serve.gateway.turn`)."""

    @property
    def max_model_len(self) -> int:
        return self.backend.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.backend.engine.model_config.vocab_size

    @property
    def max_logprobs(self) -> int:
        """``ServeConfig.max_logprobs`` with -1 resolved to the vocabulary size (as vLLM does)."""
        return self.vocab_size if self.config.max_logprobs == -1 else self.config.max_logprobs

    @cached_property
    def series(self):
        """How chat ``time_series`` parts and ``/v1/forecast`` bodies are read (:mod:`megatron_s2.serve.series`)."""
        from megatron_s2.serve.series import ServedSeries

        return ServedSeries(self.backend.engine, self.config.allowed_local_media_path,
                            self.config.max_images_per_request)

    @cached_property
    def images(self) -> ServedImages:
        """How chat ``image_url`` parts are read and expanded (:mod:`megatron_s2.serve.media`)."""
        return ServedImages(self.backend.engine, self.config.allowed_local_media_path,
                            self.config.max_images_per_request)

    @cached_property
    def capture(self):
        """Token-in / token-out capture into the PrefixTree trace store (``ServeConfig.gateway_traces``),
        or None: :mod:`megatron_s2.serve.gateway`."""
        if not self.config.gateway_traces:
            return None
        from megatron_s2.serve.gateway.tito import Capture
        from megatron_s2.serve.gateway.traces import TraceStore

        return Capture(TraceStore(self.config.gateway_traces))

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_id", None)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text spans (a piece of a character counts as U+FFFD,
        3 bytes, at least what it covers), so a text of B bytes has at least B / this many tokens."""
        from megatron_s2.serve.text import token_text

        return max([1] + [len(token_text(self.tokenizer, i, False).encode("utf-8"))
                          for i in range(self.tokenizer.vocab_size)])

    def refuse_overlong_text(self, texts, field: str) -> None:
        """A text that cannot fit ``max_model_len`` whatever its tokenisation is refused before it
        is tokenised: tokenising megabytes runs on the event loop and stalls every other client."""
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        if n_bytes > self.max_model_len * self.max_token_bytes:
            at_least = -(-n_bytes // self.max_token_bytes)
            raise BadRequest(f"{field}: This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"your request has at least {at_least} input tokens ({n_bytes} bytes of text), which "
                             "leaves no room to generate. Please reduce the length of the input.", param=field)

    def refuse_unqueueable(self, choices: int, field: str) -> None:
        """A request of more choices than the engine's queue holds (every choice is queued
        before it runs) is a 400, not a 429 that no retry could get past."""
        waiting = self.backend.engine.config.max_waiting
        if choices > waiting:
            raise BadRequest(f"{field}: {choices} sequences (prompts x n) exceed the {waiting} this server queues at "
                             "once; split the request or raise --max-waiting", param=field)

    def check_model(self, f: Fields) -> None:
        """vLLM answers 404 for a model it does not serve (``model`` may be omitted)."""
        name = f.str("model")
        if name is not None and name != self.model_name:
            raise NotFound(f"model: the model `{shown_text(name)}` does not exist; this server serves "
                           f"`{self.model_name}`",
                           param="model")
