"""Test helpers: a toy module named like the V4.1 backbone, and deterministic pseudo-gradients.

A uniquely named module (not ``conftest``) so test files can import it unambiguously.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron_s2.parallel.placement import place, placement_of


def set_head_split(param: torch.Tensor, heads: int | None) -> None:
    """What the V4.1 parallel plan records for head-structured weights (``head_rows``)."""
    place(param, dataclasses.replace(placement_of(param), head_split=heads))


def _vector(size: int, value: float = 1.0) -> nn.Parameter:
    return nn.Parameter(torch.full((size,), value))


class _Indexer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.linear_q = nn.Linear(hidden, heads * head_dim, bias=False)
        set_head_split(self.linear_q.weight, heads)
        self.k_norm = nn.LayerNorm(head_dim)  # weight and bias


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.linear_q_down = nn.Linear(hidden, 8, bias=False)
        self.q_norm = nn.Module()
        self.q_norm.weight = _vector(8)
        self.linear_q_up = nn.Linear(8, heads * head_dim, bias=False)
        set_head_split(self.linear_q_up.weight, heads)
        self.attn_sink = _vector(heads, 0.0)
        self.indexer = _Indexer(hidden, heads=2, head_dim=4)
        self.linear_proj = nn.Linear(heads * head_dim, hidden)  # weight and bias


class _Engram(nn.Module):
    def __init__(self, rows: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.q_weight = _vector(hidden)
        self.k_weight = _vector(hidden)
        self.value_proj = nn.Linear(dim, hidden, bias=False)


class _Layer(nn.Module):
    def __init__(self, hidden: int, with_engram: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _vector(hidden)
        self.self_attention = _Attention(hidden, heads=3, head_dim=4)
        self.hc = nn.Module()
        self.hc.base = nn.Parameter(torch.zeros(2, 6))  # 2-D, yet AdamW by name
        self.hc.scale = _vector(3)
        self.experts = nn.Module()
        self.experts.weight1 = nn.Parameter(torch.randn(4, 10, hidden) * 0.1)  # [experts, out, in]
        if with_engram:
            self.engram = _Engram(rows=13, dim=6, hidden=hidden)


class ToyV41(nn.Module):
    """Parameter names as produced by our V4.1 model's ``named_parameters()``."""

    def __init__(self, vocab: int = 32, hidden: int = 12) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(hidden, with_engram=(i == 0)) for i in range(2)])
        self.decoder.final_layernorm = nn.Module()
        self.decoder.final_layernorm.weight = _vector(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)


def fill_grads(model: nn.Module, seed: int) -> None:
    """Deterministic pseudo-gradients for every trainable parameter."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.randn(param.shape, generator=gen)
