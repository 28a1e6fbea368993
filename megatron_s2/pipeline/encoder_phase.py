"""The vision phases of a disaggregated encoder step (report §3.1.1, "End-to-End Parallelism").

A training step with images runs vision forward -> LLM forward/backward -> vision backward::

    phase = EncoderPhase.forward(model, micro_batches)  # encodes every micro-batch's images
    result = schedule(model, inputs)                     # the LLM phase, any layout, unchanged
    phase.backward()                                     # the span gradients through the encoder

:meth:`EncoderPhase.forward` replaces each micro-batch's ``images`` by the family's encoded form
(``model.encode_images``: V4.1's :mod:`megatron_s2.models.v41.vision.phase`), which ``embed``
merges like any image input; families or pipeline stages without an encoder keep the images as
they are (and ``embed`` encodes them itself, if at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EncoderPhase"]


@dataclass
class EncoderPhase:
    encoded: list = field(default_factory=list)
    """The encoded images of the step's micro-batches (each with a ``backward()``)."""

    @classmethod
    def forward(cls, model, micro_batches: list[dict]) -> "EncoderPhase":
        """Phase 1: encode the images of every micro-batch (in place: ``mb["images"]``)."""
        encode = getattr(model, "encode_images", None)
        phase = cls()
        for mb in micro_batches:
            if encode is None or mb.get("images") is None:
                continue
            encoded = encode(mb["images"])
            if encoded is not None:
                mb["images"] = encoded
                phase.encoded.append(encoded)
        return phase

    def backward(self) -> None:
        """Phase 3: after the LLM backward, each micro-batch's span gradients through the encoder
        (collective under context parallelism: every CP rank calls it)."""
        for encoded in self.encoded:
            encoded.backward()
        self.encoded.clear()
