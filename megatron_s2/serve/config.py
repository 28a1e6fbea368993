"""Configuration of the HTTP server (one dataclass, validated at construction).

The engine's own settings (concurrency, queue bound, ``max_model_len``, KV tiers) live in
:class:`~megatron_s2.config.engine.EngineConfig`; this one holds what only the server has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_s2.config.engine import LOGPROBS_MODES
from megatron_s2.config.schema import ConfigError

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """Address, served name and per-request policies of ``megatron-s2 serve``."""

    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 = every interface)."""
    port: int = 8000
    """TCP port (0 = a free port chosen by the system, printed at start-up)."""
    served_model_name: str = ""
    """The model id clients send and ``/v1/models`` lists; "" = the checkpoint path as given
    (as ``vllm serve <path>`` does, so a client can load the tokenizer from that path)."""
    return_routed_experts: bool = False
    """Return the MoE routing of every fed token on ``/inference/v1/generate`` (Rollout
    Routing Replay, §5.2.1) without the request asking (``sampling_params.return_routed_experts``)."""
    max_n: int = 64
    """Largest ``n`` (choices per prompt) a request may ask for."""
    max_logprobs: int = 20
    """Largest number of top log-probs per position a request may ask for (default 20, as OpenAI
    and vLLM's ``--max-logprobs``); -1 = the whole vocabulary (vLLM's "no cap"), which a served
    OPD teacher needs for the evaluation's full-vocabulary KL (``prompt_logprobs`` = vocabulary
    size, :mod:`megatron_s2.posttrain.opd.remote_teacher`)."""
    logprobs_mode: str = "raw_logprobs"
    """What the log-prob values of sampled tokens are — vLLM's ``--logprobs-mode`` and its
    default: ``raw_logprobs`` (the model's distribution, before temperature / top-k / top-p),
    ``processed_logprobs`` (the distribution the token was drawn from; what an RL trainer's
    importance weights need), ``raw_logits`` or ``processed_logits``. Prompt log-probs are raw:
    log-probs, or logits in the ``*_logits`` modes
    (:mod:`megatron_s2.inference.sampling`)."""
    prompt_logprobs_tokens: int = 8192
    """Tokens (prompts x padded length) of one ``prompt_logprobs`` forward: a request's prompts
    are scored together up to this; the fp32 logits take about this x vocab x 8 bytes (a longer
    prompt is scored alone)."""
    max_stops: int = 128
    """Largest number of entries of ``stop`` and of ``stop_token_ids`` (each is checked after
    every generated token, on the engine's thread that every client shares)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body in bytes; a longer one is answered 413 before it is read whole (a
    prompt that long could not fit ``max_model_len`` anyway, and tokenising it stalls the server)."""
    disconnect_poll_s: float = 0.25
    """How often a waiting request checks whether its client has gone (then it is aborted)."""
    allowed_local_media_path: str = ""
    """A directory whose files chat ``image_url`` parts may name as ``file://`` URLs (vLLM's
    ``--allowed-local-media-path``); "" = none: only inline ``data:`` URLs are read."""
    max_images_per_request: int = 8
    """Most chat image parts one request may hold (as vLLM's ``--limit-mm-per-prompt``), refused
    before any is decoded: a ~100 KB PNG can decode to the ~96 MB the pixel cap allows, so the body
    limit alone let one request hold gigabytes of pixels."""

    max_broadcast_timeout_s: float = 300.0
    """Largest ``timeout_s`` a broadcast form of ``POST /update_weights`` may ask (refused above,
    400): how long an abandoned broadcast may hold the server's update lock (a checkpoint update
    waits behind it)."""

    gateway_traces: str = ""
    """A directory for the agent gateway's PrefixTree trace store (``--gateway-traces``): session
    endpoints ``/sessions/<id>/v1/...`` capture every model call's token ids, log-probs and routed
    experts there (:mod:`megatron_s2.serve.gateway`); "" = no capture, no session endpoints."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("--host: give an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port: must be in 0..65535 (0 = any free port), got {self.port}")
        if self.max_n < 1:
            raise ConfigError(f"max_n: must be >= 1, got {self.max_n}")
        if self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs: must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode: must be one of {', '.join(LOGPROBS_MODES)}, got "
                              f"{self.logprobs_mode!r}")
        if self.prompt_logprobs_tokens < 1:
            raise ConfigError(f"prompt_logprobs_tokens: must be >= 1, got {self.prompt_logprobs_tokens}")
        if self.max_stops < 1:
            raise ConfigError(f"max_stops: must be >= 1, got {self.max_stops}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if not self.max_broadcast_timeout_s >= 1:
            raise ConfigError(f"max_broadcast_timeout_s: must be >= 1, got {self.max_broadcast_timeout_s}")
        if not self.disconnect_poll_s > 0:
            raise ConfigError(f"disconnect_poll_s: must be positive, got {self.disconnect_poll_s}")
        if self.max_images_per_request < 0:
            raise ConfigError(f"--max-images-per-request: must be >= 0 (0 = no image parts), got "
                              f"{self.max_images_per_request}")
        if self.gateway_traces and Path(self.gateway_traces).exists() and not Path(self.gateway_traces).is_dir():
            raise ConfigError(f"--gateway-traces: {self.gateway_traces} is a file; give a directory (created if "
                              "missing) for the trace store")
        if self.allowed_local_media_path and not Path(self.allowed_local_media_path).is_dir():
            raise ConfigError(f"--allowed-local-media-path: {self.allowed_local_media_path} is not a directory; give "
                              "an existing directory whose images clients may name with file:// URLs")
