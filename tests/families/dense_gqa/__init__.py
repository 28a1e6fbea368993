"""A minimal second model family: a dense pre-norm transformer with grouped-query attention,
RoPE and SwiGLU (the Llama architecture), in ``model.family: tests.families.dense_gqa``.

It exercises the whole family interface — training under tp / sp / pp / dp, checkpoints and
resharding, Hugging Face export and import in the Llama layout (``transformers``' own
``LlamaForCausalLM`` is the oracle), the inference engine with a paged KV cache, and serving.
Importing this package (and its ``config`` module) does not import torch.
"""
