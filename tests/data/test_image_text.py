"""Image-text data (``megatron_s2/data/image_text.py``) and its micro-batches (issue 22).

The four sources (procedural, folder, parquet, webdataset) are built from real files made with
Pillow / pyarrow / tarfile; every bad input is refused in one line naming the file; the loader's
micro-batches carry image inputs whose spans match the token layout of ``prepare_vl_inputs``,
an ``image_mask`` of exactly the span positions, no loss on image tokens, spans never split by
packing, and a resumable state."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_s2.config.data import DataConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError
from megatron_s2.data.image_text import build_image_text_documents, load_image_text_pairs, split_seed
from megatron_s2.data.loader import build_data_iterator
from megatron_s2.data.procedural_images import procedural_item
from megatron_s2.data.tokenizer import build_tokenizer
from megatron_s2.models.family import family_of
from tests.vision.conftest import vision_config

CFG = vision_config(image_token_id=120)  # above the character tokenizer's 102 ids
PROCESSOR = family_of(CFG).image_processor(CFG)
TOKENIZER = build_tokenizer(DataConfig())


def png(colour=(200, 30, 30), size=(40, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def iterator(data: DataConfig, seq_length=64, gbs=4, mbs=2, dp_rank=0, dp_size=1, phase="pretrain"):
    return build_data_iterator(data, seq_length=seq_length, global_batch_size=gbs, micro_batch_size=mbs,
                               dp_rank=dp_rank, dp_size=dp_size, seed=3, phase=phase, tokenizer=TOKENIZER,
                               image_processor=PROCESSOR)


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


# ---- sources -------------------------------------------------------------------------------
def test_procedural_pairs_captions_and_questions_with_a_disjoint_heldout_split():
    train = load_image_text_pairs(DataConfig(kind="image_text", num_documents=6, image_size=48), seed=5)
    assert [p.prompt is None for p in train] == [True, False] * 6  # caption then Q/A per item
    assert train[0].text.split()[-1] in train[0].source or train[0].text  # caption of item 0
    assert all(p.width == p.height == 48 for p in train)
    assert train[1].prompt.endswith("?") and train[1].text
    held = load_image_text_pairs(DataConfig(kind="image_text", num_documents=6, image_size=48, split="heldout"), seed=5)
    assert split_seed(5, "heldout") != 5 and f"seed {split_seed(5, 'heldout')} " in held[0].source
    train_pixels = {np.asarray(p.load()).tobytes() for p in train}
    assert not train_pixels & {np.asarray(p.load()).tobytes() for p in held}
    qa = load_image_text_pairs(DataConfig(kind="image_text", num_documents=3, image_text_format="qa"), seed=5)
    assert all(p.prompt for p in qa) and len(qa) == 3


def test_procedural_questions_identity_asks_every_item_what_it_shows():
    """'all' rotates a shape item between its shape and colour questions; 'identity' always asks
    the shape / digit / word, and the held-out split keeps the choice."""
    data = DataConfig(kind="image_text", num_documents=12, image_size=48, image_text_format="qa",
                      procedural_kinds=("shape", "digit"))
    rotating = {p.prompt for p in load_image_text_pairs(data, seed=5)}
    assert {"what colour is the shape?", "what colour is the digit?"} & rotating
    for split in ("train", "heldout"):
        cfg = DataConfig(kind="image_text", num_documents=12, image_size=48, image_text_format="qa",
                         procedural_kinds=("shape", "digit"), procedural_questions="identity", split=split)
        asked = load_image_text_pairs(cfg, seed=5)
        assert {p.prompt for p in asked} == {"what shape is this?", "what digit is this?"}
        assert all(p.text.isdigit() == (p.prompt == "what digit is this?") for p in asked)
    with pytest.raises(ConfigError, match="^procedural_questions: applies to source 'procedural' only"):
        DataConfig(kind="image_text", source="folder", paths=("x",), procedural_questions="identity")
    with pytest.raises(ConfigError, match="procedural_text_stroke: must be >= 0"):
        DataConfig(kind="image_text", procedural_text_stroke=-2)
    bold = DataConfig(kind="image_text", num_documents=4, image_size=48, procedural_kinds=("digit",),
                      procedural_text_stroke=2)
    plain_pixels = [np.asarray(p.load()) for p in load_image_text_pairs(dataclasses.replace(
        bold, procedural_text_stroke=0), seed=5)]
    bold_pairs = load_image_text_pairs(bold, seed=5)
    assert all((np.asarray(p.load()) != q).any() for p, q in zip(bold_pairs, plain_pixels))


def test_procedural_drawing_keys_refused_where_they_cannot_apply():
    """The two drawing keys name themselves when they would be ignored or could not draw: a stroke
    too bold for the image (the largest accepted one draws every word and digit), a stroke on
    shapes only, identity questions on captions, either key on a caption source or another kind."""
    for size, widest in ((32, 8), (48, 16)):
        with pytest.raises(ConfigError, match=f"^procedural_text_stroke: {widest + 1} pixels is too bold .* at most {widest}"):
            DataConfig(kind="image_text", image_size=size, procedural_text_stroke=widest + 1)
        cfg = DataConfig(kind="image_text", num_documents=24, image_size=size, procedural_kinds=("digit", "text"),
                         image_text_format="qa", procedural_text_stroke=widest)
        assert all(p.load().size == (size, size) for p in load_image_text_pairs(cfg, seed=3))
    with pytest.raises(ConfigError, match="^procedural_text_stroke: 30 pixels is too bold for 32-pixel images"):
        procedural_item(0, size=32, kinds=("text",), text_stroke=30)  # the drawing's own guard
    with pytest.raises(ConfigError, match="^procedural_text_stroke: thickens digits and words only"):
        DataConfig(kind="image_text", procedural_kinds=("shape",), procedural_text_stroke=1)
    with pytest.raises(ConfigError, match="^procedural_questions: .* 'caption' asks none"):
        DataConfig(kind="image_text", image_text_format="caption", procedural_questions="identity")
    with pytest.raises(ConfigError, match="^procedural_text_stroke: applies to source 'procedural' only"):
        DataConfig(kind="image_text", source="parquet", paths=("x.parquet",), procedural_text_stroke=2)
    for kind, extra in (("synthetic", {}), ("timeseries", {}), ("procedural_text", {})):
        for key, value in (("procedural_questions", "identity"), ("procedural_text_stroke", 2)):
            with pytest.raises(ConfigError, match=f"^{key}: applies to kind 'image_text'"):
                DataConfig(kind=kind, **{key: value}, **extra)


def test_folder_with_txt_captions_and_with_a_captions_jsonl(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x.png").write_bytes(png())
    (a / "x.txt").write_text("a red box\n")
    (b / "y.png").write_bytes(png((0, 0, 200), (20, 30)))
    (b / "captions.jsonl").write_text(json.dumps({"image": "y.png", "text": "blue"}) + "\n")
    pairs = load_image_text_pairs(DataConfig(kind="image_text", source="folder", paths=(str(a), str(b))), seed=0)
    assert [(p.text, p.width, p.height) for p in pairs] == [("a red box", 40, 24), ("blue", 20, 30)]
    assert pairs[1].load().getpixel((0, 0)) == (0, 0, 200)


def test_parquet_shards_with_bytes_and_hf_image_structs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"image": [png(), png((1, 2, 3))], "text": ["one", "two"]}), path)
    pairs = load_image_text_pairs(DataConfig(kind="image_text", source="parquet", paths=(str(path),)), seed=0)
    assert [p.text for p in pairs] == ["one", "two"] and pairs[1].load().getpixel((0, 0)) == (1, 2, 3)
    hf = tmp_path / "hf.parquet"
    pq.write_table(pa.table({"img": [{"bytes": png(), "path": "x.png"}], "caption": ["c"]}), hf)
    data = DataConfig(kind="image_text", source="parquet", paths=(str(hf),), image_column="img", text_column="caption")
    assert [p.text for p in load_image_text_pairs(data, seed=0)] == ["c"]
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(DataConfig(kind="image_text", source="parquet", paths=(str(hf),)), seed=0)
    assert "data.image_column" in one_line(caught)


def write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_webdataset_shards(tmp_path):
    shard = tmp_path / "000.tar"
    write_tar(shard, {"k1.png": png(), "k1.txt": b"first", "k1.json": b"{}", "k2.jpg": png(), "k2.txt": b"second"})
    pairs = load_image_text_pairs(DataConfig(kind="image_text", source="webdataset", paths=(str(shard),)), seed=0)
    assert [(p.source.split(":")[-1], p.text) for p in pairs] == [("k1", "first"), ("k2", "second")]


@pytest.mark.parametrize("case, words", [
    ("corrupt", "x.png: truncated or corrupt PNG"),
    ("format", "x.png: unsupported image format PDF"),
    ("cap", "x.png: decompression bomb refused: 40x24 = 960 pixels exceeds the cap of 100; replace or remove"),
    ("caption", "x.png: no caption x.txt; add it"),
    ("empty", "no images (.png"),
    ("blank", "x.png: empty caption"),
])
def test_bad_folder_inputs_are_one_line_errors_naming_the_file(tmp_path, case, words):
    image, caption, limit = png(), "ok", 32 * 1024 * 1024
    if case == "corrupt":
        image = image[:40]
    elif case == "format":
        image = b"%PDF-1.4 nothing to see"
    elif case == "cap":
        limit = 100
    elif case == "blank":
        caption = "  \n"
    if case != "empty":
        (tmp_path / "x.png").write_bytes(image)
        if case != "caption":
            (tmp_path / "x.txt").write_text(caption)
    data = DataConfig(kind="image_text", source="folder", paths=(str(tmp_path),), image_max_pixels=limit)
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(data, seed=0)
    assert words in one_line(caught)


@pytest.mark.parametrize("members, words", [
    ({"k.png": b"\x89PNG\r\n\x1a\nbroken"}, "000.tar:k: truncated or corrupt PNG"),
    ({"k.png": png()}, "000.tar:k: an image without a caption"),
    ({"k.txt": b"orphan"}, "000.tar:k: a caption without an image"),
    ({"k.json": b"{}"}, "no key.<image> + key.txt samples"),
])
def test_bad_webdataset_shards_are_one_line_errors(tmp_path, members, words):
    shard = tmp_path / "000.tar"
    write_tar(shard, {**members, **({"k.txt": b"c"} if "broken" in str(members) else {})})
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(DataConfig(kind="image_text", source="webdataset", paths=(str(shard),)), seed=0)
    assert words in one_line(caught)


def test_not_a_tar_and_config_errors(tmp_path):
    bad = tmp_path / "x.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(DataError, match="not a readable tar shard"):
        load_image_text_pairs(DataConfig(kind="image_text", source="webdataset", paths=(str(bad),)), seed=0)
    with pytest.raises(ConfigError, match="paths: source 'folder' needs one or more image directories"):
        DataConfig(kind="image_text", source="folder")
    with pytest.raises(ConfigError, match="paths: 'a.json' is not a .parquet file"):
        DataConfig(kind="image_text", source="parquet", paths=("a.json",))
    with pytest.raises(ConfigError, match="paths: source 'procedural' reads no files"):
        DataConfig(kind="image_text", paths=("x",))
    with pytest.raises(ConfigError, match="procedural_kinds"):
        DataConfig(kind="image_text", procedural_kinds=("cats",))


# ---- documents and micro-batches -----------------------------------------------------------
def test_document_layout_matches_prepare_vl_inputs():
    """bos, the span of prepare_vl_inputs' layout, then the text; answer targets only in SFT."""
    from megatron_s2.models.v41.vision.processor import prepare_vl_inputs

    data = DataConfig(kind="image_text", num_documents=1, image_size=48, image_text_format="qa")
    store = build_image_text_documents(data, seed=1, tokenizer=TOKENIZER, processor=PROCESSOR, seq_length=64)
    pair = store.pairs[0]
    text = [TOKENIZER.bos_id, CFG.image_token_id, *TOKENIZER.encode(pair.prompt), TOKENIZER.sep_id,
            *TOKENIZER.encode(pair.text), TOKENIZER.eos_id]
    expected, _, inputs = prepare_vl_inputs(text, [pair.load()], CFG)
    assert store.tokens(0).tolist() == expected
    span = store.images_of(0)[0]
    assert (span.offset, span.length) == (inputs[0].start, inputs[0].types.numel())
    targets = store.targets(0)
    assert not targets[:len(expected) - len(pair.text) - 1].any() and targets[-len(pair.text) - 1:].all()


