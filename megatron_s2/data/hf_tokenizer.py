"""Hugging Face tokenizers from a local directory (no download, ever).

A recipe names a directory (``data.tokenizer: recipes/tokenizers/tiny-bpe``) holding

* ``tokenizer.json`` — the ``tokenizers`` model (e.g. the byte-level BPE that
  ``tools/train_tokenizer.py`` trains), and
* ``tokenizer_config.json`` — special tokens and a Jinja ``chat_template`` (the V4-style one of
  :mod:`.chat_format` for our tokenizers; any Hugging Face chat template works).

:class:`HFTokenizer` wraps ``transformers.PreTrainedTokenizerFast`` loaded with
``local_files_only`` (and ``HF_HUB_OFFLINE=1``) and offers the project's tokenizer protocol
(:class:`megatron_s2.data.tokenizer.Tokenizer`): ``encode`` / ``decode`` without implicit
special tokens, the bos / eos / pad ids and the chat specials by role (``special_ids``),
``apply_chat_template`` with ``reasoning_effort`` (§5.1.4) and ``tools``, ``chat_segments``
(per-message token spans for SFT loss masks), the Engram ``compressed_token_map`` derived from
the files (:mod:`.token_map`), and ``save`` / ``fingerprint`` so checkpoints carry the exact
files. A missing or unusable directory is a :class:`ConfigError` naming the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.chat_format import SPECIAL_TOKEN_NAMES
from megatron_s2.data.errors import DataError
from megatron_s2.data.token_map import compressed_token_map, extend_token_map

__all__ = ["HFTokenizer", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""The files that define a tokenizer (copied beside checkpoints and exports)."""
_OPTIONAL_FILES = ("special_tokens_map.json",)
_REPLACEMENT_CHAR = "\ufffd"


