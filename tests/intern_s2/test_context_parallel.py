"""Context parallelism of the Intern-S2 mixers against one process (issue 23: "CP for Gated
DeltaNet by state passing ... the result equals the single-rank forward and backward").

Two ranks hold chunks (0, 3) and (1, 2) of a 32-token sequence (the load-balanced split);
documents start inside a chunk (token 5), exactly at a chunk boundary (token 16) and at the last
chunk's first token (24). In float64 the state-passing delta rule, the halo convolution and the
gathered-key attention mask must reproduce the whole sequence's outputs and the gradients of
every input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.models.intern_s2.context_parallel import cp_attention_keys, cp_causal_conv1d, cp_gated_delta_rule
from megatron_s2.models.intern_s2.gated_delta import causal_conv1d, chunk_gated_delta_rule
from tests.parallel.spawn import run_distributed

SEQ, DOCS = 32, [0] * 5 + [1] * 11 + [2] * 8 + [3] * 8


def _inputs():
    gen = torch.Generator().manual_seed(0)
    f = dict(dtype=torch.float64)
    return dict(q=torch.randn(2, SEQ, 2, 8, generator=gen, **f), k=torch.randn(2, SEQ, 2, 8, generator=gen, **f),
                v=torch.randn(2, SEQ, 4, 6, generator=gen, **f), g=-torch.rand(2, SEQ, 4, generator=gen, **f) * 0.5,
                beta=torch.rand(2, SEQ, 4, generator=gen, **f), x=torch.randn(2, SEQ, 5, generator=gen, **f),
                w=torch.randn(5, 4, generator=gen, **f), probe=torch.randn(2, SEQ, 4, 6, generator=gen, **f),
                probe_x=torch.randn(2, SEQ, 5, generator=gen, **f))


def _check(rank: int, world: int, out_dir: str) -> None:
    from megatron_s2.parallel.context_parallel import local_chunk_positions
    from megatron_s2.parallel.groups import Group

    import torch.distributed as dist

    cp = Group(dist.new_group([0, 1]), 2, rank, (0, 1))
    t = _inputs()
    docs = torch.tensor([DOCS, DOCS])
    idx = local_chunk_positions(SEQ, cp)
    positions = idx.unsqueeze(0).expand(2, -1)
    names = ("q", "k", "v", "g", "beta", "x")
    full = {n: t[n].clone().requires_grad_() for n in names}
    local = {n: t[n][:, idx].clone().requires_grad_() for n in names}
    # whole sequence (one process)
    out, _ = chunk_gated_delta_rule(full["q"], full["k"], full["v"], full["g"], full["beta"], chunk_size=4,
                                    doc_ids=docs)
    conv, _ = causal_conv1d(full["x"], t["w"], doc_ids=docs)
    ((out * t["probe"]).sum() + (conv * t["probe_x"]).sum()).backward()
    # this rank's two chunks
    out_cp = cp_gated_delta_rule(local["q"], local["k"], local["v"], local["g"], local["beta"], chunk_size=4, cp=cp,
                                 doc_ids=docs[:, idx], full_doc_ids=docs)
    conv_cp = cp_causal_conv1d(local["x"], t["w"], positions, cp, full_doc_ids=docs)
    ((out_cp * t["probe"][:, idx]).sum() + (conv_cp * t["probe_x"][:, idx]).sum()).backward()
    assert (out_cp - out[:, idx]).abs().max() < 1e-12
    assert (conv_cp - conv[:, idx]).abs().max() < 1e-12
    for n in names:
        assert (local[n].grad - full[n].grad[:, idx]).abs().max() < 1e-11, n
    # attention: gathered keys, masked by global positions and documents
    keys, values, allowed = cp_attention_keys(t["k"][:, idx], t["v"][:, idx], positions, cp, docs[:, idx], docs)
    assert torch.equal(keys, t["k"]) and torch.equal(values, t["v"])
    want = (torch.arange(SEQ).view(1, 1, -1) <= idx.view(1, -1, 1)) & (docs[:, None, :] == docs[:, idx, None])
    assert torch.equal(allowed, want)
    (torch.tensor([1.0])).numpy().tofile(f"{out_dir}/ok{rank}")


@pytest.mark.slow
def test_state_passing_and_halo_equal_the_whole_sequence(tmp_path):
    run_distributed(2, _check, str(tmp_path))
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
