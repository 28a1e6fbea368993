import gzip
import os

ORIGINALS = os.path.join(os.path.dirname(__file__), "originals")


def test_logs_archived_and_removed():
    for name in sorted(os.listdir(ORIGINALS)):
        with open(os.path.join(ORIGINALS, name), "rb") as f:
            expected = f.read()
        with gzip.open(os.path.join("archive", name + ".gz"), "rb") as f:
            assert f.read() == expected
    assert not [n for n in os.listdir("logs") if n.endswith(".log")]


def test_other_files_kept():
    with open(os.path.join("logs", "notes.txt"), encoding="utf-8") as f:
        assert f.read() == "keep me\n"
