"""Data configuration: where training documents come from and how they become sequences.

Two kinds of data feed the trainer (implementation in :mod:`megatron_s2.data`):

* ``synthetic`` — verifiable tasks (addition, multiplication, sorting, copying, reversing,
  balanced brackets) generated deterministically from a seed; no files, no download. The same
  tasks serve RL later, so their difficulty knobs live here in :class:`TaskDifficulty`.
* ``indexed`` — ``.bin``/``.idx`` pairs written by ``tools/preprocess_data.py``, optionally a
  weighted blend of several prefixes.
* ``chat`` — chat conversations (system / user / assistant / tool messages) read from local
  ``.jsonl`` or ``.parquet`` files, tokenized with the tokenizer's chat template; in SFT the
  tokens of ``loss_roles`` are the targets.
* ``image_text`` — image-caption pairs and image question/answer pairs (issue 22) from the
  embedded procedural source, a folder of images with captions, parquet shards or webdataset
  ``.tar`` shards (``source``); each image becomes a span of image tokens planned by the model
  family (:mod:`megatron_s2.data.image_text`).
* ``timeseries`` — a series with a text instruction and answer per document (Intern-S2 report
  §2.2.1-2.2.2): from the embedded procedural generator (no ``paths``) or local .csv / .parquet /
  .npz files (``paths``); each series becomes a span of series tokens planned from
  ``model.timeseries``, and its known future is the forecasting target (:mod:`megatron_s2.data.timeseries_text`).

Prompt/answer pairs are rendered as a one-turn chat (character tokenizer: ``bos + prompt +
sep + answer + eos``), text as ``bos + text + eos``; documents are best-fit packed into rows
of ``seq_length + 1`` tokens and shuffled per epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["TASK_NAMES", "INTEGER_ANSWER_TASKS", "IMAGE_TEXT_SOURCES", "PROCEDURAL_KINDS", "TaskDifficulty", "DataConfig"]

TASK_NAMES: tuple[str, ...] = ("addition", "multiplication", "sort", "copy", "reverse", "brackets")
"""Names of the synthetic verifiable tasks; ``megatron_s2.data.tasks.TASK_REGISTRY`` builds each."""
INTEGER_ANSWER_TASKS: tuple[str, ...] = ("addition", "multiplication")
"""Tasks whose answer is a decimal integer (``DataConfig.near_miss_fraction`` applies to these)."""

IMAGE_TEXT_SOURCES: tuple[str, ...] = ("procedural", "folder", "parquet", "webdataset")
"""Where kind 'image_text' reads its pairs (``DataConfig.source``)."""
PROCEDURAL_KINDS: tuple[str, ...] = ("shape", "digit", "text")
"""Image kinds of the procedural source (``megatron_s2.data.procedural_images.KINDS``)."""
_PROCEDURAL_ONLY: dict[str, object] = {"split": "train", "image_text_format": "both", "procedural_questions": "all",
                                       "procedural_text_stroke": 0}
"""Image-text keys (with their defaults) that only the procedural source reads."""
_SMALLEST_WORD_PX = 12
"""Widest procedural word at the smallest font the drawing shrinks to (Pillow's default font at 6 px)."""


@dataclass(frozen=True)
class TaskDifficulty:
    """Difficulty knobs of the synthetic tasks (shared by pretraining, SFT and RL)."""

    addition_max_digits: int = 6
    """Each addition operand has 1..addition_max_digits decimal digits."""
    multiplication_max_digits: int = 3
    """Each multiplication operand has 1..multiplication_max_digits decimal digits."""
    sort_max_length: int = 10
    """Sorting prompts hold 1..sort_max_length symbols (all digits or all lowercase letters)."""
    string_max_length: int = 12
    """Copy / reverse prompts hold 1..string_max_length letters and digits."""
    brackets_max_length: int = 16
    """Balanced-bracket prompts hold 2..brackets_max_length brackets (an even number)."""

    def __post_init__(self) -> None:
        limits = {
            "addition_max_digits": (1, 30),
            "multiplication_max_digits": (1, 15),
            "sort_max_length": (1, 200),
            "string_max_length": (1, 200),
            "brackets_max_length": (2, 200),
        }
        for name, (low, high) in limits.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(f"{name}: must be in {low}..{high}, got {value}")


@dataclass(frozen=True)
class DataConfig:
    """Training data of a phase: source, tokenizer, rendering and loss masking."""

    kind: Literal["synthetic", "indexed", "chat", "image_text", "procedural_text", "timeseries"] = "synthetic"
    """'synthetic': generated verifiable tasks; 'indexed': .bin/.idx files from
    tools/preprocess_data.py listed in `paths`; 'chat': conversations in the local .jsonl /
    .parquet files listed in `paths`; 'image_text': image-text pairs from `source` (needs a
    model with a vision tower); 'procedural_text': generated text of the `corpus` language;
    'timeseries': series + instruction / answer documents (needs model.timeseries)."""
    tokenizer: str = "char"
    """'char' (the project's character-level tokenizer, vocab 102) or a local Hugging Face
    tokenizer directory (tokenizer.json + tokenizer_config.json with a chat_template), e.g.
    recipes/tokenizers/tiny-bpe; relative paths: working directory, then the project root."""

    # ---- synthetic -----------------------------------------------------------------------
    tasks: tuple[str, ...] = TASK_NAMES
    """Synthetic tasks to mix (uniformly, per document); any of TASK_NAMES."""
    difficulty: TaskDifficulty = field(default_factory=TaskDifficulty)
    """Difficulty knobs of the synthetic tasks."""
    num_documents: int = 20_000
    """Documents generated for kind 'synthetic' (one epoch of data)."""
    dataset_seed: int | None = None
    """Seed of synthetic generation; None uses the run seed. Fix it to keep the data while
    varying the run seed (shuffling always follows the run seed)."""
    near_miss_fraction: float = 0.0
    """kind 'synthetic', integer-answer tasks (addition, multiplication) only: share of documents
    whose answer is a systematic near miss — the last digit one higher, mod 10 — as an imperfect
    teacher would write (the same problems; which documents, a stream of its own). 0 = exact."""

    # ---- procedural_text ---------------------------------------------------------------------
    corpus: Literal["general", "domain"] = "general"
    """kind 'procedural_text': which language — 'general' (broad) or 'domain' (a narrow, distinct
    vocabulary: the Memory Decoder's domain corpus). num_documents / dataset_seed apply."""
    language_seed: int = 0
    """kind 'procedural_text': seed of the language itself (lexicon and grammar); keep it fixed
    across the phases of one experiment and vary dataset_seed for held-out splits."""

    # ---- indexed -------------------------------------------------------------------------
    paths: tuple[str, ...] = ()
    """kind 'indexed': path prefixes (each names prefix.bin and prefix.idx); kind 'chat':
    .jsonl / .parquet files with one conversation per record."""
    weights: tuple[float, ...] = ()
    """Blend weights, one per path; empty = proportional to each dataset's size."""

    # ---- rendering -----------------------------------------------------------------------
    loss_on: Literal["auto", "all", "answer"] = "auto"
    """Which target tokens carry loss: 'all' (pretraining), 'answer' (SFT: the tokens of
    loss_roles — the answer and its eos for prompt/answer data — everything else masked),
    'auto' = 'answer' when the phase is 'sft', else 'all'."""
    loss_roles: tuple[str, ...] = ("assistant",)
    """Chat roles whose tokens are targets under loss_on 'answer' (of system, user, assistant,
    tool); an assistant's generation prompt is never a target."""

    # ---- chat ------------------------------------------------------------------------------
    messages_key: str = "messages"
    """Field of a chat record holding its message list (records may also carry 'tools' and
    'reasoning_effort')."""
    on_bad_record: Literal["stop", "skip"] = "stop"
    """A malformed chat record: 'stop' the run naming file:line, or 'skip' it and log how many
    were skipped (with the first reasons)."""

    # ---- image_text ------------------------------------------------------------------------
    source: Literal["procedural", "folder", "parquet", "webdataset"] = "procedural"
    """kind 'image_text': 'procedural' (rendered shapes / digits / words, no files; num_documents
    items seeded by dataset_seed), 'folder' (`paths`: directories of images with a same-named
    .txt caption or a captions.jsonl of {"image": name, "text": caption}), 'parquet' (`paths`:
    .parquet files with image bytes and text columns) or 'webdataset' (`paths`: .tar shards of
    key.<png|jpg|...> + key.txt)."""
    image_text_format: Literal["caption", "qa", "both"] = "both"
    """Procedural source: documents are the image then its caption ('caption'), the image then a
    question and its answer ('qa', the answer is the SFT target), or both kinds. File sources
    hold captions."""
    split: Literal["train", "heldout"] = "train"
    """Procedural source: 'heldout' draws items from a seed disjoint from training's
    (megatron_s2.data.image_text.split_seed), for evaluation."""
    image_size: int = 64
    """Procedural source: image side in pixels (>= 32)."""
    procedural_kinds: tuple[str, ...] = PROCEDURAL_KINDS
    """Procedural source: image kinds to draw, of PROCEDURAL_KINDS."""
    procedural_questions: Literal["all", "identity"] = "all"
    """Procedural source, formats 'qa' / 'both': which question each item asks. 'all': item i
    asks its pairs in turn (pair i mod n: a shape item is asked its shape or its colour);
    'identity': every item asks what it shows ("what shape / digit is this?", "what does the
    text say?"), never the colour — the questions that need the object's form, not one pixel."""
    procedural_text_stroke: int = 0
    """Procedural source: pixels of extra stroke width on digits and words (Pillow's stroke_width,
    in the glyph's colour): the default font's ~3-pixel strokes are thin next to a 4-pixel vision
    patch. 0 = the font's own strokes; items keep their kind, label, colour, size and place. At most
    (image_size - 16) / 2, and only with digit / text kinds."""
    image_column: str = "image"
    """Parquet source: column of encoded image bytes (or a {bytes, path} struct, as Hugging Face
    datasets write an Image feature)."""
    text_column: str = "text"
    """Parquet source: column of captions."""
    image_max_pixels: int = 32 * 1024 * 1024
    """Largest decoded width x height accepted; larger images are refused naming the file."""

    # ---- timeseries ------------------------------------------------------------------------
    series_length: int = 256
    """kind 'timeseries': longest history (steps) of a document's series; procedural items draw
    their length from [series_length / 2, series_length], file windows take series_length."""
    series_horizon: int = 48
    """kind 'timeseries': longest forecast horizon (steps); procedural items draw theirs from
    [series_horizon / 4, series_horizon], files hold out the last series_horizon steps of a window."""
    series_channels: int = 3
    """kind 'timeseries', procedural: channels (lead/lag copies of one seasonal driver)."""
    series_noise: float = 0.1
    """kind 'timeseries', procedural: standard deviation of the additive noise (driver amplitude ~1)."""
    series_sample_rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    """kind 'timeseries', procedural: sampling rates (Hz) drawn per item (instructions may then ask
    in seconds); files use their npz ``sample_rate`` or none."""

    def __post_init__(self) -> None:
        if not self.tasks and self.kind == "synthetic":
            raise ConfigError(f"tasks: synthetic data needs at least one task; valid names: {', '.join(TASK_NAMES)}")
        for name in self.tasks:
            if name not in TASK_NAMES:
                raise ConfigError(f"tasks: unknown task '{name}'; valid names: {', '.join(TASK_NAMES)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"tasks: duplicate task names in {list(self.tasks)}; list each task once")
        if self.num_documents < 1:
            raise ConfigError(f"num_documents: must be >= 1, got {self.num_documents}")
        if self.dataset_seed is not None and not 0 <= self.dataset_seed < 2 ** 63:
            raise ConfigError(f"dataset_seed: must be a non-negative integer below 2**63 or null, "
                              f"got {self.dataset_seed}")
        if not (0.0 <= self.near_miss_fraction < 1.0):
            raise ConfigError(f"near_miss_fraction: must be in [0, 1), got {self.near_miss_fraction}")
        if self.near_miss_fraction > 0:
            if self.kind != "synthetic":
                raise ConfigError(f"near_miss_fraction: applies to kind 'synthetic' only; kind '{self.kind}' "
                                  "generates no task answers (leave it at 0)")
            other = [name for name in self.tasks if name not in INTEGER_ANSWER_TASKS]
            if other:
                raise ConfigError(f"near_miss_fraction: needs integer-answer tasks ({', '.join(INTEGER_ANSWER_TASKS)}); "
                                  f"drop {other} from tasks or set it to 0")
        if not 0 <= self.language_seed < 2 ** 63:
            raise ConfigError(f"language_seed: must be a non-negative integer below 2**63, got {self.language_seed}")
        if self.kind != "image_text":
            for name in ("procedural_questions", "procedural_text_stroke"):
                if getattr(self, name) != _PROCEDURAL_ONLY[name]:
                    raise ConfigError(f"{name}: applies to kind 'image_text' (source 'procedural') only; kind "
                                      f"'{self.kind}' draws no images (leave it at the default)")
        if self.kind == "indexed":
            if not self.paths:
                raise ConfigError("paths: kind 'indexed' needs at least one dataset prefix "
                                  "(write one with tools/preprocess_data.py --output-prefix PREFIX)")
            if len(set(self.paths)) != len(self.paths):
                raise ConfigError(f"paths: duplicate prefixes in {list(self.paths)}")
        elif self.kind == "chat":
            if not self.paths:
                raise ConfigError("paths: kind 'chat' needs at least one .jsonl or .parquet file of conversations")
            for path in self.paths:
                if not path.lower().endswith((".jsonl", ".parquet")):
                    raise ConfigError(f"paths: '{path}' is not a .jsonl or .parquet file (kind 'chat')")
            if len(set(self.paths)) != len(self.paths):
                raise ConfigError(f"paths: duplicate files in {list(self.paths)}")
        elif self.kind == "image_text":
            self._check_image_text()
        elif self.kind == "timeseries":
            self._check_timeseries()
        elif self.paths or self.weights:
            raise ConfigError("paths: only kinds 'indexed', 'chat', 'image_text' and 'timeseries' read files; set the "
                              "kind or drop paths/weights")
        roles = ("system", "user", "assistant", "tool")
        bad = [r for r in self.loss_roles if r not in roles]
        if bad or not self.loss_roles:
            raise ConfigError(f"loss_roles: {bad or '[]'} — give one or more of {', '.join(roles)}")
        if not self.tokenizer:
            raise ConfigError("tokenizer: must be 'char' or a tokenizer directory")
        if self.weights:
            if len(self.weights) != len(self.paths):
                raise ConfigError(f"weights: {len(self.weights)} weights for {len(self.paths)} paths; "
                                  "give one weight per path or none")
            for weight in self.weights:
                if not (math.isfinite(weight) and weight > 0):
                    raise ConfigError(f"weights: every weight must be a positive finite number, got {weight}")

    def _check_image_text(self) -> None:
        if self.source == "procedural":
            if self.paths or self.weights:
                raise ConfigError("paths: source 'procedural' reads no files; drop paths/weights or pick source "
                                  "folder | parquet | webdataset")
            if self.image_size < 32:
                raise ConfigError(f"image_size: procedural images need at least 32 pixels a side, got {self.image_size}")
            bad = [k for k in self.procedural_kinds if k not in PROCEDURAL_KINDS]
            if bad or not self.procedural_kinds:
                raise ConfigError(f"procedural_kinds: {bad or '[]'} — give one or more of {', '.join(PROCEDURAL_KINDS)}")
            self._check_procedural_drawing()
            return
        changed = [name for name, default in _PROCEDURAL_ONLY.items() if getattr(self, name) != default]
        if changed:
            raise ConfigError(f"{changed[0]}: applies to source 'procedural' only; source '{self.source}' holds "
                              f"captions (leave {' / '.join(changed)} at the default)")
        if not self.paths:
            what = {"folder": "image directories", "parquet": ".parquet files", "webdataset": ".tar shards"}
            raise ConfigError(f"paths: source '{self.source}' needs one or more {what[self.source]}")
        if len(set(self.paths)) != len(self.paths):
            raise ConfigError(f"paths: duplicate entries in {list(self.paths)}")
        suffix = {"parquet": ".parquet", "webdataset": ".tar"}.get(self.source)
        for path in self.paths:
            if suffix and not path.lower().endswith(suffix):
                raise ConfigError(f"paths: '{path}' is not a {suffix} file (source '{self.source}')")
        if self.image_max_pixels < 1:
            raise ConfigError(f"image_max_pixels: must be a positive integer, got {self.image_max_pixels}")

    def _check_procedural_drawing(self) -> None:
        stroke, widest = self.procedural_text_stroke, (self.image_size - _SMALLEST_WORD_PX - 4) // 2
        if stroke < 0:
            raise ConfigError(f"procedural_text_stroke: must be >= 0 pixels, got {stroke}")
        if stroke > widest:  # a word at the smallest font plus a stroke each side must fit, 2-pixel margins
            raise ConfigError(f"procedural_text_stroke: {stroke} pixels is too bold for {self.image_size}-pixel "
                              f"images; at most {widest} (or raise image_size)")
        if stroke and not {"digit", "text"} & set(self.procedural_kinds):
            raise ConfigError(f"procedural_text_stroke: thickens digits and words only; procedural_kinds "
                              f"{list(self.procedural_kinds)} draw none (add digit / text or leave it at 0)")
        if self.procedural_questions != "all" and self.image_text_format == "caption":
            raise ConfigError("procedural_questions: picks the question of formats 'qa' / 'both'; "
                              "image_text_format 'caption' asks none (leave it at 'all')")

    def _check_timeseries(self) -> None:
        for name in ("series_length", "series_horizon", "series_channels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.series_length < 2:
            raise ConfigError(f"series_length: a series needs at least 2 steps, got {self.series_length}")
        if self.series_noise < 0:
            raise ConfigError(f"series_noise: must be >= 0, got {self.series_noise}")
        if not self.series_sample_rates or not all(r > 0 for r in self.series_sample_rates):
            raise ConfigError(f"series_sample_rates: give one or more positive rates in Hz, got "
                              f"{list(self.series_sample_rates)}")
        for path in self.paths:
            if not path.lower().endswith((".csv", ".parquet", ".npz")):
                raise ConfigError(f"paths: '{path}' is not a .csv, .parquet or .npz series file (kind 'timeseries')")
        if len(set(self.paths)) != len(self.paths):
            raise ConfigError(f"paths: duplicate files in {list(self.paths)}")
        if self.weights:
            raise ConfigError("weights: kind 'timeseries' reads its files as one dataset; drop weights")

    def loss_mode(self, phase: str) -> Literal["all", "answer"]:
        """Resolve `loss_on` for a phase name ('auto' masks prompts only in 'sft' and in
        'timeseries_forecast', whose text is instruction / answer turns)."""
        if self.loss_on != "auto":
            return self.loss_on
        return "answer" if phase in ("sft", "timeseries_forecast") else "all"

    def generation_seed(self, run_seed: int) -> int:
        """Seed of synthetic generation: `dataset_seed`, or the run seed when unset."""
        return run_seed if self.dataset_seed is None else self.dataset_seed
