"""The gated delta rule and the short causal convolution of a Gated DeltaNet layer.

Per value head, with an L2-normalised key ``k_t``, query ``q_t`` (scaled by ``d_k^-1/2``), value
``v_t``, decay ``a_t = exp(g_t)`` (``g_t <= 0``) and write strength ``beta_t`` in (0, 1), the
state ``S`` (``d_k x d_v``, float32 — walkthrough Ch. 1 precision map: "Gated DeltaNet recurrent
states" in FP32) evolves as::

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

i.e. decay, then replace what the memory predicts for ``k_t`` by ``v_t`` with strength
``beta_t`` (the delta rule), then read with ``q_t``. :func:`recurrent_gated_delta_rule` runs it
token by token (decode: one step per token, state carried between engine steps).

**Chunked form** (:func:`chunk_gated_delta_rule`, training and prefill). Inside a chunk of C
tokens with cumulative log-decay ``G_i = g_1 + ... + g_i`` and entry state ``S_0``, the
per-token writes ``d_j = beta_j (v_j - k_j^T a_j S_{j-1})`` satisfy the unit lower-triangular
system (the WY / UT representation of the product of Householder-like factors)::

    (I + A) d = beta v - diag(beta e^G) K S_0,     A_ij = beta_i e^(G_i - G_j) k_i.k_j   (j < i)

so ``d = U - W S_0`` with ``U = (I+A)^-1 beta v`` and ``W = (I+A)^-1 diag(beta e^G) K``: two
triangular solves per chunk, all in matrix products. Then::

    o_i   = e^(G_i) q_i^T S_0 + sum_{j<=i} e^(G_i - G_j) (q_i.k_j) d_j
    S_C   = e^(G_C) S_0 + sum_j e^(G_C - G_j) k_j d_j^T

and only the C x C products and the d_k x d_v state cross chunks sequentially. Both forms
compute the same function (tests: float64 agreement to 1e-12, float32 to ~1e-6).

**Packed documents** (``doc_ids``): a token never reads memory written by another document.
Every term above that joins tokens ``i`` and ``j`` is multiplied by ``[doc_i == doc_j]``, and
the ``S_0`` terms by ``[doc_i == doc of the token before the chunk]`` — exactly what resetting
the state to zero at each document start computes, without a decay of -inf (whose cumulative
sums would lose the small decays of the next document to float32 round-off).

**Grouped values**: ``q``/``k`` have ``Hk`` heads, ``v`` has ``Hv = r Hk``; value head ``h``
reads key head ``h // r`` (the reference's ``repeat_interleave`` grouping).

**Memory** (:func:`lean_chunk_gated_delta_rule`, what training runs): autograd through the
chunk loop would keep, per chunk and head, the C x C decay pairs, the triangular system and its
solution, the intra-chunk scores, the d_k x d_v state entering the chunk and the writes ``d``
(~5C floats per token and head, plus d_k d_v / C for the states). Like fla-core's
``chunk_gated_delta_rule`` (whose backward re-runs the state recurrence) the lean form keeps only
its inputs: its backward recomputes the chunk-entry states in one sweep (states only), then
rebuilds and backpropagates one chunk at a time, last to first, carrying the state's gradient.
Forward results are bit-identical to :func:`chunk_gated_delta_rule`; gradients equal autograd's
through it (tests). Context parallelism runs it too (on its augmented values).

**Kernels** (:func:`delta_rule`): on CUDA tensors, with the optional ``fla-core``
(flash-linear-attention) package installed and ``MEGATRON_S2_KERNELS`` not ``reference``, its
fused chunked / recurrent Triton kernels run instead of the torch forms (same semantics: L2
normalisation in the kernel, ``d_k^-1/2`` scale, float32 state); packed documents keep the torch
form (their masks are not a kernel input). fla's kernels need a GPU driver even under Triton's
interpreter, so on CPU only the torch forms are tested; tests/intern_s2/test_gated_delta.py
compares the kernels with them when CUDA and fla are present.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from megatron_s2.kernels.dispatch import kernel_mode

__all__ = ["l2_normalize", "chunk_gated_delta_rule", "lean_chunk_gated_delta_rule", "recurrent_gated_delta_rule",
           "causal_conv1d", "delta_rule", "fla_available"]


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    """The optional ``fla-core`` kernels import (checked once; a broken install counts as absent)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


