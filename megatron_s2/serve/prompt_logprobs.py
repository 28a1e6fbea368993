"""``prompt_logprobs``: the log-probability of every prompt token under the served model.

vLLM's semantics (a sampling parameter, on ``/inference/v1/generate``'s ``sampling_params`` and
as an extra field of ``/v1/completions``): ``prompt_logprobs: k`` returns, for every prompt
position, a dict ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt's
actual token and the ``k`` most likely alternatives (``k + 1`` entries when the actual token is
not among them; ``-1`` = every token of the vocabulary, up to the server's ``--max-logprobs``:
a teacher's full distribution); the first position is ``null`` (nothing predicts it). ``rank``
is the token's 1-based rank in the vocabulary (1 = most likely). Where it goes: the top-level
``prompt_logprobs`` of the token endpoint's response, ``choices[i].prompt_logprobs`` of a
completion (vLLM's places).

With a Memory Decoder plug-in (``serve --memory-decoder``) the values are the fused distribution's
(Eq. 3, one full forward of each model and the router's mix), as the engine samples from it.

The values come from **one full forward of the prompt** on the engine's model (the same
whole-sequence forward the trainer runs, log-softmax in fp32; the prompts of one request
right-padded into batched forwards of at most ``ServeConfig.prompt_logprobs_tokens``), each batch
run as one side task of the engine's driver between two steps (:meth:`AsyncEngine.run`): they
equal an in-process model's log-probabilities of the same tokens, and a request scoring many
long prompts does not stall the other clients' decoding. That is what an on-policy-distillation teacher served
over HTTP returns (walkthrough Ch. 8, Eq. 33: the teacher's log-prob of each sampled student
token; ``megatron_s2.posttrain.opd.remote_teacher``).

Temperature: as in vLLM, the request's sampling ``temperature`` does not change prompt
log-probabilities; ``prompt_logprobs_temperature`` (default 1.0, the raw distribution; the
name of vLLM's proposed sampling parameter) returns ``log_softmax(logits / T)`` — a teacher's
temperature is applied by the server that holds the logits. A server in one of the ``*_logits``
modes (``--logprobs-mode``) returns the logits (``logits / T``) instead, as vLLM does; ranks are
the same either way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_s2.serve.errors import HTTPError, RequestFailed
from megatron_s2.serve.fields import Fields
from megatron_s2.serve.text import finite_logprob, token_text

__all__ = ["PromptLogprobs", "ScoredPrompt", "read_prompt_logprobs", "prompt_logprobs", "score_prompts",
           "format_prompt_logprobs"]


class PromptLogprobs:
    """What a request asked for: ``k`` alternatives at temperature ``temperature``."""

    def __init__(self, k: int, temperature: float):
        self.k, self.temperature = k, temperature


def read_prompt_logprobs(f: Fields, max_logprobs: int, vocab_size: int) -> PromptLogprobs | None:
    """The request's ``prompt_logprobs`` / ``prompt_logprobs_temperature`` (None: not asked);
    ``prompt_logprobs: -1`` is the whole vocabulary (vLLM's), allowed up to ``max_logprobs``."""
    asked = f.int("prompt_logprobs", None, minimum=-1)
    k = vocab_size if asked == -1 else asked
    cap = min(max_logprobs, vocab_size)
    if k is not None and k > cap:
        got = f"-1 (the whole vocabulary, {vocab_size})" if asked == -1 else str(asked)
        why = (f"the vocabulary has {vocab_size} tokens" if cap == vocab_size else
               f"this server's --max-logprobs; serve with --max-logprobs -1 for the whole vocabulary of {vocab_size}")
        f.fail("prompt_logprobs", f"must be <= {cap} ({why}), got {got}")
    temperature = f.float("prompt_logprobs_temperature", 1.0)
    if temperature <= 0:
        f.fail("prompt_logprobs_temperature", f"must be > 0, got {temperature}")
    if k is None:
        if f.has("prompt_logprobs_temperature"):
            f.fail("prompt_logprobs_temperature", "needs prompt_logprobs (an integer >= 0)")
        return None
    return PromptLogprobs(k, temperature)


class ScoredPrompt(NamedTuple):
    """The values of one prompt's tokens from position 1 on (position 0 has no predecessor)."""

    chosen: torch.Tensor
    """[len - 1] the value of each prompt token."""
    ranks: torch.Tensor
    """[len - 1] its 1-based rank in the vocabulary (1 = most likely)."""
    top_ids: torch.Tensor
    """[len - 1, k] the ``k`` most likely tokens."""
    top_values: torch.Tensor
    """[len - 1, k] their values."""

    def records(self) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """Per prompt position, its value and the top (token, value) pairs — None for the first,
        which nothing predicts — as an echoed prompt's log-prob records list them."""
        tops = [list(zip(ids, values)) for ids, values in zip(self.top_ids.tolist(), self.top_values.tolist())]
        return [None, *self.chosen.tolist()], [None, *tops]


def _batches(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``prompts`` grouped by length into batches of at most ``max_tokens`` tokens
    (rows x longest row; at least one prompt each)."""
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches, start = [], 0
    while start < len(by_length):
        stop = start + 1
        while stop < len(by_length) and (stop + 1 - start) * len(prompts[by_length[stop]]) <= max_tokens:
            stop += 1
        batches.append(by_length[start:stop])
        start = stop
    return batches


@torch.no_grad()
def _score_batch(model, prompts: list[list[int]], k: int, temperature: float,
                 as_logits: bool = False, memory_decoder=None) -> list[ScoredPrompt]:
    """Per prompt, its :class:`ScoredPrompt` (log-probs, or logits when ``as_logits``), from one
    forward of the prompts right-padded to the longest; the model is causal, so padding after a
    prompt changes none of its values. With a ``memory_decoder`` the values are those of the
    fused distribution (its log-probabilities stand in for logits, as in sampling)."""
    if model.groups.tp.size > 1:  # the server holds every layer on one rank (serve/server.py)
        raise RequestFailed("prompt_logprobs: the served model is split over tensor-parallel ranks; serve it on one")
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    if memory_decoder is not None:
        logits = memory_decoder.full_forward(model, tokens).fused[:, :-1] / temperature
    else:
        logits = model(tokens, model.make_context({"tokens": tokens}))[:, :-1].float() / temperature
    values = logits if as_logits else torch.log_softmax(logits, dim=-1)
    chosen = values.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    ranks = (values > chosen.unsqueeze(-1)).sum(-1) + 1
    top_values, top_ids = values.topk(k, dim=-1)
    scored = []
    for row, prompt in enumerate(prompts):
        length = len(prompt) - 1
        scored.append(ScoredPrompt(chosen[row, :length].cpu(), ranks[row, :length].cpu(),
                                   top_ids[row, :length].cpu(), top_values[row, :length].cpu()))
    return scored


def format_prompt_logprobs(tokenizer, prompt: list[int], scored: ScoredPrompt, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` list of one prompt (module docstring)."""
    # plain lists and each token's text decoded once: with k = the vocabulary (a teacher's full
    # distribution) this loop runs positions x V times, and per-element tensor reads dominate it
    chosen, ranks = scored.chosen.tolist(), scored.ranks.tolist()
    top_ids, top_values = scored.top_ids.tolist(), scored.top_values.tolist()
    texts: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = token_text(tokenizer, token, False)
        return texts[token]

    entries: list[dict | None] = [None]
    for row, token in enumerate(prompt[1:]):
        entry = {str(token): {"logprob": finite_logprob(chosen[row]), "rank": ranks[row], "decoded_token": text(token)}}
        for rank, (alternative, value) in enumerate(zip(top_ids[row][:k], top_values[row][:k])):
            if alternative != token:
                entry[str(alternative)] = {"logprob": finite_logprob(value), "rank": rank + 1,
                                           "decoded_token": text(alternative)}
        entries.append(entry)
    return entries


async def score_prompts(state, prompts: list[list[int]], request: PromptLogprobs) -> list[ScoredPrompt]:
    """Each prompt's values, in batched forwards of at most ``ServeConfig.prompt_logprobs_tokens``
    tokens, each one driver side task: the engine decodes for everyone else between two batches."""
    model = state.backend.engine.model
    as_logits = state.config.logprobs_mode.endswith("_logits")
    scored: list[ScoredPrompt | None] = [None] * len(prompts)
    for batch in _batches(prompts, state.config.prompt_logprobs_tokens):
        try:
            values = await state.backend.run(_score_batch, model, [prompts[i] for i in batch], request.k,
                                             request.temperature, as_logits, state.backend.engine.memory_decoder)
        except HTTPError:
            raise
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            raise RequestFailed(f"prompt_logprobs: the forward of the prompt failed ({type(exc).__name__}: {exc}); "
                                "other requests are unaffected") from None
        for index, value in zip(batch, values):
            scored[index] = value
    return scored


async def prompt_logprobs(state, prompts: list[list[int]], request: PromptLogprobs) -> list[list[dict | None]]:
    """The ``prompt_logprobs`` list of each prompt (module docstring)."""
    scored = await score_prompts(state, prompts, request)
    return [format_prompt_logprobs(state.tokenizer, prompt, values, request.k)
            for prompt, values in zip(prompts, scored)]
