"""The .bin/.idx format, jsonl preprocessing (CLI included) and its error messages."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.data.errors import DataError
from megatron_s2.data.indexed_dataset import INDEX_MAGIC, IndexedDataset, IndexedDatasetWriter
from megatron_s2.data.jsonl import preprocess_jsonl
from megatron_s2.data.tokenizer import CharTokenizer

REPO = Path(__file__).resolve().parents[2]
RECORDS = [
    {"text": "The quick brown fox."},
    {"prompt": "12+30", "answer": "42"},
    {"text": "line one\nline two\t(tab) [x] {y} <z>", "source": "ignored"},
    {"prompt": "reverse:abc", "answer": "cba"},
]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


def _write_dataset(prefix: Path, documents, vocab_size=102) -> None:
    with IndexedDatasetWriter(prefix, vocab_size) as writer:
        for ids, prompt_length in documents:
            writer.add_document(np.asarray(ids), prompt_length)


@pytest.mark.parametrize("vocab_size, dtype", [(102, np.uint16), (70_000, np.int32)])
def test_writer_reader_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    documents = [(rng.integers(0, vocab_size, size=n), int(p)) for n, p in [(5, 2), (1, 0), (300, 17), (9, 0)]]
    _write_dataset(tmp_path / "d", documents, vocab_size)
    dataset = IndexedDataset(tmp_path / "d")
    assert dataset.dtype == dtype and dataset.vocab_size == vocab_size and len(dataset) == 4
    assert dataset.sizes.tolist() == [5, 1, 300, 9]
    assert dataset.prompt_lengths.tolist() == [2, 0, 17, 0]
    for i, (ids, _) in enumerate(documents):
        assert np.array_equal(dataset[i], ids) and dataset.tokens(i).dtype == np.int64
    assert np.array_equal(dataset.tokens(2, start=10, length=5), documents[2][0][10:15])
    assert (tmp_path / "d.bin").stat().st_size == 315 * np.dtype(dtype).itemsize
    assert (tmp_path / "d.idx").stat().st_size == 32 + 4 * 16
    assert not list(tmp_path.glob("*.tmp"))


def test_prompt_lengths_are_omitted_for_plain_text(tmp_path):
    _write_dataset(tmp_path / "t", [([1, 5, 2], 0), ([1, 2], 0)])
    assert (tmp_path / "t.idx").stat().st_size == 32 + 2 * 12
    assert IndexedDataset(tmp_path / "t").prompt_lengths.tolist() == [0, 0]


def test_writer_rejects_bad_documents_and_leaves_no_files(tmp_path):
    with pytest.raises(DataError, match=r"token ids must lie in 0..101"):
        _write_dataset(tmp_path / "bad", [([1, 2], 0), ([1, 102], 0)])
    with pytest.raises(DataError, match="no documents were written"):
        _write_dataset(tmp_path / "empty", [])
    assert list(tmp_path.iterdir()) == []


def test_preprocess_cli_round_trip(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", RECORDS)
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(source),
         "--output-prefix", str(tmp_path / "out" / "data")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "4 documents (2 prompt/answer)" in result.stdout
    tok = CharTokenizer()
    dataset = IndexedDataset(tmp_path / "out" / "data")
    rendered = [tok.decode(dataset[i], keep_special=True) for i in range(len(dataset))]
    assert rendered == [
        "<bos>The quick brown fox.<eos>",
        "<bos>12+30<sep>42<eos>",
        "<bos>line one\nline two\t(tab) [x] {y} <z><eos>",
        "<bos>reverse:abc<sep>cba<eos>",
    ]
    assert dataset.prompt_lengths.tolist() == [0, 7, 0, 13]


def test_module_entry_point_has_help():
    from megatron_s2.tools import preprocess_data

    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--help"])
    assert exit_info.value.code == 0


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad.jsonl:2: not valid JSON"),
    ('["a list"]', r"bad.jsonl:2: expected a JSON object"),
    ('{"prompt": "1+1"}', r"bad.jsonl:2: 'prompt' and 'answer' must both be strings"),
    ('{"txt": "typo"}', r"bad.jsonl:2: no string 'text' or 'prompt'/'answer' keys \(found \['txt'\]\)"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        preprocess_jsonl([source], tmp_path / "out", CharTokenizer())
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin.tmp").exists()


def test_cli_errors_exit_non_zero_with_one_line(tmp_path, capsys):
    from megatron_s2.tools import preprocess_data

    code = preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2  # a missing input is a user mistake (README: missing data exits 2)
    assert "--input" in err and "missing.jsonl: file not found" in err and "Traceback" not in err
    assert err.count("\n") == 1


@pytest.fixture()
def small_dataset(tmp_path) -> Path:
    _write_dataset(tmp_path / "d", [([1, 5, 6, 2], 0), ([1, 7, 3, 8, 2], 3)])
    return tmp_path / "d"


def _corrupt(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    (lambda p: Path(f"{p}.idx").unlink(), r"d\.idx: index file not found"),
    (lambda p: Path(f"{p}.bin").unlink(), r"d\.bin: token file not found"),
    (lambda p: _corrupt(Path(f"{p}.idx"), 0, b"MMIDIDX\x00"), r"d\.idx: not a megatron_s2 index \(magic"),
    (lambda p: _corrupt(Path(f"{p}.idx"), 8, struct.pack("<I", 7)), r"d\.idx: index format version 7"),
    (lambda p: _corrupt(Path(f"{p}.idx"), 12, b"\x09"), r"d\.idx: unknown dtype code 9"),
    (lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes()[:-3]), r"d\.idx: .* truncated or corrupt"),
    (lambda p: Path(f"{p}.idx").write_bytes(INDEX_MAGIC), r"d\.idx: truncated index"),
    (lambda p: _corrupt(Path(f"{p}.idx"), 40, struct.pack("<q", 6)), r"d\.idx: document pointers disagree"),
    (lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes()[:-2]), r"d\.bin: 16 bytes but d\.idx"),
])
def test_missing_or_corrupt_files_name_the_file_and_the_fix(small_dataset, damage, message):
    IndexedDataset(small_dataset)  # intact
    damage(small_dataset)
    with pytest.raises(DataError, match=message) as error:
        IndexedDataset(small_dataset)
    assert "preprocess_data.py" in str(error.value)
