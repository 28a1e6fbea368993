"""Configuration of the inference engine (one dataclass, validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.config.schema import ConfigError

__all__ = ["EngineConfig", "LOGPROBS_MODES"]

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""vLLM's ``logprobs_mode``: what the reported values of sampled tokens are
(:mod:`megatron_s2.inference.sampling`; here so that the CLI parser can list them without torch)."""


@dataclass(frozen=True)
class EngineConfig:
    """Capacity, scheduling and KV-tier settings of :class:`~megatron_s2.inference.engine.InferenceEngine`."""

    max_num_seqs: int = 16
    """Requests decoded concurrently (one SWA slot each); later ones wait in the queue."""
    max_waiting: int = 256
    """Requests the queue holds beyond the running ones; ``add_request`` then raises QueueFull."""
    max_model_len: int = 4096
    """Prompt + generated tokens of one request (longer prompts are refused; generation stops
    with finish reason "length" at this length)."""
    prefill_chunk: int = 256
    """Prompt tokens of one request processed per step (chunked prefill)."""
    max_prefill_tokens: int = 1024
    """Prompt tokens processed per step over all requests (decodes are always scheduled)."""
    page_tokens: int = 16
    """Tokens per global-KV page; a multiple of every compression ratio (prefix-cache granularity)."""
    num_pages: int = 0
    """Global-KV pages (page 0 is reserved); 0 = enough for max_num_seqs requests of max_model_len
    tokens, plus as many again when prefix caching is on."""
    prefix_caching: bool = False
    """Persistent global-KV prefix cache (§3.2.1): full pages are indexed by a hash of the token
    prefix they end, kept after their request finishes, evicted least-recently-used."""
    swa_pool_slots: int = 0
    """Short-TTL SWA pool (§3.2.1): SWA snapshots at the end of the prompt and of the output,
    so a regeneration or next turn resumes exactly; 0 = off (needs prefix_caching)."""
    swa_pool_ttl_s: float = 300.0
    """Seconds an SWA snapshot stays usable."""
    encoder_bounded_replay: bool = True
    """Encoder SWA Bounded Replay (§3.2.2): on a global-KV hit without an SWA snapshot, replay the
    last window_size tokens of the cached prefix (SWA only) instead of re-running the prompt."""
    decoder_bounded_replay: bool = False
    """Decoder SWA Bounded Replay (§3.2.2): prefill runs the decoder only over the last window_size
    prompt tokens (its global KV still comes from H_{L/2} for every token)."""
    seed: int = 0
    """Seeds the generator of every request that brings no seed of its own."""
    speculative: bool = False
    """Speculative decoding with the model's drafter (DSpark, report §2.4.3): a decode step
    drafts, then verifies the drafts in one forward with exact rejection sampling (lossless)."""
    speculative_tokens: int = 0
    """Drafts verified per request and step at most; 0 = the drafter's block size."""
    speculative_schedule: str = "confidence"
    """When to draft and how many drafts each request verifies: ``confidence`` drafts only while
    drafting pays at the current batch size (measured acceptance against measured step times;
    otherwise plain decode, probed with exponential back-off) and verifies per request what the
    confidence head's calibrated prefix survival and the engine's measured throughput curve make
    best (§2.4.3, :mod:`megatron_s2.inference.speculation_schedule`); ``fixed`` drafts at every
    decode step and verifies all of them."""
    speculative_profile: str = ""
    """A throughput profile (JSON ``{"points": [[tokens, seconds], ...]}``) of verification
    forwards; "" = the engine measures its own forwards as it runs."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "prefill_chunk", "max_prefill_tokens", "page_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting: must be >= 1 (requests pass through the queue), got {self.max_waiting}")
        if self.num_pages < 0:
            raise ConfigError(f"num_pages: must be >= 0 (0 = derived), got {self.num_pages}")
        if self.max_prefill_tokens < self.prefill_chunk:
            raise ConfigError(f"max_prefill_tokens: {self.max_prefill_tokens} is below prefill_chunk="
                              f"{self.prefill_chunk}; raise it or lower prefill_chunk")
        if self.swa_pool_slots < 0:
            raise ConfigError(f"swa_pool_slots: must be >= 0, got {self.swa_pool_slots}")
        if self.swa_pool_slots and not self.prefix_caching:
            raise ConfigError("swa_pool_slots: the SWA pool resumes from cached global KV; set prefix_caching: true")
        if self.speculative_tokens < 0:
            raise ConfigError(f"speculative_tokens: must be >= 0 (0 = the drafter's block size), got {self.speculative_tokens}")
        if self.speculative_schedule not in ("confidence", "fixed"):
            raise ConfigError(f"speculative_schedule: choose confidence or fixed, got {self.speculative_schedule!r}")
        if self.speculative and self.decoder_bounded_replay:
            raise ConfigError("speculative: the drafter reads the decoder's outputs at every prompt token; set "
                              "decoder_bounded_replay: false")
        if self.swa_pool_ttl_s <= 0:
            raise ConfigError(f"swa_pool_ttl_s: must be positive, got {self.swa_pool_ttl_s}")

    @property
    def num_pages_total(self) -> int:
        """Global-KV pages of the pool: ``num_pages``, or derived from the request capacity."""
        per_request = -(-self.max_model_len // self.page_tokens)
        if self.num_pages:
            if self.num_pages < 1 + per_request:
                raise ConfigError(f"num_pages: {self.num_pages} pages cannot hold one request of max_model_len="
                                  f"{self.max_model_len} tokens ({per_request} pages of {self.page_tokens} + the "
                                  "reserved page); raise num_pages or lower max_model_len")
            return self.num_pages
        return 1 + per_request * self.max_num_seqs * (2 if self.prefix_caching else 1)
