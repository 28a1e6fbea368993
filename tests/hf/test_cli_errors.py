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
             "step_00000000", "not empty")


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


def test_import_into_an_existing_run_is_refused_and_changes_nothing(ckpt, hf_dir, tmp_path, capsys):
    """Review 13: importing into a run directory (or its checkpoints/) wrote step_00000000 and a
    `latest` beside the run's own checkpoints and overwrote its tokenizer/ folder."""
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "step_00000010")
    (run / "config.yaml").write_text("model: tiny\n")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for target in (run, run / "checkpoints"):
        _refused(capsys, ["checkpoint", "import", str(hf_dir), str(target), "--no-progress", "--no-verify"],
                 str(target), "not empty")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


# ---- issue 19: hostile imports are refused before anything is committed ------------------------
@pytest.fixture(scope="module")
def verified_hf_dir(ckpt, tmp_path_factory) -> Path:
    """An export carrying its verification logits (the exporter's model and the char tokenizer)."""
    out = tmp_path_factory.mktemp("hf_verified") / "export"
    assert main(["checkpoint", "export", str(ckpt), str(out), "--no-progress", "--tokenizer", "char"]) == 0
    return out


def test_a_deeply_nested_config_is_refused(hf_dir, tmp_path, capsys):
    nested = _copy(hf_dir, tmp_path / "nested")
    (nested / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    _refused(capsys, ["checkpoint", "import", str(nested), str(tmp_path / "c"), "--no-progress"],
             str(nested / "config.json"), "nest")
    assert not (tmp_path / "c").exists()


def _retype(directory: Path, dtype) -> str:
    """Store the first floating tensor of the first shard as ``dtype``; returns its name."""
    from safetensors.torch import load_file, save_file

    shard = sorted(directory.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    return name


def test_an_integer_tensor_where_floats_are_expected_is_refused(verified_hf_dir, tmp_path, capsys):
    import torch

    bad = _copy(verified_hf_dir, tmp_path / "int32")
    name = _retype(bad, torch.int32)
    _refused(capsys, ["checkpoint", "import", str(bad), str(tmp_path / "c"), "--no-progress"], name, "int32")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_verification_failure_commits_nothing(verified_hf_dir, tmp_path, capsys):
    """Without our megatron_s2 block the release format's semantics apply (QAT paths on), which
    the exporter's model did not run: the stored logits are not reproduced, so nothing is written."""
    stripped = _copy(verified_hf_dir, tmp_path / "no_block")
    config = json.loads((stripped / "config.json").read_text())
    config.pop("megatron_s2")
    (stripped / "config.json").write_text(json.dumps(config))
    target = tmp_path / "c"
    code = main(["checkpoint", "import", str(stripped), str(target), "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1, err
    assert "verification failed" in err[0] and "fp4_main_kv" in err[0] and "nothing was written" in err[0]
    assert not target.exists() or not any(target.iterdir())
    assert main(["checkpoint", "import", str(stripped), str(target), "--no-progress", "--no-verify"]) == 0


def _with_nan(hf_dir: Path, out: Path) -> tuple[Path, str, str]:
    """A copy of the export with one NaN in one tensor: (directory, tensor name, file name)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    poisoned = _copy(hf_dir, out)
    shard = sorted(poisoned.glob("model-*.safetensors"))[-1]
    tensors = load_file(shard)
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] = float("nan")
    with safe_open(shard, "pt") as f:
        metadata = f.metadata()
    save_file(tensors, shard, metadata=metadata)
    return poisoned, name, shard.name


@pytest.mark.slow
def test_serve_generate_and_import_refuse_a_non_finite_export(hf_dir, tmp_path, capsys):
    """An export with a NaN weight: `checkpoint import` refused it, while `serve` started serving it
    and `generate` printed nothing and exited 0. All three refuse it in one line naming the tensor
    and its file (serve runs as a process: were it to start serving, the timeout would end it)."""
    import subprocess
    import sys

    poisoned, name, shard = _with_nan(hf_dir, tmp_path / "nan")
    where = [f"'{name}'", shard, "NaN"]
    _refused(capsys, ["generate", str(poisoned), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"], *where)
    _refused(capsys, ["checkpoint", "import", str(poisoned), str(tmp_path / "c"), "--no-progress"], *where)
    served = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "serve", str(poisoned), "--port", "0",
                             "--device", "cpu"], capture_output=True, text=True, timeout=120)
    lines = [line for line in served.stderr.splitlines() if line.strip()]
    assert served.returncode == 2 and len(lines) == 1, served.stderr
    assert all(word in lines[0] for word in where), lines[0]
