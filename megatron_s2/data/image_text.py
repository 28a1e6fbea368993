"""Image-text documents for the vision pathway (issue 22; report §2.1.1, §4.1 "Multimodal Data").

``data.kind: image_text`` turns image-text pairs into token documents whose image positions
take the vision encoder's embeddings. Pairs come from one of four ``data.source`` kinds:

* ``procedural`` — the embedded renderer (:mod:`.procedural_images`): item ``i`` of seed ``s``
  is a shape, digit or word with its caption and question/answer pairs; ``split: heldout``
  draws from :func:`split_seed` (a seed no training item uses), so evaluation never sees a
  training image. No files, no download.
* ``folder`` — a directory of images, each captioned by a same-named ``.txt`` (``a.png`` +
  ``a.txt``) or by a ``captions.jsonl`` of ``{"image": "a.png", "text": "..."}`` records.
* ``parquet`` — shards with an image column (encoded bytes, or Hugging Face's ``{bytes, path}``
  struct) and a text column; read with pyarrow (optional: one-line error when absent).
* ``webdataset`` — ``.tar`` shards of ``key.<png|jpg|jpeg|webp|gif|bmp>`` + ``key.txt``, read
  with the standard library's :mod:`tarfile` (members are never extracted to disk).

Nothing is ever unpickled and nothing is fetched. Every image is decoded once when the dataset
is built (through :func:`~megatron_s2.data.images.decode_image`: format sniffed from the bytes,
size and pixel caps, no animations), so a corrupt file, an unsupported format, an image over the
cap, a missing caption or an empty folder stops the run at start-up with one :class:`DataError`
line naming the file and the fix; its pixels are decoded again when a batch needs them.

A document is the tokenizer's rendering with the image span after the leading ``bos``::

    caption: bos [image span] caption eos                 (targets: caption eos)
    qa:      bos [image span] question sep answer eos     (SFT targets: answer eos)

The span's length comes from the model family's resize planning
(:meth:`~megatron_s2.models.family.base.ImageProcessor.span_length`); every span position holds
``image_token_id``. Span tokens are never targets (nothing predicts an image), and a document's
span must fit whole in the first ``seq_length`` positions so that packing never splits it
(:mod:`.packing` cuts long documents at multiples of ``seq_length``; only text follows a cut).
"""

from __future__ import annotations

import json
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from megatron_s2.config.data import DataConfig
from megatron_s2.data.documents import InMemoryDocuments, render_prompt_answer
from megatron_s2.data.errors import DataError
from megatron_s2.data.images import ImageError, ImageLimits, decode_image
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["ImageTextPair", "ImageTextDocuments", "ImageSpan", "split_seed", "load_image_text_pairs",
           "build_image_text_documents", "image_inputs_of_row", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
"""File endings the folder and webdataset sources take for images (contents are still sniffed)."""
HELDOUT_SEED_OFFSET = 1_000_003
"""``split: heldout`` draws procedural items from seed ``dataset seed + HELDOUT_SEED_OFFSET``."""


def split_seed(seed: int, split: str) -> int:
    """Procedural seed of a split: the dataset seed for 'train', a disjoint one for 'heldout'."""
    return seed if split == "train" else (seed + HELDOUT_SEED_OFFSET) % 2 ** 63


@dataclass(frozen=True)
class ImageTextPair:
    """One image with its text: a caption, or a question (``prompt``) and its answer (``text``)."""

    source: str
    """Names the image in errors: a path, ``shard.tar:key``, ``file.parquet row 3``, ``procedural seed 0 item 12``."""
    load: Callable[[], Any]
    """Decodes the image again (an RGB Pillow image); called when a batch needs its pixels."""
    width: int
    height: int
    text: str
    prompt: str | None = None


@dataclass(frozen=True)
class ImageSpan:
    """Where an image sits in its document: token offset, span length and the pair it shows."""

    offset: int
    length: int
    pair: int


class ImageTextDocuments(InMemoryDocuments):
    """Token documents (image spans included) plus, per document, the images they show."""

    def __init__(self, documents: InMemoryDocuments, spans: list[list[ImageSpan]], pairs: list[ImageTextPair]):
        super().__init__(documents._flat, documents.sizes, documents.prompt_lengths, documents._targets)
        self.spans, self.pairs = spans, pairs

    def images_of(self, index: int) -> list[ImageSpan]:
        return self.spans[index]

    def load_image(self, pair: int) -> Any:
        return self.pairs[pair].load()


# ---- sources -------------------------------------------------------------------------------
def _procedural_pairs(cfg: DataConfig, seed: int) -> list[ImageTextPair]:
    from megatron_s2.data.procedural_images import procedural_item

    seed = split_seed(seed, cfg.split)
    kinds = tuple(cfg.procedural_kinds)
    pairs = []
    for index in range(cfg.num_documents):
        draw = dict(seed=seed, size=cfg.image_size, kinds=kinds, text_stroke=cfg.procedural_text_stroke)
        item = procedural_item(index, **draw)
        load = (lambda i=index, draw=draw: procedural_item(i, **draw).image)
        source = f"procedural seed {seed} item {index}"
        size = (cfg.image_size, cfg.image_size)
        if cfg.image_text_format in ("caption", "both"):
            pairs.append(ImageTextPair(source, load, *size, item.caption))
        if cfg.image_text_format in ("qa", "both"):
            # one question per item: rotating over its pairs, or always the identity one (listed first)
            question, answer = item.qa[0 if cfg.procedural_questions == "identity" else index % len(item.qa)]
            pairs.append(ImageTextPair(source, load, *size, answer, question))
    return pairs


def _decoded(data: bytes, source: str, limits: ImageLimits, caption: str) -> ImageTextPair:
    """Decode once (refusing a bad image by name), keep the bytes, decode again on demand."""
    try:
        image = decode_image(data, limits=limits, source=source)
    except ImageError as exc:
        raise ImageError(f"{exc}; replace or remove the image (data.image_max_pixels is the pixel cap)") from None
    if not caption.strip():
        raise DataError(f"{source}: empty caption; give the image a non-empty text or remove it")
    return ImageTextPair(source, lambda: decode_image(data, limits=limits, source=source), image.width, image.height,
                         caption.strip())


def _read(path: Path, limits: ImageLimits) -> bytes:
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise DataError(f"{path}: {size} bytes exceeds the image size limit of {limits.max_bytes} bytes; "
                            "downscale it or remove it")
        return path.read_bytes()
    except OSError as exc:  # a directory named a.png, no permission, a dangling link: one line naming it
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); replace or remove it") from None


