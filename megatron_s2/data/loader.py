"""The trainer's data iterator: packed rows -> per-rank micro-batches, resumable.

The trainer builds one iterator per data-parallel rank::

    it = build_data_iterator(cfg.data, seq_length=..., global_batch_size=..., micro_batch_size=...,
                             dp_rank=..., dp_size=..., seed=cfg.seed, phase="pretrain", tokenizer=tok)
    for step in range(steps):
        for micro_batch in it.next_step():   # global_batch_size / dp_size / micro_batch_size of them
            loss = model(micro_batch["tokens"], ...)

Optimiser step *k* consumes global samples ``[k * G, (k + 1) * G)`` of the stream defined in
:mod:`megatron_s2.data.sample_order`; rank *r* takes the contiguous slice
``[r * G / dp, (r + 1) * G / dp)`` of them and cuts it into micro-batches. Every micro-batch
dict holds, for ``b = micro_batch_size`` rows of ``s = seq_length`` positions:

==============  ======  ========  =============================================================
key             shape   dtype     meaning
==============  ======  ========  =============================================================
tokens          [b, s]  int64     input ids (row[:-1])
labels          [b, s]  int64     next-token targets (row[1:])
loss_mask       [b, s]  float32   1 where the label is a target of the same segment (SFT: answer;
                                  a chat message's ``weight`` when it is not 0 or 1)
doc_ids         [b, s]  int64     segment id per position; attend only within equal ids
position_ids    [b, s]  int64     0..s-1 within the packed row
image_mask      [b, s]  bool      image data only: True at image-span positions (the router's
                                  image correction bias, §2.1.1; Engram skips them)
series          b lists           time-series data only (``data.kind: timeseries``): per row, the
                                  ``SeriesPlacement`` list for ``model.embed(tokens, series=...)``;
                                  ``series_targets`` the known futures, ``series_mask`` [b, s] bool
images          b lists           image data only: per row, the model family's image inputs
                                  (``ImageProcessor.prepare``, span start = row position), for
                                  ``model.embed(tokens, images=...)``; under context parallelism
                                  a ``RemoteImage`` for each image another CP rank loads
==============  ======  ========  =============================================================

Image-span positions are never targets: a label that is an image token has loss_mask 0.

The only iterator state is the number of consumed global samples, so
:meth:`DataIterator.state_dict` / :meth:`DataIterator.load_state_dict` resume exactly, even
with a different data-parallel size; the state also records what the stream was built from
and refuses to resume onto different data.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np
import torch

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.documents import DocumentStore
from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import IndexedDataset
from megatron_s2.data.packing import PackedRows, best_fit_pack
from megatron_s2.data.sample_order import BlendedSampleOrder
from megatron_s2.data.synthetic import build_synthetic_documents
from megatron_s2.data.tokenizer import Tokenizer

__all__ = ["DataIterator", "build_data_iterator", "batch_fingerprint", "load_document_stores"]

_STATE_VERSION = 1


class DataIterator:
    """Yields this data-parallel rank's micro-batches, one optimiser step at a time."""

    def __init__(self, stores: Sequence[DocumentStore], *, seq_length: int, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, answer_only: bool,
                 pad_id: int, weights: Sequence[float] | None = None, image_processor=None,
                 cp_rank: int = 0, cp_size: int = 1) -> None:
        _check_layout(seq_length, global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.answer_only = answer_only
        self.pad_id = pad_id
        self.stores = list(stores)
        self.image_processor = image_processor
        """The model family's ImageProcessor when a store holds images (``data.kind: image_text``)."""
        self.cp_rank, self.cp_size = cp_rank, cp_size
        """This rank's place in its context-parallel group: each CP rank loads only its share of a
        row's images (balanced image sharding, :mod:`megatron_s2.parallel.image_sharding`)."""
        self.packed: list[PackedRows] = [best_fit_pack(store.sizes, seq_length + 1) for store in self.stores]
        self.order = BlendedSampleOrder([len(p) for p in self.packed], weights, seed)
        self.consumed_samples = 0
        self._identity = {
            "seed": seed,
            "seq_length": seq_length,
            "answer_only": answer_only,
            "documents": [len(store) for store in self.stores],
            "tokens": [int(store.sizes.sum()) for store in self.stores],
            "sizes_sha256": [hashlib.sha256(store.sizes.astype("<i8").tobytes()).hexdigest() for store in self.stores],
            "rows": [len(p) for p in self.packed],
            "blend_counts": self.order.counts.tolist(),
        }

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per optimiser step on this rank."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    @property
    def num_sequences(self) -> int:
        """Packed rows per blend epoch (one pass over a single dataset)."""
        return self.order.epoch_length

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next optimiser step."""
        per_rank = self.global_batch_size // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        datasets, rows = self.order.lookup(np.arange(first, first + per_rank, dtype=np.int64))
        self.consumed_samples += self.global_batch_size
        batches = []
        for start in range(0, per_rank, self.micro_batch_size):
            picks = zip(datasets[start:start + self.micro_batch_size].tolist(),
                        rows[start:start + self.micro_batch_size].tolist())
            batches.append(self._collate([self._example(d, r) for d, r in picks]))
        return batches

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        return self.next_step()

    def _example(self, dataset: int, row: int) -> dict[str, np.ndarray]:
        packed = self.packed[dataset].materialize(row, self.stores[dataset], answer_only=self.answer_only,
                                                  pad_id=self.pad_id)
        same_segment = packed.segment_ids[1:] == packed.segment_ids[:-1]
        is_target = packed.is_target
        extra = {}
        if hasattr(self.stores[dataset], "images_of"):  # image-text documents (data.image_text)
            images, mask = self._images(dataset, row)
            is_target = np.where(mask, 0.0, is_target)  # nothing predicts an image token
            extra = {"image_mask": mask[:-1], "images": images}
        elif hasattr(self.stores[dataset], "series_of"):  # series + text documents (data.timeseries_text)
            placements, targets, mask = self._series(dataset, row)
            is_target = np.where(mask, 0.0, is_target)  # nothing predicts a series token
            extra = {"series_mask": mask[:-1], "series": placements, "series_targets": targets}
        return {
            "tokens": packed.tokens[:-1],
            "labels": packed.tokens[1:],
            "loss_mask": (is_target[1:] * same_segment).astype(np.float32),  # chat weights kept (data.chat)
            "doc_ids": packed.segment_ids[:-1],
            "position_ids": np.arange(self.seq_length, dtype=np.int64),
            **extra,
        }

    def _segments(self, dataset: int, row: int) -> list[tuple[int, int, int, int]]:
        """(document, start inside it, length, row position) of each segment of a packed row."""
        packed = self.packed[dataset]
        segments, cursor = [], 0
        for index in range(packed.row_offsets[row], packed.row_offsets[row + 1]):
            length = int(packed.segment_length[index])
            segments.append((int(packed.segment_document[index]), int(packed.segment_start[index]), length, cursor))
            cursor += length
        return segments

    def _series(self, dataset: int, row: int) -> tuple[list, list, np.ndarray]:
        from megatron_s2.data.timeseries_text import series_inputs_of_row

        return series_inputs_of_row(self.stores[dataset], self._segments(dataset, row), self.seq_length)

    def _images(self, dataset: int, row: int) -> tuple[list, np.ndarray]:
        from megatron_s2.data.image_text import image_inputs_of_row

        segments = self._segments(dataset, row)
        return image_inputs_of_row(self.stores[dataset], segments, self.image_processor, self.seq_length,
                                   self.cp_rank, self.cp_size)

    @staticmethod
    def _collate(examples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        listed = ("images", "series", "series_targets")  # per-row Python objects, not stacked
        return {key: ([e[key] for e in examples] if key in listed else torch.from_numpy(np.stack([e[key] for e in examples])))
                for key in examples[0]}

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Resume state: consumed global samples plus what the sample stream was built from."""
        return {"version": _STATE_VERSION, "consumed_samples": self.consumed_samples, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly of another dp layout)."""
        if state.get("version") != _STATE_VERSION:
            raise DataError(f"data iterator state: version {state.get('version')!r}, expected {_STATE_VERSION}")
        mismatched = [f"{key} (saved {state.get(key)!r}, now {value!r})"
                      for key, value in self._identity.items() if state.get(key) != value]
        if mismatched:
            raise DataError("data iterator state was saved for a different data stream: " + "; ".join(mismatched)
                            + ". Resume with the same data config, seed and seq_length, or start the data anew.")
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"data iterator state: consumed_samples must be a non-negative integer, got {consumed!r}")
        self.consumed_samples = consumed


def _check_layout(seq_length: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if seq_length < 1:
        raise ConfigError(f"seq_length: must be >= 1, got {seq_length}")
    if micro_batch_size < 1 or global_batch_size < 1 or dp_size < 1:
        raise ConfigError(f"global_batch_size ({global_batch_size}), micro_batch_size ({micro_batch_size}) and "
                          f"dp_size ({dp_size}) must all be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank: must be in 0..{dp_size - 1}, got {dp_rank}")
    if global_batch_size % (dp_size * micro_batch_size):
        raise ConfigError(f"global_batch_size: {global_batch_size} is not divisible by dp_size x micro_batch_size = "
                          f"{dp_size} x {micro_batch_size} = {dp_size * micro_batch_size}; pick a multiple of "
                          f"{dp_size * micro_batch_size} or change micro_batch_size")


def load_document_stores(cfg: DataConfig, *, seed: int, tokenizer: Tokenizer, log=print, image_processor=None,
                         seq_length: int | None = None, model=None) -> list[DocumentStore]:
    """The document stores named by a data config (generated or read from disk); kind
    'image_text' needs the model family's ``image_processor`` and the run's ``seq_length``;
    kind 'timeseries' the ``model`` section (its ``timeseries`` sizes the series spans)."""
    if cfg.kind == "timeseries":
        from megatron_s2.data.timeseries_text import SeriesPlanner, build_series_documents

        if model is None or getattr(model, "timeseries", None) is None:
            raise ConfigError("data.kind: 'timeseries' needs a model with a time-series encoder; set model.timeseries")
        return [build_series_documents(cfg, seed=seed, tokenizer=tokenizer, planner=SeriesPlanner.from_model(model),
                                       seq_length=seq_length)]
    if cfg.kind == "image_text":
        if image_processor is None:
            raise ConfigError("data.kind: 'image_text' needs a model with a vision tower (model.vision_n_layers > 0)")
        from megatron_s2.data.image_text import build_image_text_documents

        return [build_image_text_documents(cfg, seed=seed, tokenizer=tokenizer, processor=image_processor,
                                           seq_length=seq_length)]
    if cfg.kind == "synthetic":
        return [build_synthetic_documents(cfg, seed, tokenizer)]
    if cfg.kind == "procedural_text":
        from megatron_s2.data.procedural_text import build_procedural_text_documents

        return [build_procedural_text_documents(cfg.corpus, cfg.num_documents, cfg.generation_seed(seed), tokenizer,
                                                cfg.language_seed)]
    if cfg.kind == "chat":
        from megatron_s2.data.chat import load_chat_documents

        return load_chat_documents(cfg.paths, tokenizer, loss_roles=cfg.loss_roles, messages_key=cfg.messages_key,
                                   on_bad_record=cfg.on_bad_record, log=log)
    stores = []
    for prefix in cfg.paths:
        dataset = IndexedDataset(prefix)
        if dataset.vocab_size != tokenizer.vocab_size:
            raise DataError(f"{prefix}.idx: written with a {dataset.vocab_size}-token vocabulary but the "
                            f"'{cfg.tokenizer}' tokenizer has {tokenizer.vocab_size}; re-run tools/preprocess_data.py "
                            "with the same --tokenizer")
        stores.append(dataset)
    return stores


def build_data_iterator(cfg: DataConfig, *, seq_length: int, global_batch_size: int, micro_batch_size: int,
                        dp_rank: int, dp_size: int, seed: int, phase: str, tokenizer: Tokenizer,
                        log=print, image_processor=None, cp_rank: int = 0, cp_size: int = 1,
                        model=None) -> DataIterator:
    """The data iterator of one data-parallel rank (see module docstring); ``image_processor``:
    the model family's (``family_of(model).image_processor(model)``), needed by kind 'image_text';
    ``cp_rank`` / ``cp_size``: this rank's context-parallel place (which images it loads)."""
    _check_layout(seq_length, global_batch_size, micro_batch_size, dp_rank, dp_size)
    return DataIterator(
        load_document_stores(cfg, seed=seed, tokenizer=tokenizer, log=log, image_processor=image_processor,
                             seq_length=seq_length, model=model),
        seq_length=seq_length, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
        dp_rank=dp_rank, dp_size=dp_size, seed=seed, answer_only=cfg.loss_mode(phase) == "answer",
        pad_id=tokenizer.pad_id, weights=cfg.weights or None, image_processor=image_processor,
        cp_rank=cp_rank, cp_size=cp_size,
    )


def batch_fingerprint(micro_batches: Sequence[dict[str, torch.Tensor]]) -> str:
    """sha256 over the token ids (and shapes) of micro-batches, in order."""
    digest = hashlib.sha256()
    for batch in micro_batches:
        tokens = batch["tokens"].detach().to(device="cpu", dtype=torch.int64).contiguous()
        digest.update(str(tuple(tokens.shape)).encode())
        digest.update(tokens.numpy().astype("<i8", copy=False).tobytes())
    return digest.hexdigest()