def test_micro_batches_carry_images_mask_and_no_loss_on_image_tokens():
    it = iterator(DataConfig(kind="image_text", num_documents=40, image_size=48))
    for mb in it.next_step():
        assert set(mb) == {"tokens", "labels", "loss_mask", "doc_ids", "position_ids", "image_mask", "images"}
        assert mb["image_mask"].dtype == torch.bool and mb["image_mask"].shape == mb["tokens"].shape
        # the mask is exactly the image-token positions, and every image's span is in it
        assert torch.equal(mb["image_mask"], mb["tokens"] == CFG.image_token_id)
        for row, images in enumerate(mb["images"]):
            assert images, "every row of this source holds an image"
            covered = torch.zeros_like(mb["image_mask"][row])
            for image in images:
                covered[image.start:image.start + image.types.numel()] = True
                assert image.patches.shape == (image.n_vit_h * image.n_vit_w, 3, 4, 4)
            assert torch.equal(covered, mb["image_mask"][row])
        assert not (mb["loss_mask"].bool() & (mb["labels"] == CFG.image_token_id)).any()
        assert mb["loss_mask"].sum() > 0


def test_a_span_never_splits_and_long_documents_chunk_only_text():
    """seq_length 32: documents of ~50 tokens are chunked; each image lies whole in one row."""
    it = iterator(DataConfig(kind="image_text", num_documents=30, image_size=48), seq_length=32, gbs=8, mbs=4)
    spans = 0
    for _ in range(3):
        for mb in it.next_step():
            for row, images in enumerate(mb["images"]):
                assert sum(i.types.numel() for i in images) == int(mb["image_mask"][row].sum())
                spans += len(images)
    assert spans > 0


