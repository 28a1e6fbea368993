"""The gated delta rule and the causal convolution of the Intern-S2 family (issue 23: "the chunked
parallel form of the delta rule (WY representation), equal to the token-by-token recurrent form
(test, fp32/fp64)"), against an independent oracle: the Hugging Face ``qwen3_5_moe`` reference's
own token-by-token function, and, for packed documents, each document run alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_s2.models.intern_s2.gated_delta import (causal_conv1d, chunk_gated_delta_rule, lean_chunk_gated_delta_rule,
                                                      recurrent_gated_delta_rule)


def _inputs(b=2, s=37, hk=2, hv=4, dk=8, dv=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(b, s, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, s, hv, generator=gen, dtype=dtype) * 0.7   # decays in (0.5, 1]
    beta = torch.rand(b, s, hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_form_equals_the_recurrence_in_float64(chunk):
    q, k, v, g, beta = _inputs()
    state0 = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=state0)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state0)
    assert (out_c - out_r).abs().max() < 1e-12 and (s_c - s_r).abs().max() < 1e-12


def test_float32_chunked_form_stays_within_round_off_of_float64():
    q, k, v, g, beta = _inputs(s=200)
    want, state = recurrent_gated_delta_rule(q, k, v, g, beta)
    got, got_state = chunk_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)), chunk_size=64)
    assert got.dtype == torch.float32 and got_state.dtype == torch.float32
    assert (got.double() - want).abs().max() < 2e-5 and (got_state.double() - state).abs().max() < 2e-5


def test_recurrence_equals_the_hugging_face_reference():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs(dtype=torch.float32)
    ours, state = recurrent_gated_delta_rule(q, k, v, g, beta)
    theirs, their_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    assert (ours - theirs).abs().max() < 1e-5 and (state - their_state).abs().max() < 1e-5


def test_packed_documents_never_read_each_others_memory():
    q, k, v, g, beta = _inputs(b=1, s=40)
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7])
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, doc_ids=docs)
    recurrent, _ = recurrent_gated_delta_rule(q, k, v, g, beta, doc_ids=docs)
    assert (packed - recurrent).abs().max() < 1e-12
    for lo, hi in ((0, 13), (13, 33), (33, 40)):  # each document alone, from an empty memory
        alone, _ = chunk_gated_delta_rule(*(t[:, lo:hi] for t in (q, k, v, g, beta)), chunk_size=8)
        assert (packed[:, lo:hi] - alone).abs().max() < 1e-12


def test_gradients_of_both_forms_agree():
    inputs = [t.clone().requires_grad_() for t in _inputs(s=21)]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    chunk_gated_delta_rule(*inputs, chunk_size=8)[0].square().sum().backward()
    recurrent_gated_delta_rule(*twins)[0].square().sum().backward()
    for a, b in zip(inputs, twins):
        assert (a.grad - b.grad).abs().max() < 1e-10


@pytest.mark.parametrize("s, chunk, packed, carried", [(21, 8, False, False), (37, 8, True, True), (40, 64, False, True),
                                                      (64, 16, True, False), (5, 4, False, True)])
def test_lean_form_equals_the_chunked_form_forward_and_backward_in_float64(s, chunk, packed, carried):
    """The memory-lean form (chunk states recomputed in backward, one chunk's graph at a time)
    computes the same outputs, final state and gradients, with documents crossing chunk
    boundaries, a carried initial state and a padded last chunk."""
    inputs = [t.clone().requires_grad_() for t in _inputs(s=s)]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    gen = torch.Generator().manual_seed(2)
    state0 = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=gen).requires_grad_() if carried else None
    state1 = state0.detach().clone().requires_grad_() if carried else None
    docs = torch.randint(0, 3, (2, s), generator=gen).sort(-1).values if packed else None
    out, final = chunk_gated_delta_rule(*inputs, chunk_size=chunk, initial_state=state0, doc_ids=docs)
    lean_out, lean_final = lean_chunk_gated_delta_rule(*twins, chunk_size=chunk, initial_state=state1, doc_ids=docs)
    assert torch.equal(out, lean_out) and torch.equal(final, lean_final)
    weights = torch.randn(final.shape, dtype=torch.float64, generator=gen)  # the final state's gradient too
    (out.square().sum() + (final * weights).sum()).backward()
    (lean_out.square().sum() + (lean_final * weights).sum()).backward()
    for a, b in zip(inputs + [state0] * carried, twins + [state1] * carried):
        assert (a.grad - b.grad).abs().max() < 1e-12 * max(1.0, a.grad.abs().max().item())


def test_lean_form_in_float32_and_bfloat16_keeps_dtypes_and_equals_the_chunked_form():
    q, k, v, g, beta = (t.float() for t in _inputs(s=70))
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)] + [g.clone().requires_grad_(),
                                                                       beta.clone().requires_grad_()]
        twins = [t.detach().clone().requires_grad_() for t in inputs]
        out, _ = chunk_gated_delta_rule(*inputs, chunk_size=16)
        lean, _ = lean_chunk_gated_delta_rule(*twins, chunk_size=16)
        assert lean.dtype == dtype and torch.equal(out, lean)
        out.float().square().sum().backward()
        lean.float().square().sum().backward()
        for a, b in zip(inputs, twins):
            assert b.grad.dtype == a.dtype and (a.grad.float() - b.grad.float()).abs().max() < 1e-5


def test_lean_form_saves_only_its_inputs():
    """What autograd keeps for the lean rule: q, k, v, g, beta themselves (no per-chunk tensor)."""
    inputs = [t.float().requires_grad_() for t in _inputs(s=96)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lean_chunk_gated_delta_rule(*inputs, chunk_size=16)
    assert sum(t.numel() for t in saved) == sum(t.numel() for t in inputs)


def test_convolution_with_carried_state_and_ragged_rows_equals_the_whole_sequence():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 11, 5, generator=gen), torch.randn(5, 4, generator=gen)
    whole, _ = causal_conv1d(x, w)
    reference = F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=3, groups=5)[..., :11]).transpose(1, 2)
    assert (whole - reference).abs().max() < 1e-6
    first, state = causal_conv1d(x[:, :6], w)            # 6 tokens, then 5 more from the carried state
    rest, _ = causal_conv1d(x[:, 6:], w, state=state)
    assert (torch.cat([first, rest], 1) - whole).abs().max() < 1e-6
    # rows of 4 and 6 real tokens padded to 6: each row's state is taken at its own last token
    _, ragged = causal_conv1d(x[:, :6], w, lengths=torch.tensor([4, 6]))
    _, four = causal_conv1d(x[:1, :4], w)
    assert torch.equal(ragged[0], four[0]) and torch.equal(ragged[1], state[1])


def test_cpu_tensors_take_the_torch_forms_and_a_packed_batch_never_the_kernels():
    """The dispatch: fla's kernels only for CUDA tensors without document masks."""
    from megatron_s2.models.intern_s2.gated_delta import delta_rule

    q, k, v, g, beta = _inputs()
    out, state = delta_rule(q, k, v, g, beta, chunk_size=8)
    want, want_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    assert torch.equal(out, want) and torch.equal(state, want_state)
    out, _ = delta_rule(q, k, v, g, beta, recurrent=True)
    assert torch.equal(out, recurrent_gated_delta_rule(q, k, v, g, beta)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device (no GPU here)")
def test_fla_kernels_equal_the_torch_forms_on_cuda():
    from megatron_s2.models.intern_s2.gated_delta import delta_rule, fla_available

    if not fla_available():
        pytest.skip("fla-core is not installed (pip install fla-core)")
    q, k, v, g, beta = (t.float().cuda() for t in _inputs(s=200, dk=64, dv=64))
    state0 = torch.randn(2, 4, 64, 64, device="cuda")
    for recurrent in (False, True):
        out, state = delta_rule(q, k, v, g, beta, initial_state=state0, recurrent=recurrent)
        want, want_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state0)
        assert (out - want).abs().max() < 2e-3 * want.abs().max() and (state - want_state).abs().max() < 2e-3 * want_state.abs().max()


def test_recomputed_convolution_and_gated_norm_equal_plain_autograd():
    """The layer's conv + SiLU and gated RMSNorm keep only their inputs (recomputed in backward):
    same outputs and gradients as autograd through them, and fewer bytes kept."""
    import functools

    from megatron_s2.models.intern_s2.layers import _gated_rms_norm
    from megatron_s2.models.intern_s2.recompute import recomputed

    gen = torch.Generator().manual_seed(4)
    docs = torch.tensor([[0] * 5 + [1] * 6])
    conv = functools.partial(causal_conv1d, doc_ids=docs)
    norm = functools.partial(_gated_rms_norm, eps=1e-6)
    for fn, shapes in ((conv, [(1, 11, 5), (5, 4)]), (norm, [(1, 11, 3, 8), (1, 11, 3, 8), (8,)])):
        inputs = [torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_() for shape in shapes]
        twins = [t.detach().clone().requires_grad_() for t in inputs]
        kept = {"plain": 0, "recomputed": 0}
        for key, args, run in (("plain", inputs, fn), ("recomputed", twins, functools.partial(recomputed, fn))):
            def pack(t, key=key):
                kept[key] += t.numel()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = run(*args)
            out = out[0] if isinstance(out, tuple) else out
            out.sin().sum().backward()
        assert kept["recomputed"] < kept["plain"]
        for a, b in zip(inputs, twins):
            assert torch.equal(a.grad, b.grad)
