"""Lock-step Memory Decoder decoding (megatron_s2/inference/memory_decoder.py): the backbone and the
memory each decode through their own family executor and cache, and the fused distribution of every
step equals the full-forward fusion of the same tokens (posttrain/memdec/fusion.py) — for an
Intern-S2 hybrid backbone and for a V4.1 backbone, with an Intern-S2 memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_s2.config.model_schema import ModelSchema
from megatron_s2.config.schema import from_mapping
from megatron_s2.inference.memory_decoder import FusedDecoder
from megatron_s2.models.family import family_of
from megatron_s2.models.memory_decoder import MemoryRouter
from megatron_s2.posttrain.memdec.fusion import FusedModel

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"


def _model(recipe: str, seed: int, **changes):
    raw = {**yaml.safe_load((MODELS / f"{recipe}.yaml").read_text()), **changes}
    cfg = from_mapping(ModelSchema, raw)
    model = family_of(cfg).build_model(cfg)
    model.init_weights(seed)
    return model.eval().requires_grad_(False)


def _router(backbone, memory, seed: int) -> MemoryRouter:
    router = MemoryRouter(backbone.config.hidden_size, memory.config.hidden_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a router whose lambda moves with the features (a fresh one is constant)
        router.out.weight.copy_(torch.randn(router.out.weight.shape, generator=g) * 0.3)
    return router.eval()


@pytest.mark.parametrize("backbone_name", ["intern_s2_tiny", "tiny"])
def test_lock_step_decode_equals_full_forward_fusion(backbone_name):
    torch.manual_seed(0)
    backbone = _model(backbone_name, 1)
    memory = _model("intern_s2_tiny", 2, name="memdec-tiny", hidden_size=32, layers=2, full_attention_interval=2)
    router = _router(backbone, memory, 3)
    tokens = torch.randint(3, 100, (1, 21), generator=torch.Generator().manual_seed(4))
    reference = FusedModel(backbone, memory, router).log_probs(tokens)
    decoder = FusedDecoder(backbone, memory, router)
    for prefill in (1, 7):  # chunked prefill, then one token per step
        logp, lam = decoder.score(tokens[0].tolist(), prefill=prefill)
        torch.testing.assert_close(logp, reference.fused[0, :-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lam, reference.lam[0, :-1], rtol=1e-4, atol=1e-5)
    assert float(reference.lam.std()) > 1e-3  # lambda really varies per token
    new, lams = decoder.generate(tokens[0, :5].tolist(), max_new_tokens=6)
    greedy = list(tokens[0, :5].tolist())
    for _ in range(6):  # the same greedy continuation from full forwards
        greedy.append(int(FusedModel(backbone, memory, router).log_probs(torch.tensor([greedy])).fused[0, -1].argmax()))
    assert new == greedy[5:] and len(lams) == 6
