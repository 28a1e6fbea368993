"""The Intern-S2 family (``model.family: intern_s2``): a hybrid Gated DeltaNet + gated-attention MoE.

Intern-S2 walkthrough (seed 000) Ch. 1: a 397B scientific model whose precision map keeps the
*Gated DeltaNet recurrent states* in FP32, compared throughout against Qwen3.5-397B-A17B — the
public hybrid of that size class. The backbone here is that public architecture, in the layout
of the Hugging Face ``qwen3_5_moe`` implementation (the reference for names and semantics):

* :mod:`.gated_delta` — the gated delta rule (chunked WY form for training and prefill, the
  token-by-token recurrence for decode) and the short causal convolution;
* :mod:`.layers` — Gated DeltaNet, gated full attention, the routed + gated-shared-expert MoE,
  the decoder block; :mod:`.model` — the model of one rank (the family-model contract);
* :mod:`.hf` — Qwen3.5-MoE ``config.json`` and tensor names; :mod:`.executor` — the engine's
  per-request conv + recurrent state and paged KV; :mod:`.family` — ``FAMILY``.

Importing this package (and its ``config`` module) does not import torch.
"""
