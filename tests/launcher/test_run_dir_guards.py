"""`megatron-s2 launch` guards the run directory: in use, finished, data missing — at submit time.

Reproduced breaks: a second launch on a run directory in use rewrote its launch files and ran;
`launch --slurm` queued a job whose data path did not exist (it failed hours later, in the
trainer); a finished run could only be extended by deleting FINISHED by hand.
"""

from __future__ import annotations

import os

import pytest
from launcher_helpers import RECIPES

from megatron_s2.cli import main
from megatron_s2.runtime.run_lock import RunLock

RECIPE = str(RECIPES / "tiny_4rank.yaml")
pytestmark = pytest.mark.usefixtures("no_cluster")


@pytest.mark.parametrize("mode", ["--local", "--slurm"])
def test_launch_refuses_a_run_dir_in_use(mode, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with RunLock(run_dir).acquire("megatron-s2 train (another run)"):
        code = main(["launch", RECIPE, mode, "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, f"the refusal is one line, not {len(lines)}: {err}"
        assert f"pid {os.getpid()}" in err and "in use by another run" in err and "another run" in err
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"], "the refused launch wrote files"


def test_launch_slurm_checks_data_paths_at_submit(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["launch", RECIPE, "data.kind=indexed", f"data.paths=[{tmp_path}/corpus]", "--slurm", "--dry-run",
                 "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "data.paths" in err and f"{tmp_path}/corpus.idx" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_launch_checks_tokenizer_against_vocabulary(tmp_path, capsys):
    code = main(["launch", RECIPE, "model.vocab_size=64", "--slurm", "--dry-run", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "model.vocab_size: 64 is smaller than the 102 ids of the tokenizer data.tokenizer=char" in err


def test_launch_refuses_a_run_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    code = main(["launch", RECIPE, "--local", "--run-dir", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and "training.run_dir" in err and "not a directory" in err


@pytest.mark.parametrize("mode", ["--local", "--slurm"])
def test_finished_run_says_how_to_extend_and_a_raised_target_runs(mode, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "FINISHED").write_text('{"step": 8, "loss": 1.0}')
    assert main(["launch", RECIPE, mode, "--dry-run", "--run-dir", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert "finished at step 8 (training.train_steps=8)" in err
    assert "training.train_steps=16" in err and out == ""
    assert main(["launch", RECIPE, "training.train_steps=12", mode, "--dry-run", "--run-dir", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert "finished at step" not in err
    assert "megatron_s2.cli train" in out  # the command (local) or the batch script (SLURM)
    if mode == "--slurm":
        assert "TRAIN_STEPS=12" in out
