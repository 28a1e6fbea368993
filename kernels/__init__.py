"""Compute kernels. Each kernel has a PyTorch reference that runs on CPU (the semantics and
the test oracle) and may have a GPU implementation selected at run time when its
dependencies (Triton, CUDA) are present. Model code calls the dispatch functions here and
never branches on the device itself.
"""

from megatron_s2.kernels.sparse_attention import sparse_attention

__all__ = ["sparse_attention"]