def test_a_span_longer_than_the_sequence_is_refused():
    with pytest.raises(DataError) as caught:
        iterator(DataConfig(kind="image_text", num_documents=2, image_size=48), seq_length=16)
    assert "raise training.seq_length to at least 24" in one_line(caught)


def test_an_image_token_id_the_tokenizer_produces_is_refused():
    cfg = vision_config(image_token_id=TOKENIZER.encode("a")[0])
    with pytest.raises(DataError) as caught:
        build_image_text_documents(DataConfig(kind="image_text", num_documents=1, image_size=48), seed=0,
                                   tokenizer=TOKENIZER, processor=family_of(cfg).image_processor(cfg), seq_length=64)
    assert "set model.image_token_id to an id the tokenizer never produces" in one_line(caught)


def test_image_text_without_a_vision_tower_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a model with a vision tower"):
        build_data_iterator(DataConfig(kind="image_text", num_documents=2), seq_length=64, global_batch_size=2,
                            micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, phase="pretrain", tokenizer=TOKENIZER)


def test_resume_and_data_parallel_slices_match_the_single_rank_stream():
    data = DataConfig(kind="image_text", num_documents=40, image_size=48)
    whole = iterator(data, gbs=4, mbs=2)
    whole.next_step()
    state = whole.state_dict()
    expected = whole.next_step()
    resumed = iterator(data, gbs=4, mbs=2)
    resumed.load_state_dict(state)
    got = resumed.next_step()
    ranks = []
    for r in range(2):
        it = iterator(data, gbs=4, mbs=2, dp_rank=r, dp_size=2)
        it.load_state_dict(state)
        ranks += it.next_step()
    for a, b, c in zip(expected, got, ranks):
        for key in ("tokens", "loss_mask", "image_mask"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])
        assert all(torch.equal(x.patches, y.patches) and x.start == y.start
                   for xs, ys in zip(a["images"], c["images"]) for x, y in zip(xs, ys))


