"""`megatron-s2 checkpoint export|import`: every refusal is exit 2 and one line naming the file.

Reproduced breaks: a missing path, an existing target, a corrupt config.json, a file that is
not safetensors, a truncated safetensors file and an existing step all exited 1 with a
traceback (the safetensors library's own error did not even name the file); exported files
were created 0700/0600 whatever the umask.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from megatron_s2.checkpoint.offline import write_model_state
from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"


@pytest.fixture(scope="module")
def ckpt(tiny_state, tmp_path_factory) -> Path:
    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0"])
    return write_model_state(tiny_state, recipe, tmp_path_factory.mktemp("ours") / "checkpoints", world_size=1)


@pytest.fixture(scope="module")
def hf_dir(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "export"
    assert main(["checkpoint", "export", str(ckpt), str(out), "--no-verify", "--no-progress", "--tokenizer", "char"]) == 0
    return out


def _refused(capsys, argv: list[str], *words: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_export_refusals(ckpt, hf_dir, tmp_path, capsys):
    _refused(capsys, ["checkpoint", "export", str(tmp_path / "none"), str(tmp_path / "o1"), "--no-progress", "--tokenizer", "char"],
             str(tmp_path / "none"), "no valid checkpoint")
    _refused(capsys, ["checkpoint", "export", str(ckpt), str(hf_dir), "--no-progress", "--tokenizer", "char"],
             str(hf_dir), "not empty")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _refused(capsys, ["checkpoint", "export", str(ckpt), str(blocker / "out"), "--no-progress", "--no-verify", "--tokenizer", "char"],
             str(blocker))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_import_refusals(hf_dir, tmp_path, capsys):
    _refused(capsys, ["checkpoint", "import", str(tmp_path / "none"), str(tmp_path / "c0"), "--no-progress"],
             str(tmp_path / "none"))
    bad_config = _copy(hf_dir, tmp_path / "bad_config")
    (bad_config / "config.json").write_text("{")
    _refused(capsys, ["checkpoint", "import", str(bad_config), str(tmp_path / "c1"), "--no-progress"],
             str(bad_config / "config.json"), "JSON")
    shard = sorted(hf_dir.glob("model-*.safetensors"))[0].name
    not_st = _copy(hf_dir, tmp_path / "not_safetensors")
    (not_st / shard).write_bytes(b"garbage!")
    _refused(capsys, ["checkpoint", "import", str(not_st), str(tmp_path / "c2"), "--no-progress"],
             str(not_st / shard))
    truncated = _copy(hf_dir, tmp_path / "truncated")
    data = (truncated / shard).read_bytes()
    (truncated / shard).write_bytes(data[: len(data) // 2])  # header intact, tensor data cut
    _refused(capsys, ["checkpoint", "import", str(truncated), str(tmp_path / "c3"), "--no-progress"],
             str(truncated / shard))
    index = _copy(hf_dir, tmp_path / "bad_index")
    (index / "model.safetensors.index.json").write_text("[1, 2")
    _refused(capsys, ["checkpoint", "import", str(index), str(tmp_path / "c4"), "--no-progress"],
             str(index / "model.safetensors.index.json"))
    assert main(["checkpoint", "import", str(hf_dir), str(tmp_path / "c5"), "--no-progress", "--no-verify"]) == 0
    capsys.readouterr()
    _refused(capsys, ["checkpoint", "import", str(hf_dir), str(tmp_path / "c5"), "--no-progress", "--no-verify"],
             "step_00000000", "already exists")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_exported_files_follow_the_umask_unless_private(ckpt, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "shared"
        assert main(["checkpoint", "export", str(ckpt), str(out), "--no-verify", "--no-progress", "--tokenizer", "char"]) == 0
        private = tmp_path / "private"
        assert main(["checkpoint", "export", str(ckpt), str(private), "--no-verify", "--no-progress",
                     "--private", "--tokenizer", "char"]) == 0
    finally:
        os.umask(old)
    assert _mode(out) == 0o755
    assert {_mode(p) for p in out.iterdir()} == {0o644}
    assert _mode(private) == 0o700
    assert {_mode(p) for p in private.iterdir()} == {0o600}
    assert json.loads((out / "config.json").read_text())
