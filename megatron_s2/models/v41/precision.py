"""The precision map (Intern-S2 walkthrough "FP8 expert linears, BF16 elsewhere, FP32 for RoPE,
RMSNorm, MoE router, recurrent states and the LM head"; V4.1 report §2.4.4, §4.2.1) and how
master weights work with the hybrid optimiser.

Two dtypes of :class:`~megatron_s2.models.v41.config.V41Config` decide it:

* ``compute_dtype`` — the dtype of the residual streams and of every matrix product of a
  linear layer or expert (:func:`set_gemm_dtype`): the GEMM casts its weight to it at use.
  On GPUs this is ``bfloat16``; FP8 GEMMs (``model.fp8``) quantise from it.
* ``params_dtype`` — the dtype the parameters are *stored* and *updated* in.

**Master weights (the decision).** With ``params_dtype: float32`` (the default, and what GPU
recipes use with ``compute_dtype: bfloat16``) the parameters themselves are the float32
master weights: forward and backward see bfloat16 copies made at each GEMM (autograd keeps
the copy for the input gradient and casts the weight gradient back to float32), so ``.grad``
is float32 and Muon (Newton-Schulz in ``optimizer.ns_dtype``), the Sinkhorn update and AdamW
all step float32 weights with float32 momenta. There is no second copy of the weights:
per parameter 4 B weights + 4 B gradients + 4 B momentum (+ 8 B Adam moments for the small
vectors), less than Megatron's bf16 weights + fp32 main gradients + fp32 master copy
(2 + 4 + 4 B + state) as long as ZeRO-1 does not shard the master copy; Muon needs whole
matrices anyway. Checkpoints hold the float32 weights, so a resume is exact. The price is
the transient bfloat16 weight copies kept for backward (2 B per parameter of the layers in
flight; recomputation drops them with the activations).

``params_dtype: bfloat16`` is *pure* bfloat16 training: weights, gradients and momenta are
bfloat16 and there is no master copy — small updates round away. It is kept for memory
experiments and for parity tests in bfloat16; the float32 islands below stay float32 in both.

**Float32 islands** (never cast to ``compute_dtype``): RoPE, RMSNorm, the MoE router and its
correction biases, the mHC coefficients and Sinkhorn mixing, the attention softmax, the
Engram gate and the LM head / cross-entropy compute in at least float32 (:func:`megatron_s2.kernels.precision.wide`; float64
inputs stay float64 so gradient checks run in double precision), and their parameters are
never stored in bfloat16 (:data:`~megatron_s2.models.v41.model.V41Model.FP32_PARAMS`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["set_gemm_dtype", "describe_precision", "describe_fp8"]


def set_gemm_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Make every linear layer and expert of ``model`` multiply in ``dtype`` (modules that
    declare a ``gemm_dtype`` attribute: :mod:`megatron_s2.parallel.linear`, the experts)."""
    for module in model.modules():
        if hasattr(module, "gemm_dtype"):
            module.gemm_dtype = dtype


def describe_precision(params_dtype: str, compute_dtype: str) -> str:
    """One line for the start-up log."""
    master = ("float32 parameters are the master weights (gradients and optimiser state float32)"
              if params_dtype == "float32" else "pure bfloat16: no float32 master copy")
    return (f"precision: GEMMs and streams in {compute_dtype}; {master}; float32 islands: RoPE, RMSNorm, "
            "router, mHC, softmax, Engram gate, LM head")


def describe_fp8(model, fp8, transformer_impl: str, compute_dtype: str) -> str | None:
    """One start-up line saying how many GEMM weights of ``model`` (this rank's) run in native
    FP8 under ``model.fp8`` (None when FP8 is off or Transformer Engine decides). A weight whose
    dimensions are not whole ``fp8.block`` tiles silently kept the compute dtype; with none in
    FP8 the line says so and how to change it."""
    if not fp8.enabled or transformer_impl != "local":
        return None
    from megatron_s2.kernels.fp8_gemm import fp8_shape_supported
    from megatron_s2.models.v41.moe.fp8_experts import _FP8ExpertGemm
    from megatron_s2.parallel.fp8_linear import _FP8Gemm

    on = total = 0
    for module in model.modules():
        if isinstance(module, _FP8Gemm):
            total, on = total + 1, on + bool(module.fp8)
        elif isinstance(module, _FP8ExpertGemm):
            for weight in (module.w1, module.w3, module.w2):
                total += 1
                on += fp8_shape_supported(weight.size(-1), weight.size(-2), module.fp8_block)
    line = (f"fp8: recipe {fp8.recipe}, {fp8.block} x {fp8.block} blocks (experts={fp8.experts}, "
            f"attention={fp8.attention}): {on} of {total} GEMM weights in FP8, the others in {compute_dtype}")
    if on == 0:
        line += (f" -- NO GEMM runs in FP8 (no weight is made of whole {fp8.block}-wide tiles, or both targets "
                 "are off); lower model.fp8.block (a power of two >= 16) or set model.fp8.recipe: none")
    return line