def test_sft_trains_only_answers():
    it = iterator(DataConfig(kind="image_text", num_documents=20, image_size=48, image_text_format="qa"), phase="sft")
    mb = it.next_step()[0]
    row = mb["tokens"][0]
    sep = int((row == TOKENIZER.sep_id).nonzero()[0])
    eos = int((row == TOKENIZER.eos_id).nonzero()[0])
    assert mb["loss_mask"][0, sep:eos].all() and not mb["loss_mask"][0, :sep].any()


# ---- balanced image sharding across context-parallel ranks (report §3.1.1) ---------------------
class CountingDocuments:
    """An image-text store that counts its image loads (the real loads run)."""

    def __init__(self, store):
        self.store, self.loads = store, []

    def __getattr__(self, name):
        return getattr(self.store, name)

    def __len__(self):
        return len(self.store)

    def load_image(self, pair: int):
        self.loads.append(pair)
        return self.store.load_image(pair)


@pytest.mark.parametrize("cp", [2, 3])
def test_each_image_is_loaded_exactly_once_across_the_cp_group(cp):
    """Every CP rank sees the same rows; each image of a row is loaded (and prepared) by exactly one
    rank, the planned owner, and every other rank holds a RemoteImage naming that owner."""
    from megatron_s2.data.loader import DataIterator
    from megatron_s2.parallel.image_sharding import RemoteImage

    data = DataConfig(kind="image_text", num_documents=40, image_size=48)
    store = build_image_text_documents(data, seed=3, tokenizer=TOKENIZER, processor=PROCESSOR, seq_length=192)

    def ranks_iterator(rank):
        counted = CountingDocuments(store)
        it = DataIterator([counted], seq_length=192, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1,
                          seed=3, answer_only=False, pad_id=TOKENIZER.pad_id, image_processor=PROCESSOR,
                          cp_rank=rank, cp_size=cp)
        return counted, it

    ranks = [ranks_iterator(r) for r in range(cp)]
    images = 0
    for _ in range(2):
        steps = [it.next_step() for _, it in ranks]
        for mbs in zip(*steps):
            for row in range(len(mbs[0]["images"])):
                per_rank = [mb["images"][row] for mb in mbs]
                assert len({len(entries) for entries in per_rank}) == 1
                for slots in zip(*per_rank):
                    loaded = [r for r, entry in enumerate(slots) if not isinstance(entry, RemoteImage)]
                    assert len(loaded) == 1, slots
                    assert all(entry.owner == loaded[0] for entry in slots if isinstance(entry, RemoteImage))
                    assert {entry.start for entry in slots} == {slots[loaded[0]].start}
                    images += 1
    assert images > 2 * cp and sum(len(counted.loads) for counted, _ in ranks) == images
    assert all(counted.loads for counted, _ in ranks)  # the work is shared