def delta_rule(q, k, v, g, beta, *, chunk_size: int = 64, initial_state=None, doc_ids=None, recurrent: bool = False):
    """The gated delta rule by the best available implementation (module docstring, "Kernels"):
    ``recurrent`` picks the token-by-token form (decode); the chunked torch form is the lean one
    (module docstring, "Memory"). Same arguments and results as :func:`chunk_gated_delta_rule`."""
    if doc_ids is None and v.is_cuda and kernel_mode() != "reference" and fla_available():
        return _fla_delta_rule(q, k, v, g, beta, initial_state=initial_state, recurrent=recurrent)
    if recurrent:
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, doc_ids=doc_ids)
    return lean_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                       doc_ids=doc_ids)


def _fla_delta_rule(q, k, v, g, beta, *, initial_state, recurrent: bool):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    ratio = v.size(2) // k.size(2)
    if ratio > 1:  # value-head groups: each key head serves `ratio` consecutive value heads
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    state = None if initial_state is None else initial_state.float()
    fn = fla_recurrent if recurrent else fla_chunk
    out, final = fn(q, k, v, g=g.float(), beta=beta.to(v.dtype), initial_state=state, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return out.to(v.dtype), final.float()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (the reference's q/k normalisation)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta):
    """[b, s, H, d] inputs -> float32 [b, Hv, s, d] (q/k repeated over their value-head group),
    q/k L2-normalised and q scaled by d_k^-1/2; g, beta -> [b, Hv, s]."""
    ratio = v.size(2) // k.size(2)
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    dtype = torch.promote_types(v.dtype, torch.float32)  # float32 math (float64 when given, for tests)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.size(-1) ** -0.5
    return q, k, v, g.transpose(1, 2).to(dtype), beta.transpose(1, 2).to(dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (module docstring), differentiable by plain autograd.

    ``q``, ``k``: [b, s, Hk, dk]; ``v``: [b, s, Hv, dv]; ``g`` (log decay, <= 0), ``beta``:
    [b, s, Hv]; ``initial_state``: [b, Hv, dk, dv] or None (zeros); ``doc_ids``: [b, s] or None.
    Returns the output [b, s, Hv, dv] in ``v``'s dtype and the final state [b, Hv, dk, dv] float32.
    """
    s = v.size(1)
    ops = _chunk_operands(q, k, v, g, beta, min(chunk_size, s), doc_ids)
    state = _start_state(initial_state, k, v)
    outs = []
    for i in range(ops[0].size(2)):
        out, state = _chunk_step([t[:, :, i] for t in ops], state)
        outs.append(out)
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :s]
    return out.transpose(1, 2).to(v.dtype), state


def _start_state(initial_state, k, v):
    """The state before the first token in the math dtype: ``initial_state`` or zeros [b, Hv, dk, dv]."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    if initial_state is not None:
        return initial_state.to(dtype)
    return v.new_zeros(v.size(0), v.size(2), k.size(-1), v.size(-1), dtype=dtype)


def _chunk_operands(q, k, v, g, beta, c: int, doc_ids, doc_before=None):
    """The chunk loop's operands, [b, Hv, n, c, ...] each: ``(q_entry, attn, u, w, k_exit,
    exit_decay)`` (module docstring: ``d = U - W S_0``, ``o = q_entry S_0 + attn d``,
    ``S_C = exit_decay S_0 + k_exit^T d``). ``doc_before`` [b]: the document of the token before
    the first chunk (None: the first chunk's own first token, i.e. the sequence start)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, _ = k.shape
    dv = v.size(-1)
    pad = (-s) % c
    if pad:  # padded tokens: no write (beta 0), no decay (g 0), their outputs are dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // c
    q, k, v = (t.reshape(b, h, n, c, t.size(-1)) for t in (q, k, v))
    cum = g.reshape(b, h, n, c).cumsum(-1)                      # G_i within each chunk
    beta = beta.reshape(b, h, n, c)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # e^(G_i - G_j) for j <= i, zero above the diagonal (masked before exp: no overflow)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    entry = cum.exp()                                           # e^(G_i): decay of S_0 at token i
    if doc_ids is not None:
        docs = F.pad(doc_ids, (0, pad), value=-1) if pad else doc_ids
        docs = docs.reshape(b, 1, n, c)
        pair = pair * (docs.unsqueeze(-1) == docs.unsqueeze(-2))
        first = docs[..., :1, :1] if doc_before is None else doc_before.view(b, 1, 1, 1)
        before = torch.cat([first, docs[..., :-1, -1:]], dim=2)  # doc of the token before each chunk
        entry = entry * (docs == before)
    kk = k @ k.transpose(-1, -2)
    system = (beta.unsqueeze(-1) * kk * pair).tril(-1)              # A (strictly lower)
    system = system + torch.eye(c, dtype=system.dtype, device=system.device)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * entry).unsqueeze(-1) * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]                   # d = U - W S_0
    attn = (q @ k.transpose(-1, -2)) * pair                     # e^(G_i - G_j) q_i.k_j, j <= i
    q_entry = q * entry.unsqueeze(-1)
    k_exit = k * pair[..., -1, :].unsqueeze(-1)                 # e^(G_C - G_j) (same doc as the last token)
    exit_decay = entry[..., -1]                                 # e^(G_C) when S_0 survives the chunk
    return q_entry, attn, u, w, k_exit, exit_decay


def _chunk_step(ops, state):
    """One chunk of the recurrence: its output rows and the state after it."""
    q_entry, attn, u, w, k_exit, exit_decay = ops
    d = u - w @ state
    out = q_entry @ state + attn @ d
    return out, exit_decay[..., None, None] * state + k_exit.transpose(-1, -2) @ d


class _LeanChunkRule(torch.autograd.Function):
    """:func:`chunk_gated_delta_rule` that saves only its inputs for backward (module docstring,
    "Memory"): the forward runs without a graph; the backward recomputes the chunk-entry states
    (one forward sweep, states only), then walks the chunks last to first, rebuilding one chunk's
    graph at a time and backpropagating the output gradient and the gradient of the state that
    left the chunk."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, chunk_size, doc_ids):
        ctx.chunk_size, ctx.has_initial = chunk_size, initial_state is not None
        ctx.save_for_backward(q, k, v, g, beta, initial_state, doc_ids)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                      doc_ids=doc_ids)

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        q, k, v, g, beta, initial_state, doc_ids = ctx.saved_tensors
        inputs = (q, k, v, g, beta)
        s = v.size(1)
        c = min(ctx.chunk_size, s)
        spans = [(lo, min(lo + c, s)) for lo in range(0, s, c)]

        def operands(lo, hi, parts):
            docs = None if doc_ids is None else doc_ids[:, lo:hi]
            before = None if doc_ids is None or lo == 0 else doc_ids[:, lo - 1]
            return [t[:, :, 0] for t in _chunk_operands(*parts, c, docs, before)]

        with torch.no_grad():  # the state entering each chunk
            entering = [_start_state(initial_state, k, v)]
            for lo, hi in spans[:-1]:
                entering.append(_chunk_step(operands(lo, hi, [t[:, lo:hi] for t in inputs]), entering[-1])[1])
        grads = [torch.zeros_like(t) for t in inputs]
        carried = grad_state  # d loss / d (state leaving the current chunk)
        for (lo, hi), state in zip(reversed(spans), reversed(entering)):
            with torch.enable_grad():
                parts = [t[:, lo:hi].detach().requires_grad_() for t in inputs]
                state = state.detach().requires_grad_()
                out, leaving = _chunk_step(operands(lo, hi, parts), state)
                out = out[:, :, :hi - lo].transpose(1, 2).to(v.dtype)
                found = torch.autograd.grad((out, leaving), (*parts, state), (grad_out[:, lo:hi], carried),
                                            allow_unused=True)
            for whole, part in zip(grads, found[:-1]):
                if part is not None:
                    whole[:, lo:hi] = part
            carried = found[-1]
        grad_initial = carried.to(initial_state.dtype) if ctx.has_initial else None
        return (*grads, grad_initial, None, None)


def lean_chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size: int = 64, initial_state=None, doc_ids=None):
    """:func:`chunk_gated_delta_rule` (same arguments, results and gradients) whose backward
    recomputes the chunk states instead of keeping them: activation memory of its inputs only."""
    return _LeanChunkRule.apply(q, k, v, g, beta, initial_state, chunk_size, doc_ids)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                               doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence (same arguments and results as :func:`chunk_gated_delta_rule`)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    state = q.new_zeros(b, h, dk, v.size(-1)) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(s):
        decay = g[:, :, t].exp()
        if doc_ids is not None and t > 0:  # a new document starts from an empty memory
            decay = decay * (doc_ids[:, t] == doc_ids[:, t - 1]).unsqueeze(1)
        state = state * decay[..., None, None]
        k_t = k[:, :, t]
        predicted = (k_t.unsqueeze(-1) * state).sum(-2)           # S^T k_t
        write = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * write.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-1) * state).sum(-2))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(b, h, 0, v.size(-1))
    return out.transpose(1, 2).to(out_dtype), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, state: torch.Tensor | None = None,
                  doc_ids: torch.Tensor | None = None, lengths: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over the sequence.

    ``x``: [b, s, C]; ``weight``: [C, K] (tap K-1 multiplies the current token); ``state``:
    [b, C, K-1] the inputs of the K-1 tokens before ``x`` (zeros: sequence start). Returns
    ``silu(conv)`` [b, s, C] in ``x``'s dtype and the new state [b, C, K-1] (the last K-1
    inputs). With ``doc_ids`` a tap never reaches into another document (nor into ``state``,
    which then belongs to the document of the first token). ``lengths`` [b]: the real tokens of
    each row (the rest is padding); the new state then holds each row's last K-1 real inputs.
    Written as K shifted products (K is 4), so document masks cost nothing extra.
    """
    b, s, ch = x.shape
    taps = weight.size(1)
    prev = x.new_zeros(b, taps - 1, ch) if state is None else state.transpose(1, 2).to(x.dtype)
    full = torch.cat([prev, x], dim=1)                          # [b, K-1+s, C]
    w = weight.to(torch.promote_types(x.dtype, torch.float32))
    acc = full[:, taps - 1:].to(w.dtype) * w[:, taps - 1]
    for back in range(1, taps):
        shifted = full[:, taps - 1 - back:taps - 1 - back + s].to(w.dtype)
        if doc_ids is not None:
            same = torch.zeros_like(doc_ids, dtype=torch.bool)
            same[:, back:] = doc_ids[:, back:] == doc_ids[:, :-back]
            if state is not None:  # taps into the carried state belong to the first token's document
                same[:, :back] = True
            shifted = shifted * same.unsqueeze(-1)
        acc = acc + shifted * w[:, taps - 1 - back]
    if lengths is None:
        new_state = full[:, s:]                                  # the last K-1 inputs
    else:                                                       # row r: full[len_r : len_r + K-1]
        index = lengths.view(b, 1, 1) + torch.arange(taps - 1, device=x.device).view(1, -1, 1)
        new_state = full.gather(1, index.expand(b, taps - 1, ch))
    new_state = new_state.transpose(1, 2)
    return F.silu(acc).to(x.dtype), new_state.contiguous()
