"""Shared fixtures of the Intern-S2 family tests: a small random Qwen3.5-MoE model written by
``transformers``' own ``save_pretrained`` (no download) — the oracle of the format."""

from __future__ import annotations

import pytest
import torch

HF_SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts_per_tok=2, num_experts=4)


def random_reference(seed: int = 0):
    """A ``Qwen3_5MoeForCausalLM`` with random weights, its norms moved off their initial values
    (zero-centred RMSNorms start at 0, the gated norm at 1: a mapping slip would hide there)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**HF_SHAPE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory):
    """(the transformers model, the directory it saved itself to)."""
    model = random_reference()
    path = tmp_path_factory.mktemp("qwen35moe") / "hf"
    model.save_pretrained(path)
    return model, path


class ExecutorRequest:
    """What the executor reads of an engine request: its tokens, how many it computed, its state."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.num_computed, self.kv = list(tokens), 0, None


def incremental_logits(executor, seqs: list[list[int]], prompt_lens: list[int], chunk: int):
    """Every request batched in one executor forward per step: its prompt in chunks of ``chunk``,
    then one token at a time; returns (per request the logits of every position [n, V], the
    requests, whose states stay admitted)."""
    from megatron_s2.models.family.engine import Chunk

    requests = [ExecutorRequest(s) for s in seqs]
    for r in requests:
        executor.admit(r)
    got = [[] for _ in seqs]
    while any(r.num_computed < len(r.tokens) for r in requests):
        chunks = []
        for i, r in enumerate(requests):
            if r.num_computed < len(r.tokens):
                step = chunk if r.num_computed < prompt_lens[i] else 1
                chunks.append((i, Chunk(r, r.num_computed, min(step, len(r.tokens) - r.num_computed), "all")))
        for (i, c), out in zip(chunks, executor.forward([c for _, c in chunks])):
            got[i].append(out.logits)
            c.request.num_computed += c.length
    return [torch.cat(x) for x in got], requests