@pytest.mark.parametrize("manifest", [False, True])
def test_a_caption_that_is_not_utf8_is_a_one_line_error_naming_the_file(tmp_path, manifest):
    (tmp_path / "x.png").write_bytes(png())
    if manifest:
        (tmp_path / "captions.jsonl").write_bytes(b'{"image": "x.png", "text": "\xff\xfe"}\n')
        named = "captions.jsonl"
    else:
        (tmp_path / "x.txt").write_bytes(b"\xff\xfe latin-1 caption")
        named = "x.txt"
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(DataConfig(kind="image_text", source="folder", paths=(str(tmp_path),)), seed=0)
    assert f"{named}: not UTF-8 text" in one_line(caught)


def test_a_directory_named_like_an_image_is_a_one_line_error_naming_it(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.png").mkdir()
    (tmp_path / "b.txt").write_text("a folder, not an image")
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(DataConfig(kind="image_text", source="folder", paths=(str(tmp_path),)), seed=0)
    assert "b.png: cannot read it (Is a directory)" in one_line(caught)


@pytest.mark.parametrize("cut", [2 / 3, None])
def test_a_truncated_or_corrupt_compressed_shard_is_a_one_line_error(tmp_path, cut):
    shard = tmp_path / "000.tar"
    with tarfile.open(shard, "w:gz") as archive:  # tarfile reads a gzipped shard whatever its name
        for name, data in {"k.png": png(), "k.txt": b"caption"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    data = shard.read_bytes()
    # cut: the stream ends early (EOFError); None: a flipped byte inside the deflate stream (zlib.error)
    shard.write_bytes(data[:int(len(data) * cut)] if cut else data[:40] + bytes([data[40] ^ 0xFF]) + data[41:])
    with pytest.raises(DataError) as caught:
        load_image_text_pairs(DataConfig(kind="image_text", source="webdataset", paths=(str(shard),)), seed=0)
    assert "000.tar: not a readable tar shard" in one_line(caught)
