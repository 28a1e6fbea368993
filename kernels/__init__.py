"""Compute kernels. Each kernel has a PyTorch reference that runs on CPU (the semantics and
the test oracle) and a Triton implementation selected at run time on CUDA tensors when
Triton imports (:mod:`megatron_s2.kernels.dispatch`). Model code calls the dispatch functions
here and never branches on the device itself; importing this package never imports Triton.
"""

from megatron_s2.kernels.engram import engram_rows
from megatron_s2.kernels.indexer import indexer_gathered_scores, indexer_scores, masked_indexer_scores
from megatron_s2.kernels.quantize import (fake_quant_fp4_e4m3, fake_quant_fp8, fake_quant_mxfp4, pack_fp4_e4m3,
                                          pack_fp8, pack_mxfp4, unpack_fp4_e4m3, unpack_fp8, unpack_mxfp4)
from megatron_s2.kernels.sparse_attention import sparse_attention

__all__ = ["engram_rows", "sparse_attention", "indexer_scores", "indexer_gathered_scores", "masked_indexer_scores",
           "fake_quant_fp4_e4m3", "fake_quant_mxfp4", "fake_quant_fp8", "pack_fp4_e4m3", "unpack_fp4_e4m3",
           "pack_mxfp4", "unpack_mxfp4", "pack_fp8", "unpack_fp8"]
