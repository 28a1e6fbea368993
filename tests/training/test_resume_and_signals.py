"""`megatron-s2 train` under Ctrl-C, a refused resume, and extending a finished run.

Reproduced breaks:
* Ctrl-C printed a KeyboardInterrupt traceback and lost every step since the last save;
* a resume refused for a changed model (checkpoint shapes differ) exited 1 with a traceback
  after overwriting the run's config.yaml with the refused recipe;
* a finished run could only be extended by deleting FINISHED by hand, and nothing said so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_s2.checkpoint import CheckpointStore
from megatron_s2.cli import main

pytestmark = pytest.mark.usefixtures("one_thread_children")  # the CLI runs it starts (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32",
          "training.global_batch_size=4", "training.micro_batch_size=2", "data.num_documents=200",
          "logging.progress_bar=false", "logging.tensorboard=false", "logging.log_interval=1"]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_like_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SINGLE,
                             "training.train_steps=100000", "checkpoint.save_interval=0", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert proc.returncode == 75, out
    assert "interrupted: finishing this step, saving a checkpoint" in out
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    store = CheckpointStore(run_dir / "checkpoints")
    assert store.latest_valid().name == f"step_{steps[-1]:08d}", "the interrupted step was saved"
    assert json.loads((run_dir / "PREEMPTED").read_text())["step"] == steps[-1]


@pytest.mark.slow
def test_refused_resume_leaves_the_run_dir_unchanged_and_extension_is_explained(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(RECIPE), *SINGLE, "training.train_steps=2", "--run-dir", str(run_dir)]) == 0
    assert json.loads((run_dir / "FINISHED").read_text())["step"] == 2
    before = _snapshot(run_dir)
    capsys.readouterr()

    # a changed expert size no longer matches the checkpoint: refused, one line, nothing written
    code = main(["train", str(RECIPE), *SINGLE, "training.train_steps=3", "model.moe_ffn_hidden_size=48",
                 "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "checkpoint: cannot resume from" in err and "step_00000002" in err and "global shape" in err
    assert _snapshot(run_dir) == before, "a refused resume changed the run directory"

    # the finished run says how to extend it ...
    assert main(["train", str(RECIPE), *SINGLE, "training.train_steps=2", "--run-dir", str(run_dir)]) == 0
    assert "raise training.train_steps above 2 (e.g. the override training.train_steps=4)" in capsys.readouterr().out
    # ... and extending it needs nothing deleted by hand
    assert main(["train", str(RECIPE), *SINGLE, "training.train_steps=3", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "extending the finished run: step 2 -> 3" in out
    assert json.loads((run_dir / "FINISHED").read_text())["step"] == 3
    assert CheckpointStore(run_dir / "checkpoints").latest_valid().name == "step_00000003"
