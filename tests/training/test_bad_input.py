"""Careless input to `megatron-s2 train`: exit code 2 and one line naming the field or file.

Each case was seen to exit 1 with a traceback (or to be accepted and train on nonsense) before
the checks existed; the test runs the real CLI in this process, so an uncaught exception fails
it, and asserts the single line of the message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from megatron_s2.checkpoint.faults import FAULT_ENV
from megatron_s2.cli import main
from megatron_s2.config.recipe import RecipeConfig, load_recipe
from megatron_s2.config.schema import ConfigError, from_mapping

pytestmark = pytest.mark.usefixtures("one_thread_children")  # the CLI runs it starts (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.train_steps=1", "training.seq_length=32",
          "training.global_batch_size=4", "training.micro_batch_size=2", "data.num_documents=200",
          "logging.progress_bar=false", "logging.tensorboard=false"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("override, words", [
    ("schedule.lr=.inf", ["schedule.lr", "finite"]),
    ("optimizer.clip_grad=.nan", ["optimizer.clip_grad", "finite"]),
    ("launcher.terminate_grace_s=.nan", ["launcher.terminate_grace_s", "finite"]),
    ("optimizer.adamw_betas=[0.9, .nan]", ["optimizer.adamw_betas[1]", "finite"]),
    ("schedule.lr=nan", ["schedule.lr", "finite"]),
    ("schedule.lr=1e308", ["schedule.lr", "float32"]),
    ("training.seed=-1", ["training.seed", ">= 0"]),
    ("training.seed=99999999999999999999", ["training.seed"]),
])
def test_bad_numbers_exit_2_before_training(override, words, capsys, tmp_path):
    run_dir = tmp_path / "run"
    code = main(["train", str(RECIPE), *SINGLE, override, "--run-dir", str(run_dir)])
    line = _one_line_error(capsys)
    assert code == 2, line
    for word in words:
        assert word in line
    assert not run_dir.exists(), "a refused run leaves no run directory behind"


def _float_fields(cls, prefix: str = "", concrete: dict | None = None) -> typing.Iterator[tuple[str, object]]:
    """(key path, float type) of every float-typed field reachable from dataclass ``cls``
    (``concrete``: the class to walk instead of a field's declared base, e.g. the model family's)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = (concrete or {}).get(f"{prefix}{f.name}", hints[f.name])
        path = f"{prefix}{f.name}"
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and float in typing.get_args(tp)
        if tp is float or optional:
            yield path, tp
        elif dataclasses.is_dataclass(tp):
            yield from _float_fields(tp, path + ".")


def test_every_float_field_of_every_config_refuses_non_finite():
    """The schema layer refuses nan/inf for every float field, not a hand-kept list."""
    recipe = load_recipe(RECIPE)
    base = recipe.to_mapping()
    fields = list(_float_fields(RecipeConfig, concrete={"model": type(recipe.model)}))
    assert len(fields) > 25  # model, optimizer, schedule, parallel, launcher, logging ...
    for path, _ in fields:
        for bad in (math.nan, math.inf, -math.inf, "nan", "inf"):
            tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
            node = tree
            keys = path.split(".")
            for key in keys[:-1]:
                node[key] = dict(node[key])
                node = node[key]
            node[keys[-1]] = bad
            with pytest.raises(ConfigError, match=re.escape(path) + ": .*finite"):
                from_mapping(RecipeConfig, tree)


def test_run_dir_that_is_a_file(capsys, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("not a directory")
    code = main(["train", str(RECIPE), *SINGLE, "--run-dir", str(target)])
    line = _one_line_error(capsys)
    assert code == 2 and "training.run_dir" in line and "not a directory" in line
    assert target.read_text() == "not a directory"


def test_non_utf8_recipe(capsys, tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("model: tiny\n# caf\xe9 au lait\n".encode("latin-1"))
    code = main(["train", str(recipe), *SINGLE, "--run-dir", str(tmp_path / "run")])
    line = _one_line_error(capsys)
    assert code == 2 and str(recipe) in line and "UTF-8" in line


def test_missing_data_path(capsys, tmp_path):
    code = main(["train", str(RECIPE), *SINGLE, "data.kind=indexed", f"data.paths=[{tmp_path}/nothing]",
                 "--run-dir", str(tmp_path / "run")])
    line = _one_line_error(capsys)
    assert code == 2 and "data.paths" in line and "nothing" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind, words", [("missing", "does not exist"), ("file", "is a file"),
                                         ("empty", "holds no committed checkpoint")])
