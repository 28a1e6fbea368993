"""The tokenizer protocol, the project's character-level tokenizer, and loading by name.

``data.tokenizer`` in a recipe is either ``char`` — the character tokenizer below — or a local
Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json`` with a chat
template; :class:`~megatron_s2.data.hf_tokenizer.HFTokenizer`), e.g. the byte-level BPE shipped in
``recipes/tokenizers/tiny-bpe`` (``tools/train_tokenizer.py`` trains more). Relative directory
paths are tried against the working directory, then the project root. :func:`load_tokenizer`
also reads the copy a run directory or a checkpoint carries (``Tokenizer.save``).

The character tokenizer's ids are fixed and deterministic:

====  =========  ==========================================================
id    token      role
====  =========  ==========================================================
0     ``<pad>``  padding; also the Engram "no history" id (V41Config.engram_pad_id = 0)
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
the same key for ``The cat`` and ``the\\tcat``. Its chat rendering keeps the historical
single-turn layout ``bos + prompt + sep + answer + eos``: user and tool messages are plain text,
an assistant message is ``sep + text + eos`` (``sep`` is its generation prompt), and the header
(§5.1.4 reasoning-effort line, system prompt, tools as JSON) follows ``bos`` with a newline.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError

__all__ = ["Tokenizer", "CharTokenizer", "build_tokenizer", "load_tokenizer", "SPECIAL_TOKENS", "DEFAULT_ALPHABET",
           "CHAR_TOKENIZER_FILE"]

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
DEFAULT_ALPHABET: str = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n\t"
_JSON_KIND = "char"
_JSON_VERSION = 1
_REPLACEMENT_CHAR = "\ufffd"
CHAR_TOKENIZER_FILE = "char_tokenizer.json"
"""The file :meth:`CharTokenizer.save` writes (and :func:`load_tokenizer` recognises)."""


class Tokenizer(Protocol):
    """What the data pipeline, the trainer, checkpoints, serving and RL rollouts need."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def unk_id(self) -> int | None: ...
    @property
    def special_ids(self) -> dict[str, int]:
        """Special-token ids by role (bos, eos, pad, and the chat specials the tokenizer has)."""
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
                            reasoning_effort: int | None = None, tools: Sequence[dict] | None = None,
                            tokenize: bool = True) -> list[int] | str: ...
    def chat_segments(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: int | None = None,
                      tools: Sequence[dict] | None = None) -> tuple[list[int], list[int], list[bool]]:
        """(ids, owning message index per token, whether the token is in the message body)."""
    def compressed_token_map(self, num_ids: int | None = None) -> list[int]: ...
    def save(self, directory: str | os.PathLike) -> None: ...
    def fingerprint(self) -> str: ...


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
    def special_ids(self) -> dict[str, int]:
        return {"pad": 0, "bos": 1, "eos": 2, "sep": 3, "unk": 4}

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

    # ---- chat ----------------------------------------------------------------------------
    def chat_segments(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: int | None = None,
                      tools: Sequence[dict] | None = None) -> tuple[list[int], list[int], list[bool]]:
        """(ids, owning message index per token (-1: bos and header), body flag per token —
        False for an assistant message's ``sep``); layout in the module docstring."""
        from megatron_s2.data.chat import check_messages, header_lines

        check_messages(messages, reasoning_effort)
        header = header_lines(messages, reasoning_effort, tools)
        ids = [self.bos_id, *(self.encode("\n".join(header) + "\n") if header else [])]
        owner, body = [-1] * len(ids), [False] * len(ids)
        for index, message in enumerate(messages):
            role = message["role"]
            if role == "system" and index == 0:
                continue  # part of the header
            if role == "assistant":
                text = message.get("content") or ""
                if message.get("reasoning_content"):
                    text = f"<think>{message['reasoning_content']}</think>{text}"
                if message.get("tool_calls"):
                    text += json.dumps(message["tool_calls"], ensure_ascii=False)
                piece, flags = [self.sep_id, *self.encode(text), self.eos_id], [False] + [True] * (len(text) + 1)
            else:
                piece = self.encode(message["content"])
                flags = [True] * len(piece)
            ids += piece
            owner += [index] * len(piece)
            body += flags
        return ids, owner, body

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
                            reasoning_effort: int | None = None, tools: Sequence[dict] | None = None,
                            tokenize: bool = True) -> list[int] | str:
        """Token ids of a conversation (module docstring); ``tokenize=False`` returns them as
        display text with specials spelled ``<bos>``, ``<sep>``, ... (not re-encodable)."""
        ids = self.chat_segments(messages, reasoning_effort=reasoning_effort, tools=tools)[0]
        ids += [self.sep_id] if add_generation_prompt else []
        return ids if tokenize else self.decode(ids, keep_special=True)

    @property
    def has_chat_template(self) -> bool:
        return True

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

    def save(self, directory: str | os.PathLike) -> None:
        """Write :data:`CHAR_TOKENIZER_FILE` (:meth:`to_json`) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CHAR_TOKENIZER_FILE).write_text(self.to_json())

    def fingerprint(self) -> str:
        """sha256 of the file :meth:`save` writes."""
        digest = hashlib.sha256()
        digest.update(CHAR_TOKENIZER_FILE.encode() + b"\0" + self.to_json().encode() + b"\0")
        return digest.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other._alphabet == self._alphabet

    def __hash__(self) -> int:
        return hash(self._alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(name: str | os.PathLike, *, field: str = "data.tokenizer") -> Tokenizer:
    """``"char"``, a Hugging Face tokenizer directory, or a directory holding a saved
    :data:`CHAR_TOKENIZER_FILE`; anything else is a ConfigError naming ``field`` and the path."""
    if str(name) == "char":
        return CharTokenizer()
    from megatron_s2.data.records import resolve_local_path

    path = resolve_local_path(name)
    if (path / CHAR_TOKENIZER_FILE).is_file():
        try:
            return CharTokenizer.from_json((path / CHAR_TOKENIZER_FILE).read_text())
        except DataError as exc:
            raise ConfigError(f"{field}: {path / CHAR_TOKENIZER_FILE}: {exc}") from None
    from megatron_s2.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(path, field=field)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer named by ``cfg.tokenizer``."""
    return load_tokenizer(cfg.tokenizer)