def _read_text(path: Path) -> str:
    """A caption file's or manifest's text; bytes that are not UTF-8 are refused naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); re-save it as UTF-8") from None


def _folder_pairs(directory: str, limits: ImageLimits) -> list[ImageTextPair]:
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory; data.paths of source 'folder' name directories of images")
    manifest = root / "captions.jsonl"
    pairs = []
    if manifest.is_file():
        for line_no, line in enumerate(_read_text(manifest).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                name, text = record["image"], record["text"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f'{manifest}:{line_no}: expected a JSON object {{"image": "a.png", "text": '
                                '"caption"}') from None
            path = root / str(name)
            if not path.is_file():
                raise DataError(f"{manifest}:{line_no}: image {path} does not exist")
            pairs.append(_decoded(_read(path, limits), str(path), limits, str(text)))
    else:
        for path in sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            caption = path.with_suffix(".txt")
            if not caption.is_file():
                raise DataError(f"{path}: no caption {caption.name}; add it (or a captions.jsonl) or remove the image")
            pairs.append(_decoded(_read(path, limits), str(path), limits, _read_text(caption)))
    if not pairs:
        raise DataError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) with captions; add image + .txt pairs "
                        "or a captions.jsonl")
    return pairs


def _parquet_pairs(path: str, cfg: DataConfig, limits: ImageLimits) -> list[ImageTextPair]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file (data.paths)")
    try:
        names = pq.read_schema(path).names
        missing = [c for c in (cfg.image_column, cfg.text_column) if c not in names]
        if missing:
            raise DataError(f"{path}: no column(s) {missing} (it has {names}); set data.image_column / "
                            "data.text_column")
        table = pq.read_table(path, columns=[cfg.image_column, cfg.text_column])
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file is one line
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a readable parquet file ({reason})") from None
    pairs = []
    for row, (image, text) in enumerate(zip(table.column(0).to_pylist(), table.column(1).to_pylist())):
        source = f"{path} row {row}"
        if isinstance(image, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
            image = image.get("bytes")
        if not isinstance(image, (bytes, bytearray)):
            raise DataError(f"{source}: column '{cfg.image_column}' holds {type(image).__name__}, not encoded image "
                            "bytes")
        if not isinstance(text, str):
            raise DataError(f"{source}: column '{cfg.text_column}' holds {type(text).__name__}, not a caption")
        pairs.append(_decoded(bytes(image), source, limits, text))
    if not pairs:
        raise DataError(f"{path}: no rows; give shards with image-text rows")
    return pairs


def _webdataset_pairs(path: str, limits: ImageLimits) -> list[ImageTextPair]:
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file (data.paths)")
    samples: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                key, dot, ext = member.name.rpartition(".")
                if not dot or ("." + ext.lower() not in IMAGE_SUFFIXES and ext.lower() != "txt"):
                    continue  # webdataset shards carry other fields (json, cls, ...): not ours
                if member.size > limits.max_bytes:
                    raise DataError(f"{path}:{member.name}: {member.size} bytes exceeds the image size limit of "
                                    f"{limits.max_bytes} bytes")
                samples.setdefault(key, {})["txt" if ext.lower() == "txt" else "image"] = \
                    archive.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # a cut or corrupt gzip / bz2 / xz stream too
        reason = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__  # "r:*" lists every method
        raise DataError(f"{path}: not a readable tar shard ({reason}); rewrite or remove it") from None
    pairs = []
    for key, fields in samples.items():
        source = f"{path}:{key}"
        if "image" not in fields:
            raise DataError(f"{source}: a caption without an image; add {key}.png (or .jpg) or drop {key}.txt")
        if "txt" not in fields:
            raise DataError(f"{source}: an image without a caption; add {key}.txt to the shard")
        pairs.append(_decoded(fields["image"], source, limits, fields["txt"].decode("utf-8", "replace")))
    if not pairs:
        raise DataError(f"{path}: no key.<image> + key.txt samples; write shards of image and caption pairs")
    return pairs


def load_image_text_pairs(cfg: DataConfig, seed: int) -> list[ImageTextPair]:
    """Every pair of the data config, in a fixed order (sources in ``paths`` order)."""
    if cfg.source == "procedural":
        return _procedural_pairs(cfg, cfg.generation_seed(seed))
    limits = ImageLimits(max_pixels=cfg.image_max_pixels)
    pairs: list[ImageTextPair] = []
    for path in cfg.paths:
        if cfg.source == "folder":
            pairs += _folder_pairs(path, limits)
        elif cfg.source == "parquet":
            pairs += _parquet_pairs(path, cfg, limits)
        else:
            pairs += _webdataset_pairs(path, limits)
    return pairs


# ---- documents -----------------------------------------------------------------------------
def build_image_text_documents(cfg: DataConfig, *, seed: int, tokenizer: Tokenizer, processor,
                               seq_length: int) -> ImageTextDocuments:
    """Token documents of every pair (module docstring), sized by ``processor`` (the model
    family's :class:`~megatron_s2.models.family.base.ImageProcessor`)."""
    documents, spans = [], []
    pairs = load_image_text_pairs(cfg, seed)
    for index, pair in enumerate(pairs):
        if pair.prompt is None:
            ids, prompt_length = _caption_ids(tokenizer, pair.text)
        else:
            ids, prompt_length = render_prompt_answer(tokenizer, pair.prompt, pair.text)
        if (ids == processor.image_token_id).any():  # a text token would be taken for an image position
            raise DataError(f"{pair.source}: its text tokenizes to token {processor.image_token_id}, the model's "
                            "image_token_id; set model.image_token_id to an id the tokenizer never produces")
        at = 1 if len(ids) and ids[0] == tokenizer.bos_id else 0  # the image follows bos
        length = processor.span_length(pair.width, pair.height)
        if at + length > seq_length:
            raise DataError(f"{pair.source}: its {pair.width}x{pair.height} image takes {length} image tokens, more "
                            f"than the {seq_length}-token sequence holds after bos; raise training.seq_length to at "
                            f"least {at + length + 1} or lower model.vision_max_n_token")
        span = np.full(length, processor.image_token_id, dtype=np.int64)
        documents.append((np.concatenate([ids[:at], span, ids[at:]]), prompt_length + length))
        spans.append([ImageSpan(at, length, index)])
    if not documents:
        raise DataError("image_text: the source holds no pairs; raise data.num_documents or add images")
    return ImageTextDocuments(InMemoryDocuments.from_documents(documents), spans, pairs)


def _caption_ids(tokenizer: Tokenizer, caption: str) -> tuple[np.ndarray, int]:
    """``bos + caption + eos``; everything after bos is a target."""
    ids = np.asarray([tokenizer.bos_id, *tokenizer.encode(caption), tokenizer.eos_id], dtype=np.int64)
    return ids, 1


def image_inputs_of_row(store: ImageTextDocuments, segments: Sequence[tuple[int, int, int, int]], processor,
                        seq_length: int, cp_rank: int = 0, cp_size: int = 1) -> tuple[list[Any], np.ndarray]:
    """The image inputs of one packed row and its image mask over the row's ``seq_length + 1`` slots.

    ``segments``: (document, start inside it, length, row position) of each segment. A span lies
    whole in the input positions (``[0, seq_length)``) of the segment holding its document's
    start (:func:`build_image_text_documents` checks it), so a row either holds it whole or not at all.

    Under context parallelism (``cp_size > 1``) the row's images are split across the CP ranks by
    :func:`~megatron_s2.parallel.image_sharding.plan_image_owners` (sizes from the resize planning,
    no pixel read): this rank loads only its own and gets a
    :class:`~megatron_s2.parallel.image_sharding.RemoteImage` for each of the others."""
    from megatron_s2.parallel.image_sharding import RemoteImage, plan_image_owners

    placed, mask = [], np.zeros(seq_length + 1, dtype=bool)
    for document, start, length, cursor in segments:
        for span in store.images_of(document):
            if not (start <= span.offset and span.offset + span.length <= start + length):
                continue  # another chunk of this document holds the image
            at = cursor + span.offset - start
            if at + span.length > seq_length:  # build_image_text_documents rules this out
                raise RuntimeError(f"image span at {at}..{at + span.length - 1} runs past the {seq_length} inputs")
            mask[at:at + span.length] = True
            placed.append((span, at))
    owners = [cp_rank] * len(placed)
    if cp_size > 1:
        pairs = [store.pairs[span.pair] for span, _ in placed]
        owners = plan_image_owners([processor.work(p.width, p.height) for p in pairs], cp_size)
    inputs = [processor.prepare(store.load_image(span.pair), at) if owner == cp_rank
              else RemoteImage(at, span.length, owner) for (span, at), owner in zip(placed, owners)]
    return inputs, mask

