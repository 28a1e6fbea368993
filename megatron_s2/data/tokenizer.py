"""The project's own character-level tokenizer (no vocabulary download).

Token ids are fixed and deterministic:

====  =========  ==========================================================
id    token      role
====  =========  ==========================================================
0     ``<pad>``  padding; also the Engram "no history" id (ModelConfig.engram_pad_id = 0)
1     ``<bos>``  begins every document
2     ``<eos>``  ends every document
3     ``<sep>``  separates prompt from answer
4     ``<unk>``  any character outside the alphabet
5...  alphabet   digits, a-z, A-Z, ASCII punctuation (brackets, operators), space, \\n, \\t
====  =========  ==========================================================

The default alphabet is all of printable ASCII plus newline and tab, so ``vocab_size`` is 102
and fits the ``tiny`` model (vocab 128). :meth:`CharTokenizer.compressed_token_map` gives the
Engram "tokenizer compression" of DeepSeek-V4.1-Flash §2.4.2: ids that differ only by letter
case or by the kind of whitespace share one dense compressed id, so that hashed n-grams see
the same key for ``The cat`` and ``the\\tcat``.
"""

from __future__ import annotations

import json
import string
from typing import Iterable, Protocol

import numpy as np

from megatron_s2.config.data import DataConfig
from megatron_s2.data.errors import DataError

__all__ = ["Tokenizer", "CharTokenizer", "build_tokenizer", "SPECIAL_TOKENS", "DEFAULT_ALPHABET"]

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
DEFAULT_ALPHABET: str = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n\t"
_JSON_KIND = "char"
_JSON_VERSION = 1
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What the data pipeline, the trainer and RL rollouts need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def sep_id(self) -> int: ...
    @property
    def unk_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class CharTokenizer:
    """One token per character of a fixed alphabet, after five special tokens."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not alphabet:
            raise DataError("alphabet: a character tokenizer needs at least one character")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise DataError(f"alphabet: characters {repeated!r} appear more than once; list each character once")
        self._alphabet = alphabet
        self._num_special = len(SPECIAL_TOKENS)
        self._char_to_id = {c: self._num_special + i for i, c in enumerate(alphabet)}
        self._id_to_char = list(SPECIAL_TOKENS) + list(alphabet)
        # Fast path for ASCII text: a byte -> id lookup table.
        self._ascii_table = np.full(128, self.unk_id, dtype=np.int64)
        for char, token_id in self._char_to_id.items():
            if ord(char) < 128:
                self._ascii_table[ord(char)] = token_id

    # ---- ids -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._id_to_char)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def sep_id(self) -> int:
        return 3

    @property
    def unk_id(self) -> int:
        return 4

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(range(self._num_special))

    @property
    def alphabet(self) -> str:
        return self._alphabet

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as an int64 array; characters outside the alphabet become unk."""
        if text.isascii():
            return self._ascii_table[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
        return np.array([self._char_to_id.get(c, self.unk_id) for c in text], dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added); characters outside the alphabet become unk."""
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        """Text of ``ids``. pad/bos/eos/sep are dropped unless ``keep_special`` (then rendered
        as ``<bos>`` etc.); unk and ids outside the vocabulary (a model with a larger
        embedding than this tokenizer may sample them) render as U+FFFD."""
        pieces = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.unk_id or not 0 <= token_id < self.vocab_size:
                pieces.append(_REPLACEMENT_CHAR)
            elif token_id < self._num_special:
                if keep_special:
                    pieces.append(self._id_to_char[token_id])
            else:
                pieces.append(self._id_to_char[token_id])
        return "".join(pieces)

    # ---- Engram tokenizer compression ------------------------------------------------------
    def compressed_token_map(self, num_ids: int | None = None) -> list[int]:
        """One dense compressed id per token id (§2.4.2 tokenizer compression).

        Letters are case-folded and space/tab/newline collapse into one class; every other
        token keeps a class of its own. Classes are numbered in order of their first token id,
        so the special tokens keep their ids (pad stays 0). ``num_ids`` sizes the map for a
        model whose embedding has more rows than the tokenizer has ids (the ``tiny`` model
        has 128): the extra ids, which no text encodes to, share the class of unk."""
        num_ids = self.vocab_size if num_ids is None else num_ids
        if num_ids < self.vocab_size:
            raise DataError(f"num_ids: the map must cover all {self.vocab_size} tokenizer ids, got {num_ids}; "
                            "raise the model's vocab_size")
        classes: dict[str, int] = {}
        mapping = []
        for token_id, token in enumerate(self._id_to_char):
            if token_id < self._num_special:
                key = f"special:{token}"
            elif token.isspace():
                key = "whitespace"
            else:
                key = token.lower()
            mapping.append(classes.setdefault(key, len(classes)))
        return mapping + [mapping[self.unk_id]] * (num_ids - self.vocab_size)

    @property
    def compressed_vocab_size(self) -> int:
        return max(self.compressed_token_map()) + 1

    # ---- serialisation ---------------------------------------------------------------------
    def to_json(self) -> str:
        """A JSON document from which :meth:`from_json` rebuilds the same tokenizer."""
        payload = {
            "kind": _JSON_KIND,
            "version": _JSON_VERSION,
            "special_tokens": list(SPECIAL_TOKENS),
            "alphabet": self._alphabet,
        }
        return json.dumps(payload, indent=2, ensure_ascii=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "CharTokenizer":
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"tokenizer JSON is not valid JSON ({exc}); "
                            "rewrite it with CharTokenizer.to_json()") from None
        if not isinstance(payload, dict):
            raise DataError(f"tokenizer JSON: expected an object, got {payload!r}")
        if payload.get("kind") != _JSON_KIND:
            raise DataError(f"tokenizer JSON: expected kind '{_JSON_KIND}', got {payload.get('kind')!r}")
        if payload.get("version") != _JSON_VERSION:
            raise DataError(f"tokenizer JSON: unsupported version {payload.get('version')!r} "
                            f"(this build reads {_JSON_VERSION})")
        if list(payload.get("special_tokens", [])) != list(SPECIAL_TOKENS):
            raise DataError(f"tokenizer JSON: special_tokens must be {list(SPECIAL_TOKENS)}")
        alphabet = payload.get("alphabet")
        if not isinstance(alphabet, str):
            raise DataError("tokenizer JSON: 'alphabet' must be a string")
        return cls(alphabet)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other._alphabet == self._alphabet

    def __hash__(self) -> int:
        return hash(self._alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def build_tokenizer(cfg: DataConfig) -> CharTokenizer:
    """The tokenizer named by ``cfg.tokenizer``."""
    if cfg.tokenizer == "char":
        return CharTokenizer()
    raise DataError(f"tokenizer: unknown kind {cfg.tokenizer!r}; valid kinds: 'char'")

