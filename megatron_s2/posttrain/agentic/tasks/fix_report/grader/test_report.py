import json
import subprocess
import sys


def test_totals_on_grader_data():
    subprocess.run([sys.executable, "-I", "report.py"], check=True, timeout=10)
    with open("summary.json", encoding="utf-8") as f:
        assert json.load(f) == {"east": 4.0, "west": 3.0}
