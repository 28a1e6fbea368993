"""What SWA Bounded Replay costs and saves (report §3.2.2): logit KL against the exact state and
prefill FLOPs against a full prefill.

For a prompt of P tokens followed by G teacher-forced continuation tokens, each variant
prefills the prompt through the engine's own admission logic (:class:`KVTiers`) and runner,
then feeds the same continuation one token at a time; the variant's next-token distributions
at the P-th position and at the G continuation positions are compared with the exact ones:

* ``exact`` — every layer over every prompt token (the reference);
* ``decoder`` — Decoder SWA Bounded Replay: the decoder over the last W prompt tokens only;
* ``encoder`` — a cached global-KV prefix of H tokens (another request's pages) without its
  SWA state: Encoder SWA Bounded Replay of the last W prefix tokens, then the suffix;
* ``encoder+decoder`` — both.

KL is ``KL(p_exact || p_variant)`` in nats, averaged over positions (and its maximum);
FLOPs are counted by ``torch.utils.flop_counter`` over the variant's prefill forwards, as a
ratio to the exact full prefill of all P tokens. Nothing here is asserted: the numbers
depend on the weights (random ones in the tests, trained ones in practice).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_s2.config.engine import EngineConfig
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore
from megatron_s2.inference.request import Request
from megatron_s2.models.v41.inference.runner import ForwardRow, ModelRunner
from megatron_s2.inference.sampling import SamplingParams
from megatron_s2.models.v41.inference.tiers import KVTiers

__all__ = ["ReplayMeasurement", "measure_bounded_replay"]


@dataclass
class ReplayMeasurement:
    variant: str
    kl_mean: float
    """Mean KL(exact || variant) over the prompt's last position and the continuation (nats)."""
    kl_max: float
    prefill_flops: float
    flops_ratio: float
    """Prefill FLOPs / the exact full prefill's FLOPs."""


class _Setup:
    def __init__(self, model, config: EngineConfig):
        cfg = model.config
        device = next(model.parameters()).device
        self.config = config
        self.global_kv = GlobalKVStore(cfg, config.num_pages_total, config.page_tokens, device)
        self.swa = SWAStore(cfg, 4, device)
        self.runner = ModelRunner(model, self.global_kv, self.swa)
        self.tiers = KVTiers(config, cfg, self.global_kv, self.swa)
        self.ids = itertools.count()

    def request(self, tokens: list[int]) -> Request:
        req = Request(f"r{next(self.ids)}", list(tokens), SamplingParams(), torch.Generator(), 0)
        req.kv = SequenceKV(self.swa.allocate())
        self.tiers.admit(req)
        return req

    def prefill(self, req: Request, chunk: int) -> tuple[torch.Tensor, float]:
        """Run the request's unprocessed tokens; (last logits, FLOPs)."""
        logits = None
        with FlopCounterMode(display=False) as counter:
            while req.num_computed < len(req.tokens):
                start = req.num_computed
                n = min(chunk, len(req.tokens) - start)
                wants = "last" if start + n == len(req.tokens) else "none"
                row = ForwardRow(req.kv, req.tokens[start:start + n], start, req.tokens[:start], logits=wants,
                                 decoder_from=req.kv.decoder_from)
                out = self.runner.forward([row])[0]
                req.num_computed = start + n
                self.tiers.after_forward(req)
                logits = out.logits if out.logits is not None else logits
        return logits, float(counter.get_total_flops())

    def continue_with(self, req: Request, tokens: list[int]) -> list[torch.Tensor]:
        out = []
        for t in tokens:
            req.tokens.append(t)
            start = req.num_computed
            row = ForwardRow(req.kv, [t], start, req.tokens[:start])
            out.append(self.runner.forward([row])[0].logits)
            req.num_computed += 1
        return out


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


@torch.no_grad()
def measure_bounded_replay(model, prompt: list[int], continuation: list[int], *, cached_prefix: int,
                           page_tokens: int = 16, chunk: int = 256) -> list[ReplayMeasurement]:
    """Measure every variant (module docstring). ``cached_prefix``: tokens of the prompt whose
    global KV the encoder-replay variants find cached (rounded down to whole pages)."""
    window = model.config.window_size
    if len(prompt) <= window or cached_prefix >= len(prompt):
        raise ValueError(f"prompt: needs more than window_size={window} tokens and more than cached_prefix")
    base = dict(max_num_seqs=4, max_model_len=len(prompt) + len(continuation) + 1, page_tokens=page_tokens,
                prefill_chunk=chunk, max_prefill_tokens=chunk)
    variants = {"exact": dict(prefix_caching=False), "decoder": dict(prefix_caching=False, decoder_bounded_replay=True),
                "encoder": dict(prefix_caching=True),
                "encoder+decoder": dict(prefix_caching=True, decoder_bounded_replay=True)}
    if not model.config.has_decoder:
        variants = {k: v for k, v in variants.items() if "decoder" not in k}
    results, reference, full_flops = [], None, None
    for name, extra in variants.items():
        setup = _Setup(model, EngineConfig(**base, **extra))
        if extra["prefix_caching"]:  # another request leaves the prefix's global KV in the cache
            owner = setup.request(prompt[:cached_prefix])
            setup.prefill(owner, chunk)
            setup.tiers.after_forward(owner)
        req = setup.request(prompt)
        last, flops = setup.prefill(req, chunk)
        logits = [last] + setup.continue_with(req, continuation)
        if reference is None:
            reference, full_flops = logits, flops
        kls = [_kl(p, q) for p, q in zip(reference, logits)]
        results.append(ReplayMeasurement(name, sum(kls) / len(kls), max(kls), flops, flops / full_flops))
    return results