def _compile_template(source: str, where: str):
    """The chat template in a sandboxed Jinja environment configured like transformers'
    (trim_blocks, lstrip_blocks, ``tojson`` without ASCII escaping, ``raise_exception``), so
    it renders any prefix of a conversation — transformers refuses an empty one."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: chat_template is not valid Jinja ({exc})") from None


class HFTokenizer:
    """A local Hugging Face fast tokenizer behind the project's tokenizer protocol."""

    def __init__(self, directory: str | os.PathLike, *, field: str = "data.tokenizer") -> None:
        self.directory = Path(directory)
        where = f"{field}: {self.directory}"
        missing = [name for name in TOKENIZER_FILES if not (self.directory / name).is_file()]
        if not self.directory.is_dir() or missing:
            raise ConfigError(f"{where}: not a tokenizer directory (missing {', '.join(missing) or 'the folder'}); "
                              "name a folder with tokenizer.json + tokenizer_config.json, e.g. one written by "
                              "tools/train_tokenizer.py")
        try:
            config = json.loads((self.directory / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{where}: tokenizer_config.json is not valid JSON ({exc})") from None
        if not isinstance(config, dict) or not isinstance(config.get("chat_template"), str):
            raise ConfigError(f"{where}: tokenizer_config.json has no chat_template string; add one (tools/"
                              "train_tokenizer.py writes the V4-style template)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import PreTrainedTokenizerFast

        try:
            self._tok = PreTrainedTokenizerFast.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as exc:  # the library raises many types for a corrupt file
            raise ConfigError(f"{where}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
        self._backend = self._tok.backend_tokenizer
        ids = {}
        for role in ("bos", "eos", "pad"):
            token_id = getattr(self._tok, f"{role}_token_id")
            if token_id is None:
                raise ConfigError(f"{where}: tokenizer_config.json defines no {role}_token; set it "
                                  f"(the V4-style one is {SPECIAL_TOKEN_NAMES[role]!r})")
            ids[role] = int(token_id)
        vocab = self._tok.get_vocab()
        for role, token in SPECIAL_TOKEN_NAMES.items():
            if role not in ids and token in vocab:
                ids[role] = int(vocab[token])
        self._special_ids = ids
        self._map_cache: list[int] | None = None
        self._template = _compile_template(config["chat_template"], where)

    # ---- ids ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self._special_ids["pad"]

    @property
    def bos_id(self) -> int:
        return self._special_ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["eos"]

    @property
    def unk_id(self) -> int | None:
        """None for byte-level BPE: every string has an encoding."""
        return self._tok.unk_token_id

    @property
    def special_ids(self) -> dict[str, int]:
        """Ids of the special tokens by role: bos, eos, pad and the V4 chat specials present
        (user, assistant, think_begin/end, tool_* — :data:`~.chat_format.SPECIAL_TOKEN_NAMES`)."""
        return dict(self._special_ids)

    @property
    def has_chat_template(self) -> bool:
        return True

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added); special-token strings become their ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return [(e.ids, e.offsets) for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and the (start, end) character span of each token in ``text``."""
        enc = self._backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Iterable[int], *, keep_special: bool = False) -> str:
        """Text of ``ids``; special tokens are dropped unless ``keep_special``; ids outside the
        vocabulary (a padded model embedding may sample them) render as U+FFFD."""
        pieces, run = [], []
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < self.vocab_size:
                run.append(token_id)
                continue
            if run:
                pieces.append(self._backend.decode(run, skip_special_tokens=not keep_special))
                run = []
            pieces.append(_REPLACEMENT_CHAR)
        if run:
            pieces.append(self._backend.decode(run, skip_special_tokens=not keep_special))
        return "".join(pieces)

    # ---- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False,
                            reasoning_effort: int | None = None, tools: Sequence[dict] | None = None,
                            tokenize: bool = True) -> list[int] | str:
        """Token ids (or the text, ``tokenize=False``) of a conversation rendered with the
        directory's chat template; ``reasoning_effort`` adds the §5.1.4 system line."""
        from megatron_s2.data.chat import check_messages

        check_messages(messages, reasoning_effort)
        try:
            text = self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt,
                                         reasoning_effort=reasoning_effort, bos_token=self._tok.bos_token,
                                         eos_token=self._tok.eos_token, pad_token=self._tok.pad_token)
        except Exception as exc:  # TemplateError and whatever the template raises
            raise DataError(f"{self.directory}: chat template failed: {exc}") from None
        return self.encode(text) if tokenize else text

    def chat_segments(self, messages: Sequence[dict[str, Any]], *, reasoning_effort: int | None = None,
                      tools: Sequence[dict] | None = None) -> tuple[list[int], list[int], list[bool]]:
        """(ids, message index of each token (-1: before the first message), whether the token
        belongs to the message body — False for an assistant message's generation prompt).

        Relies on the template rendering a prefix of the conversation as a prefix of the whole
        (true of the V4-style template); a template without that property is an error."""
        from megatron_s2.data.chat import check_messages

        check_messages(messages, reasoning_effort)  # every message, before any is indexed by role
        texts, marks = [], []  # character offset where each message (and its body) starts
        for i in range(len(messages)):
            before = self.apply_chat_template(messages[:i], reasoning_effort=reasoning_effort, tools=tools,
                                              tokenize=False)
            body = before
            if messages[i]["role"] == "assistant":  # the generation prompt is not part of the body
                body = self.apply_chat_template(messages[:i], reasoning_effort=reasoning_effort, tools=tools,
                                                tokenize=False, add_generation_prompt=True)
            texts += [before, body]
            marks.append((len(before), len(body)))
        full = self.apply_chat_template(messages, reasoning_effort=reasoning_effort, tools=tools, tokenize=False)
        for text in texts:
            if not full.startswith(text):
                raise ConfigError(f"{self.directory}: the chat template does not render a conversation's first "
                                  "messages as a prefix of the whole, so tokens cannot be attributed to messages "
                                  "for loss masks; use a prefix-stable template (tools/train_tokenizer.py)")
        ids, offsets = self.encode_with_offsets(full)
        owner, body = [], []
        for start, _ in offsets:
            index = max((i for i, (s, _) in enumerate(marks) if s <= start), default=-1)
            owner.append(index)
            body.append(index >= 0 and start >= marks[index][1])
        return ids, owner, body

    # ---- Engram tokenizer compression ------------------------------------------------------
    def compressed_token_map(self, num_ids: int | None = None) -> list[int]:
        """Compressed id per token id (§2.4.2, :mod:`.token_map`), sized for ``num_ids``
        model ids (extra ids share the pad token's compressed id)."""
        if self._map_cache is None:
            self._map_cache = compressed_token_map(self._backend, self.vocab_size)
        return extend_token_map(self._map_cache, self.vocab_size if num_ids is None else num_ids, self.pad_id)

    @property
    def compressed_vocab_size(self) -> int:
        return max(self.compressed_token_map()) + 1

    # ---- files -------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        return [self.directory / n for n in (*TOKENIZER_FILES, *_OPTIONAL_FILES) if (self.directory / n).is_file()]

    def save(self, directory: str | os.PathLike) -> None:
        """Copy the defining files (byte for byte) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for path in self.files():
            shutil.copyfile(path, out / path.name)

    def fingerprint(self) -> str:
        """sha256 over the defining files' names and bytes."""
        digest = hashlib.sha256()
        for path in self.files():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"
