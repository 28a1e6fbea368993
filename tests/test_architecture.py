"""The house rules: import layers, family isolation and a torch-free recipe loader (issue 19).

``lint-imports`` (import-linter, a dev dependency) checks the contracts of ``.importlinter`` on
the package as it is installed: ``launcher/``, ``kernels/`` and ``tools/`` live at the top of
the repository but import as ``megatron_s2.launcher`` / ``.kernels`` / ``.tools``, so the test
stages that layout with symbolic links first. A violation fails here, naming the import chain.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INSTALLED_CONTRACT = """
[importlinter:contract:families-installed]
name = kernels and launcher reach a model family only through the family interface
type = forbidden
source_modules =
    megatron_s2.kernels
    megatron_s2.launcher
forbidden_modules =
    megatron_s2.models.v41
    megatron_s2.models.intern_s2
"""
"""The family contract for launcher and kernels, which exist under megatron_s2 only in the
installed layout (the repository's .importlinter must also run in the source tree)."""


def _staged(tmp_path: Path) -> Path:
    stage = tmp_path / "stage"
    (stage / "megatron_s2").mkdir(parents=True)
    for entry in (REPO / "megatron_s2").iterdir():
        if entry.name != "__pycache__":
            (stage / "megatron_s2" / entry.name).symlink_to(entry)
    for name in ("launcher", "kernels", "tools"):
        (stage / "megatron_s2" / name).symlink_to(REPO / name)
    (stage / ".importlinter").write_text((REPO / ".importlinter").read_text() + INSTALLED_CONTRACT)
    return stage


def test_import_contracts_hold(tmp_path):
    stage = _staged(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(stage)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    out = subprocess.run([sys.executable, "-c", code], cwd=stage, env=env, capture_output=True, text=True, timeout=300)
    report = out.stdout + out.stderr
    assert "megatron_s2/megatron_s2" not in report
    assert out.returncode == 0, report[-6000:]
    assert "5 kept, 0 broken" in report


PLUGIN_FOLDERS = {"megatron_s2/posttrain/envs/vf_plugins"}
"""Folders put on ``sys.path`` by design (verifiers plugins are importable by their own ids)."""
DATA_FOLDERS = ("megatron_s2/posttrain/agentic/tasks/",)
"""Folders of data that happen to be Python source (the agentic tasks' workspaces and canonical
tests, run only inside sandboxes): never imported by the library."""


def test_every_module_folder_is_a_package():
    """``lint-imports`` skips namespace packages: a folder of modules without ``__init__.py``
    would escape every contract (megatron_s2/posttrain/rollout did, hiding an upward import)."""
    holes = []
    for top in ("megatron_s2", "launcher", "kernels", "tools"):
        for folder, dirs, files in os.walk(REPO / top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = Path(folder).relative_to(REPO).as_posix()
            if rel.startswith(DATA_FOLDERS):
                continue
            if any(f.endswith(".py") for f in files) and "__init__.py" not in files and rel not in PLUGIN_FOLDERS:
                holes.append(rel)
    assert not holes, f"add an __init__.py to: {holes}"


def test_loading_a_recipe_imports_no_torch():
    code = ("import sys; from megatron_s2.config.recipe import load_recipe; "
            "r = load_recipe('recipes/pretrain_tiny.yaml'); "
            "load_recipe('tests/families/dense_gqa/pretrain.yaml'); "
            "load_recipe('recipes/intern_s2/pretrain_tiny.yaml'); "
            "print(type(r.model).__name__, [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules])")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["V41Config", "[]"]


def test_cli_help_imports_no_torch():
    """``megatron-s2 --help`` (and every subcommand's parser) is built without torch or megatron-core."""
    code = ("import sys, contextlib, io; from megatron_s2.cli import build_parser; build_parser(); "
            "print([m for m in ('torch', 'megatron', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_merge_conflict_markers_are_committed():
    """A conflicted merge committed by mistake: a syntax error in Python, silent in Markdown/YAML."""
    marked = []
    for top in ("megatron_s2", "launcher", "kernels", "tools", "tests", "recipes", "bench", ".ci"):
        for path in (REPO / top).rglob("*"):
            if path.suffix in {".py", ".md", ".yaml", ".yml", ".json", ".sh", ""} and path.is_file():
                text = path.read_text(errors="replace")
                if "\n<<<<<<< " in text or "\n>>>>>>> " in text or text.startswith("<<<<<<< "):
                    marked.append(path.relative_to(REPO).as_posix())
    for name in ("README.md", "setup.py", ".importlinter"):
        text = (REPO / name).read_text()
        if "\n<<<<<<< " in text or "\n>>>>>>> " in text:
            marked.append(name)
    assert not marked, f"merge conflict markers in: {marked}"
