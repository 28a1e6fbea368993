"""What every endpoint reads: the backend, the tokenizer, the served name and limits."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from megatron_s2.serve.backend import EngineBackend
from megatron_s2.serve.config import ServeConfig
from megatron_s2.serve.errors import NotFound
from megatron_s2.serve.fields import Fields

__all__ = ["ServerState", "new_id", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    """One server-sent event as OpenAI and vLLM emit them: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass
class ServerState:
    backend: EngineBackend
    tokenizer: Any
    config: ServeConfig
    model_name: str
    """The id clients send as ``model`` and ``/v1/models`` lists."""
    description: str
    """Where the weights came from (shown by ``/v1/models`` as ``root``)."""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.backend.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.backend.engine.model_config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_id", None)

    def check_model(self, f: Fields) -> None:
        """vLLM answers 404 for a model it does not serve (``model`` may be omitted)."""
        name = f.str("model")
        if name is not None and name != self.model_name:
            raise NotFound(f"model: the model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model")
