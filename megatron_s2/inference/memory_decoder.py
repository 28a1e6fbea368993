"""Memory Decoder interpolation at decode time (Intern-S2 walkthrough Ch. 2, Eq. 3): the frozen
backbone and the memory decoder decode in lock-step, each through its own family executor with
its own per-request state (KV pages, recurrent states), and every step's next-token distribution
is the router's per-token mix of the two:

    p_t = (1 - lambda_t) p_base,t + lambda_t p_mem,t,   lambda_t = router(h_base, h_mem, p_base, p_mem)

Both executors see the same token list; one forward of each per step (a prefill chunk, then one
token per decode step), asking for the logits and the normalised hidden state the router reads
(``Chunk.hidden``). The result equals the full-forward fusion of the same tokens
(tests/memory_decoder/test_memdec_engine.py): the cache changes the cost, not the distribution.

Scope: one request at a time, greedy or scored; serving it through the continuous-batching engine
and ``megatron-s2 serve`` is the next step.
"""

from __future__ import annotations

import torch

from megatron_s2.config.engine import EngineConfig
from megatron_s2.models.family import family_of
from megatron_s2.models.family.engine import Chunk
from megatron_s2.models.memory_decoder import MemoryRouter, interpolated_log_probs

__all__ = ["FusedDecoder"]


class _Slot:
    """One model's view of a request: the shared token list, that model's own cache state."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.num_computed, self.kv = tokens, 0, None
        self.images = []  # text only: the executors' image-span hooks see none


class FusedDecoder:
    def __init__(self, backbone, memory, router: MemoryRouter, config: EngineConfig | None = None,
                 device: torch.device | str = "cpu"):
        config = config or EngineConfig()
        self.models = (backbone, memory)
        self.router = router
        self.executors = []
        for model in self.models:
            family = family_of(model.config)
            family.check_engine(model.config, config)
            self.executors.append(family.executor(model, config, torch.device(device)))

    @torch.no_grad()
    def _step(self, slots, start: int, length: int, logits: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One lock-step forward of ``tokens[start:start + length]`` in both models: (fused
        log-probs [V] or [length, V], lambda [] or [length])."""
        outs = []
        for executor, slot in zip(self.executors, slots):
            outs.append(executor.forward([Chunk(slot, start, length, logits, hidden=True)])[0])
            slot.num_computed = start + length
            executor.after_forward(slot)
        (base, mem) = outs
        logp_base = torch.log_softmax(base.logits.float(), dim=-1)
        logp_mem = torch.log_softmax(mem.logits.float(), dim=-1)
        lam = self.router(base.hidden, mem.hidden, logp_base, logp_mem)
        return interpolated_log_probs(logp_base, logp_mem, lam), lam

    def _open(self, tokens: list[int]):
        slots = [_Slot(tokens), _Slot(tokens)]  # one token list, two cache states
        for executor, slot in zip(self.executors, slots):
            if not executor.can_admit():
                raise RuntimeError("memory decoder: an executor has no room for the request")
            executor.admit(slot)
        return slots

    def _close(self, slots) -> None:
        for executor, slot in zip(self.executors, slots):
            executor.release(slot, snapshot=False)

    def score(self, tokens: list[int], prefill: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused log-probs [n - 1, V] of tokens[1:], lambda [n - 1]): the first ``prefill`` tokens in
        one chunk, then one token per decode step, as generation would run them."""
        if not 1 <= prefill <= len(tokens) - 1:
            raise ValueError(f"prefill must be in [1, {len(tokens) - 1}], got {prefill}")
        seq = list(tokens)
        slots = self._open(seq)
        try:
            logp, lam = self._step(slots, 0, prefill, "all")
            rows, lams = [logp], [lam]
            for t in range(prefill, len(seq) - 1):
                logp, lam = self._step(slots, t, 1, "last")
                rows.append(logp.unsqueeze(0))
                lams.append(lam.reshape(1))
        finally:
            self._close(slots)
        return torch.cat(rows), torch.cat(lams)

    def generate(self, prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> tuple[list[int], list[float]]:
        """Greedy decoding under the fused distribution: (new tokens, lambda at each of them)."""
        tokens = list(prompt)
        slots = self._open(tokens)
        new, lams = [], []
        try:
            logp, lam = self._step(slots, 0, len(tokens), "last")
            while True:
                token = int(logp.argmax())
                tokens.append(token)  # both slots share this list
                new.append(token)
                lams.append(float(lam))
                if len(new) >= max_new_tokens or token == eos_id:
                    break
                logp, lam = self._step(slots, len(tokens) - 1, 1, "last")
        finally:
            self._close(slots)
        return new, lams
