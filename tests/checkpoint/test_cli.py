"""`megatron-s2 checkpoint inspect|verify|reshard` output and exit codes (0 ok, 1 bad, 2 usage).

The checkpoints here are written by :class:`CheckpointManager` from a small stand-in model
with the tiny recipe's resolved config in the manifest, so the commands see the real format
without a training run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint import CheckpointManager
from megatron_s2.checkpoint.offline import read_model_state
from megatron_s2.cli import main
from tests.checkpoint.runs import recipe

DATA = {"version": 1, "consumed_samples": 16, "seed": 1234, "seq_length": 32}


@pytest.fixture
def root(tmp_path) -> Path:
    cfg = recipe(tmp_path / "run", []).to_mapping()
    model = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(tmp_path / "checkpoints", log=lambda m: None)
    for step in (1, 2):
        mgr.save(step, {"model": model, "optimizer": None, "data": DATA, "rng": None},
                 {"layout": "world=1 tp=1 pp=1", "config": cfg, "model": "tiny"})
    return tmp_path / "checkpoints"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_inspect_step_dir(root, capsys):
    assert main(["checkpoint", "inspect", str(root / "step_00000002")]) == 0
    out = capsys.readouterr().out
    for text in ("status:      committed", "format:      megatron_s2.sharded v1", "step:        2",
                 "layout:      world=1 tp=1 pp=1 (1 ranks)", "model:       tiny", "consumed_samples=16",
                 "__0_0.distcp", ".metadata", "sha256 ", "config (resolved):", "  parallel:"):
        assert text in out, text
    assert "model           2 tensors" in out


def test_inspect_checkpoints_dir_lists_steps_and_describes_latest(root, capsys):
    (root / ".step_00000003.tmp").mkdir()
    assert main(["checkpoint", "inspect", "--no-config", "--verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "latest:      step_00000002" in out and "step_00000001  committed" in out
    assert "step_00000002  committed  <- latest" in out
    assert f"checkpoint:  {root / 'step_00000002'}" in out and "config (resolved)" not in out
    assert "OK     " in out and "all checksums match" in out


def test_verify_names_the_first_bad_file(root, capsys):
    assert main(["checkpoint", "verify", str(root / "step_00000002")]) == 0
    _flip(root / "step_00000002" / "__0_0.distcp")
    _flip(root / "step_00000002" / ".metadata")
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(root / "step_00000002")]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {root / 'step_00000002' / '.metadata'}: checksum mismatch" in out  # first in name order
    assert main(["checkpoint", "inspect", "--verify", str(root / "step_00000002")]) == 1
    assert main(["checkpoint", "verify", str(root)]) == 1  # a corrupted committed step fails the directory
    out = capsys.readouterr().out
    assert "OK     " in out and "resume: step_00000001" in out


def test_uncommitted_and_missing_directories(root, tmp_path, capsys):
    (root / "step_00000002" / "COMMITTED").unlink()
    assert main(["checkpoint", "verify", str(root / "step_00000002")]) == 1
    assert "COMMITTED: missing — the save did not finish" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(root / "step_00000002")]) == 1
    assert main(["checkpoint", "verify", str(root)]) == 0  # step 1 is valid; step 2 is skipped, never loaded
    assert "skip   " in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["checkpoint", "verify", str(tmp_path / "empty")]) == 2


def test_reshard_rewrites_layout_and_keeps_state(root, tmp_path, capsys):
    out = tmp_path / "resharded"
    assert main(["checkpoint", "reshard", str(root), str(out), "parallel.tp=2", "--world-size", "2"]) == 0
    assert main(["checkpoint", "inspect", "--no-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tp=2" in text and "(2 ranks)" in text and "resharded:   from" in text and "rng:         not stored" in text
    manifest, state = read_model_state(out)
    _, source = read_model_state(root)
    assert manifest.step == 2 and manifest.data == DATA and manifest.config["parallel"]["tp"] == 2
    assert set(state) == set(source) and all(torch.equal(state[k], source[k]) for k in state)


def test_reshard_refuses_invalid_layouts(root, tmp_path, capsys):
    assert main(["checkpoint", "reshard", str(root), str(tmp_path / "o"), "parallel.tp=3"]) == 2
    assert "parallel.tp" in capsys.readouterr().err
    assert main(["checkpoint", "reshard", str(root), str(tmp_path / "o"), "training.seq_length=64"]) == 2
    assert "not a layout override" in capsys.readouterr().err
    assert main(["checkpoint", "reshard", str(root), str(root)]) == 2
    assert not (tmp_path / "o").exists()


