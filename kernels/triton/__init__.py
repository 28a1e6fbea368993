"""Triton implementations of the kernels in :mod:`megatron_s2.kernels`.

Importing anything here imports ``triton``; only the dispatch functions of
:mod:`megatron_s2.kernels` do so, lazily, after :func:`megatron_s2.kernels.dispatch.use_triton`
said yes. Each module's oracle is the PyTorch reference named in its docstring; the tests run
them on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from megatron_s2.kernels.triton import common as _common  # noqa: E402,F401  (checks the interpreter switch)