def test_checkpoint_load_that_holds_no_checkpoint_is_refused_before_training(kind, words, capsys, tmp_path):
    """`checkpoint.load=/nonexistent` (or a file) was refused only by the checkpoint manager after
    the model and optimiser were built (inside the ranks under `launch`); now by the start-up
    checks that `launch` runs too, before the run directory is touched."""
    path, run_dir = tmp_path / kind, tmp_path / "run"
    if kind == "file":
        path.write_text("not a checkpoint")
    elif kind == "empty":
        path.mkdir()
    code = main(["train", str(RECIPE), *SINGLE, f"checkpoint.load={path}", "--run-dir", str(run_dir)])
    line = _one_line_error(capsys)
    assert code == 2, line
    assert line.startswith("megatron-s2 train: configuration error: checkpoint.load: ") and str(path) in line
    assert words in line
    assert not run_dir.exists()


def test_checkpoint_load_is_not_read_when_the_run_resumes(tmp_path):
    """A run directory with a committed checkpoint resumes from it and never reads checkpoint.load
    (a pipeline relaunched after its earlier phase's directory was cleaned up)."""
    from megatron_s2.training.run_checks import check_checkpoint_load

    recipe = load_recipe(RECIPE, [f"checkpoint.load={tmp_path / 'gone'}"])
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^checkpoint\.load: .*gone does not exist"):
        check_checkpoint_load(recipe, tmp_path / "run")  # nothing committed yet: load is read
    (step / "COMMITTED").write_text("sha")
    check_checkpoint_load(recipe, tmp_path / "run")
    with pytest.raises(ConfigError, match="gone does not exist"):
        check_checkpoint_load(recipe.replace(checkpoint=dataclasses.replace(recipe.checkpoint, resume=False)),
                              tmp_path / "run")


def test_absurd_seq_length_is_refused_before_allocating(capsys, tmp_path):
    # 10^8 tokens per sequence: the ranks would be OOM-killed (exit 137) building activations.
    code = main(["train", str(RECIPE), *SINGLE, "training.seq_length=100000000", "--run-dir", str(tmp_path / "run")])
    line = _one_line_error(capsys)
    assert code == 2 and "training.seq_length" in line and "GiB" in line


def _in_private_mount_namespace() -> bool:
    return (shutil.which("unshare") is not None and
            subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0)


needs_mount_ns = pytest.mark.skipif(not _in_private_mount_namespace(),
                                    reason="needs `unshare -m` (mount namespaces) to build a read-only or full fs")


