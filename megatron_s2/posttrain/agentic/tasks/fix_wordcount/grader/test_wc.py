import subprocess
import sys


def _wc(tmp_text):
    with open("grader_input.txt", "w", encoding="utf-8") as f:
        f.write(tmp_text)
    out = subprocess.run([sys.executable, "-I", "wc.py", "grader_input.txt"], capture_output=True, text=True, timeout=10)
    return out.stdout.split()


def test_single_spaces():
    assert _wc("one two three\n") == ["1", "3", "14"]


def test_mixed_whitespace():
    assert _wc("a  b\t\tc\n\n  d e  \n") == ["3", "5", "17"]


def test_empty_file():
    assert _wc("") == ["0", "0", "0"]
