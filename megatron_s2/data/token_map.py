"""Engram's compressed token map, derived from tokenizer files (report §2.4.2).

Engram hashes N-grams over *compressed* ids: tokens whose surface forms normalise alike
(``" The"``, ``"the"``, ``"THE"``) share one id, so the map — and the compressed vocabulary
size, from which every hash multiplier is drawn (:mod:`megatron_s2.models.v41.engram.hashing`)
— is a property of the tokenizer files alone. The derivation follows the public
DeepSeek-V4.1-Flash inference code's semantics (``build_compressed_token_map`` in its Engram
module), so a model trained here addresses the same table rows as the released one would for
the same tokenizer:

1. every id ``0 .. len(tokenizer) - 1`` (added tokens included) is decoded on its own with the
   raw ``tokenizers`` backend, special tokens kept;
2. a decoded form that contains U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw
   vocabulary string (``id_to_token``), so distinct byte pieces never merge;
3. otherwise the key is the surface form after NFKC, NFD, accent stripping, lower-casing,
   collapsing runs of space/tab/CR/LF into one space and stripping surrounding whitespace —
   except that a form that is only whitespace keys as a single space (it never becomes empty);
   a form that normalises to nothing keeps its decoded text as the key;
4. keys are numbered densely in order of first appearance (id order).

Ids a model has beyond the tokenizer (an embedding padded to a round size) are never produced
by text; they share the compressed id of the pad token, so the compressed vocabulary size —
and with it every hash — is the tokenizer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer as Backend

__all__ = ["surface_normalizer", "compressed_token_map", "extend_token_map"]

_LONE_SPACE = "\ue000"  # private-use placeholder: a whitespace-only form must survive Strip()


def surface_normalizer():
    """The normaliser of rule 3 as a ``tokenizers`` normaliser sequence."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " "),
    ])


def compressed_token_map(backend: "Backend", num_tokens: int | None = None) -> list[int]:
    """Compressed id of every tokenizer id (rules 1-4); ``num_tokens`` defaults to the
    backend's vocabulary including added tokens."""
    normalizer = surface_normalizer()
    count = backend.get_vocab_size(with_added_tokens=True) if num_tokens is None else num_tokens
    keys: dict[str, int] = {}
    mapping = []
    for token_id in range(count):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        mapping.append(keys.setdefault(key, len(keys)))
    return mapping


def extend_token_map(mapping: list[int], num_ids: int, pad_id: int) -> list[int]:
    """``mapping`` sized for a model with ``num_ids`` embedding rows: ids past the tokenizer
    share the pad token's compressed id (they are never produced by text)."""
    if num_ids < len(mapping):
        raise ValueError(f"num_ids: the map must cover all {len(mapping)} tokenizer ids, got {num_ids}; "
                         "raise the model's vocab_size")
    return mapping + [mapping[pad_id]] * (num_ids - len(mapping))
