"""Where images go in a text prompt: the ``<image>`` marker (``generate --image``, chat image parts).

A model that takes images reserves one token id as the image placeholder (V4.1:
``model.image_token_id``); the engine expands each placeholder into its image's span
(:meth:`~megatron_s2.inference.engine.InferenceEngine.prepare_images`). Text prompts mark the
places with the literal :data:`IMAGE_MARKER`; the text between markers is tokenised piece by
piece and the placeholder id put between the pieces, so the placeholder never depends on how a
tokenizer spells (or fails to spell) it. Tokenizers that render a chat to ids (the character
tokenizer) get the marker's ids replaced instead (:func:`replace_marker_ids`).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["IMAGE_MARKER", "encode_with_images", "replace_marker_ids"]

IMAGE_MARKER = "<image>"


def encode_with_images(encode: Callable[[str], list[int]], text: str, image_token_id: int
                       ) -> tuple[list[int], int]:
    """(ids of ``text`` with each :data:`IMAGE_MARKER` replaced by ``image_token_id``, markers found)."""
    pieces = text.split(IMAGE_MARKER)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            ids.append(image_token_id)
        if piece:
            ids += encode(piece)
    return ids, len(pieces) - 1


def replace_marker_ids(ids: list[int], marker_ids: list[int], image_token_id: int) -> tuple[list[int], int]:
    """(``ids`` with each run of ``marker_ids`` replaced by ``image_token_id``, runs replaced)."""
    out, found, i, n = [], 0, 0, len(marker_ids)
    while i < len(ids):
        if n and ids[i:i + n] == marker_ids:
            out.append(image_token_id)
            found += 1
            i += n
        else:
            out.append(ids[i])
            i += 1
    return out, found