def _train_in_namespace(setup: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`megatron-s2 train` in a private mount namespace after the shell commands ``setup``."""
    argv = [sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SINGLE, *overrides,
            "--run-dir", str(run_dir)]
    script = f"set -e; {setup}; exec \"$@\""
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@needs_mount_ns
def test_read_only_run_dir(tmp_path):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    result = _train_in_namespace(f"mount --bind {run_dir} {run_dir}; mount -o remount,bind,ro {run_dir}", run_dir)
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode == 2, err
    assert "training.run_dir" in err and "not writable" in err
    assert list(run_dir.iterdir()) == []


@needs_mount_ns
@pytest.mark.slow
def test_disk_full_says_so(tmp_path):
    """A run directory on a 1 MiB file system: the first checkpoint does not fit."""
    run_dir = tmp_path / "full"
    run_dir.mkdir()
    result = _train_in_namespace(f"mount -t tmpfs -o size=1m tmpfs {run_dir}", run_dir)
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode == 1, err
    assert "disk full" in err.lower() or "no space left" in err.lower(), err


@needs_mount_ns
@pytest.mark.slow
def test_leftover_of_a_killed_save_does_not_block_the_restart(tmp_path):
    """A save that died on a full disk left its 6 MiB ``.step_1.tmp`` behind, and the next start on
    that disk stopped with a "disk full" message that did not mention it. Here the save is killed
    after its shards were written (fault point ``before_commit``) on a 10 MiB file system that
    holds one checkpoint, not two: the restart removes the leftover, says so, and saves."""
    disk, run_dir = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    argv = " ".join([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *SINGLE, "--run-dir",
                     str(run_dir)])
    out = tmp_path / "out"
    script = (f"mount -t tmpfs -o size=10m tmpfs {disk} || exit 97\n"
              f"{FAULT_ENV}=before_commit {argv} > {out}0 2>&1; echo $? > {out}0.rc\n"
              f"{argv} > {out}1 2>&1; echo $? > {out}1.rc\n"
              f"ls -a {run_dir}/checkpoints > {out}.ls")
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    subprocess.run(["unshare", "-m", "sh", "-c", script], env={**env, "PYTHONUNBUFFERED": "1"}, check=True,
                   timeout=900)
    killed, restart = (tmp_path / "out0").read_text(), (tmp_path / "out1").read_text()
    assert (tmp_path / "out0.rc").read_text().strip() == str(128 + signal.SIGKILL), killed
    assert (tmp_path / "out1.rc").read_text().strip() == "0", restart
    assert "Traceback" not in restart and "removed .step_00000001.tmp" in restart, restart
    assert (tmp_path / "out.ls").read_text().split() == [".", "..", "latest", "step_00000001"]


def test_transformer_engine_without_it_exits_2(capsys, tmp_path):
    """`model.transformer_impl: transformer_engine` where TE does not import was a RuntimeError
    traceback (exit 1) from the model build; it is a one-line configuration error before the run
    directory is touched (the launcher's local pre-flight runs the same check)."""
    from megatron_s2.models.v41.spec import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("Transformer Engine is importable here: the error path does not apply")
    run_dir = tmp_path / "run"
    code = main(["train", str(RECIPE), *SINGLE, "model.transformer_impl=transformer_engine", "--run-dir", str(run_dir)])
    line = _one_line_error(capsys)
    assert code == 2, line
    assert "model.transformer_impl" in line and "local" in line
    assert not run_dir.exists()


def test_bogus_kernel_mode_exits_2_before_training(capsys, tmp_path, monkeypatch):
    """MEGATRON_S2_KERNELS=bogus was a ValueError traceback from the first forward (exit 1)."""
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "bogus")
    run_dir = tmp_path / "run"
    code = main(["train", str(RECIPE), *SINGLE, "--run-dir", str(run_dir)])
    line = _one_line_error(capsys)
    assert code == 2, line
    assert "MEGATRON_S2_KERNELS" in line
    assert not run_dir.exists()


def test_override_with_bad_yaml_is_one_line(capsys, tmp_path):
    """`parallel.tp=[1` printed PyYAML's 7-line error (snippets and carets) inside the message."""
    code = main(["train", str(RECIPE), *SINGLE, "parallel.tp=[1", "--run-dir", str(tmp_path / "run")])
    line = _one_line_error(capsys)
    assert code == 2 and "parallel.tp=[1" in line and "not valid YAML" in line


def test_forced_triton_on_a_cpu_machine_without_interpreter_exits_2_before_the_run(capsys, tmp_path, monkeypatch):
    """MEGATRON_S2_KERNELS=triton without TRITON_INTERPRET on a machine with no GPU: refused at
    start-up (it failed in the first forward, after the run directory was written)."""
    import torch

    from megatron_s2.kernels.dispatch import triton_available

    if torch.cuda.is_available() or not triton_available():
        pytest.skip("needs a CPU-only machine with Triton importable")
    monkeypatch.setenv("MEGATRON_S2_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run_dir = tmp_path / "run"
    code = main(["train", str(RECIPE), *SINGLE, "--run-dir", str(run_dir)])
    line = _one_line_error(capsys)
    assert code == 2 and "TRITON_INTERPRET=1" in line, line
    assert not run_dir.exists()
