"""``prompt_logprobs``: the log-probability of every prompt token under the served model.

vLLM's semantics (a sampling parameter, on ``/inference/v1/generate``'s ``sampling_params`` and
as an extra field of ``/v1/completions``): ``prompt_logprobs: k`` returns, for every prompt
position, a dict ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt's
actual token and the ``k`` most likely alternatives (``k + 1`` entries when the actual token is
not among them); the first position is ``null`` (nothing predicts it). ``rank`` is the token's
1-based rank in the vocabulary (1 = most likely). Where it goes: the top-level
``prompt_logprobs`` of the token endpoint's response, ``choices[i].prompt_logprobs`` of a
completion (vLLM's places).

The values come from **one full forward of the prompt** on the engine's model (the same
whole-sequence forward the trainer runs, log-softmax in fp32; the prompts of one request
right-padded into batched forwards of at most ``ServeConfig.prompt_logprobs_tokens``), run on the engine's
driver thread between two steps (:meth:`EngineBackend.run`), so they equal an in-process model's
log-probabilities of the same tokens. That is what an on-policy-distillation teacher served
over HTTP returns (walkthrough Ch. 8, Eq. 33: the teacher's log-prob of each sampled student
token; ``megatron_s2.posttrain.opd.remote_teacher``).

Temperature: as in vLLM, the request's sampling ``temperature`` does not change prompt
log-probabilities; ``prompt_logprobs_temperature`` (default 1.0, the raw distribution; the
name of vLLM's proposed sampling parameter) returns ``log_softmax(logits / T)`` — a teacher's
temperature is applied by the server that holds the logits.
"""

from __future__ import annotations

import torch

from megatron_s2.serve.errors import HTTPError, RequestFailed
from megatron_s2.serve.fields import Fields
from megatron_s2.serve.text import finite_logprob, token_text

__all__ = ["PromptLogprobs", "read_prompt_logprobs", "prompt_logprobs"]


class PromptLogprobs:
    """What a request asked for: ``k`` alternatives at temperature ``temperature``."""

    def __init__(self, k: int, temperature: float):
        self.k, self.temperature = k, temperature


def read_prompt_logprobs(f: Fields, max_logprobs: int) -> PromptLogprobs | None:
    """The request's ``prompt_logprobs`` / ``prompt_logprobs_temperature`` (None: not asked)."""
    k = f.int("prompt_logprobs", None, minimum=0, maximum=max_logprobs)
    temperature = f.float("prompt_logprobs_temperature", 1.0)
    if temperature <= 0:
        f.fail("prompt_logprobs_temperature", f"must be > 0, got {temperature}")
    if k is None:
        if f.has("prompt_logprobs_temperature"):
            f.fail("prompt_logprobs_temperature", "needs prompt_logprobs (an integer >= 0)")
        return None
    return PromptLogprobs(k, temperature)


@torch.no_grad()
def _score(model, prompts: list[list[int]], k: int, temperature: float, max_tokens: int) -> list[tuple]:
    """Per prompt: (log-prob of each prompt token from position 1, its rank, top-k ids, top-k
    log-probs). Prompts are right-padded into forwards of at most ``max_tokens`` tokens (at least
    one prompt each); the model is causal, so padding after a prompt changes none of its values."""
    if model.groups.tp.size > 1:  # the server holds every layer on one rank (serve/server.py)
        raise RequestFailed("prompt_logprobs: the served model is split over tensor-parallel ranks; serve it on one")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[tuple | None] = [None] * len(prompts)
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * len(prompts[order[stop]]) <= max_tokens:
            stop += 1
        chunk = order[start:stop]
        width = len(prompts[chunk[-1]])
        tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        for row, i in enumerate(chunk):
            tokens[row, :len(prompts[i])] = torch.tensor(prompts[i], dtype=torch.long, device=device)
        logits = model(tokens, model.make_context({"tokens": tokens}))[:, :-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        ranks = (logp > chosen.unsqueeze(-1)).sum(-1) + 1
        top_v, top_i = logp.topk(k, dim=-1)
        for row, i in enumerate(chunk):
            n = len(prompts[i]) - 1
            out[i] = (chosen[row, :n].cpu(), ranks[row, :n].cpu(), top_i[row, :n].cpu(), top_v[row, :n].cpu())
        start = stop
    return out


def _format(tokenizer, prompt: list[int], scored, k: int) -> list[dict | None]:
    chosen, ranks, top_i, top_v = scored
    out: list[dict | None] = [None]
    for p in range(1, len(prompt)):
        entry = {}
        token = prompt[p]
        entry[str(token)] = {"logprob": finite_logprob(float(chosen[p - 1])), "rank": int(ranks[p - 1]),
                             "decoded_token": token_text(tokenizer, token, False)}
        for r in range(k):
            t = int(top_i[p - 1, r])
            if t != token:
                entry[str(t)] = {"logprob": finite_logprob(float(top_v[p - 1, r])), "rank": r + 1,
                                 "decoded_token": token_text(tokenizer, t, False)}
        out.append(entry)
    return out


async def prompt_logprobs(state, prompts: list[list[int]], request: PromptLogprobs) -> list[list[dict | None]]:
    """The ``prompt_logprobs`` list of each prompt (module docstring), computed on the driver
    thread in batched forwards of at most ``ServeConfig.prompt_logprobs_tokens`` tokens."""
    model = state.backend.engine.model
    try:
        scored = await state.backend.run(_score, model, prompts, request.k, request.temperature,
                                         state.config.prompt_logprobs_tokens)
    except HTTPError:
        raise
    except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
        raise RequestFailed(f"prompt_logprobs: the forward of the prompt failed ({type(exc).__name__}: {exc}); "
                            "other requests are unaffected") from None
    return [_format(state.tokenizer, p, sc, request.k) for p, sc in zip(prompts, scored)]
