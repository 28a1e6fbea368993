"""`megatron-s2 plan memory|layouts|schedule` end to end (in-process)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_s2.cli import main
from tests.planning.helpers import BASE, RECIPE


def test_plan_memory(capsys):
    assert main(["plan", "memory", str(RECIPE), *BASE, "parallel.pp=2", "parallel.tp=2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2" in out and "pp=2" in out and "most loaded: pipeline stage 0" in out
    for line in ("parameters", "gradients", "optimizer state", "saved activations", "attention core (KV array + indices)",
                 "pipeline payload buffers", "engram shard"):
        assert line in out
    # the sparse attention kernel saves the KV array and the indices, never the [b, s, k, d] gather
    assert "gathered keys" not in out
    assert main(["plan", "memory", str(RECIPE), *BASE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["parameters"] == data[0]["gradients"] > 0


def test_plan_layouts(capsys):
    assert main(["plan", "layouts", str(RECIPE), *BASE, "training.global_batch_size=16", "--gpus", "4",
                 "--gpu-mem", "1", "--top", "3", "--show-rejected"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts for 4 GPUs" in out and "rejected" in out
    assert len([line for line in out.splitlines() if line[:1].isdigit() and "yes" in line]) == 3


def test_plan_schedule(tmp_path, capsys):
    out_file = tmp_path / "schedule.svg"
    assert main(["plan", "schedule", str(RECIPE), *BASE, "parallel.pp=2", "parallel.vpp=2", "--out", str(out_file)]) == 0
    assert "16 forward and 16 backward" in capsys.readouterr().out  # 4 micro-batches x 2 virtual x 2 ranks
    root = ET.parse(out_file).getroot()
    assert len([g for g in root.iter("{http://www.w3.org/2000/svg}g")]) == 32
    assert main(["plan", "memory", str(RECIPE), *BASE, "parallel.tp=3"]) == 2  # configuration error, exit 2


def test_plan_memory_bad_inputs_one_line(capsys, tmp_path):
    """A YAML syntax error was a 4-line message (PyYAML's snippet and caret); a `phases:` pipeline
    file said "the recipe names no model; add `model: tiny`"; `--world-size 0` silently planned the
    recipe's default world size."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nparallel: {tp: 2\ntraining: x: y\n")
    assert main(["plan", "memory", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not valid YAML at line" in err, err
    pipeline = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "flagship_pipeline.yaml"
    assert main(["plan", "memory", str(pipeline)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a pipeline" in err and "flagship_sft.yaml" in err, err
    assert "add `model: tiny`" not in err
    opd = Path(__file__).resolve().parents[2] / "recipes" / "opd_tiny.yaml"  # its phases use ${phase:...}
    assert main(["plan", "memory", str(opd)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a pipeline" in err and "phases/" in err, err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "memory", str(RECIPE), "--world-size", "0"])
    assert exc.value.code == 2 and "--world-size: must be at least 1" in capsys.readouterr().err


def test_plan_memory_of_a_transformer_engine_recipe_needs_no_te(capsys):
    """Planning a TE recipe on a machine without Transformer Engine (a login node) refused (it
    built the skeleton with the TE provider); TE modules adopt our parameters, so the plan is the
    local one's."""
    assert main(["plan", "memory", str(RECIPE), *BASE, "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["plan", "memory", str(RECIPE), *BASE, "model.transformer_impl=transformer_engine", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == local


def test_plan_memory_names_a_missing_teacher_checkpoint(capsys):
    """A flagship OPD plan before its teachers exist labelled them "checkpoint not readable",
    which read as a broken file; the line names the path and says the policy's model is assumed."""
    opd = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "flagship_opd.yaml"
    assert main(["plan", "memory", str(opd)]) == 0
    out = capsys.readouterr().out
    teacher = [line for line in out.splitlines() if line.strip().startswith("teacher math")]
    assert teacher and "policy's model assumed: checkpoints/teachers/math not found" in teacher[0], out[-2000:]


@pytest.mark.parametrize("recipe, override, field", [
    ("intern_s2/timeseries_forecast_397b_a17b.yaml", "parallel.cp=2", "parallel.cp"),
    ("intern_s2/timeseries_forecast_397b_a17b.yaml", "parallel.etp=2", "parallel.etp"),
    ("intern_s2/memdec_pretrain_397b_a17b.yaml", "parallel.cp=2", "parallel.cp")])
def test_plan_memory_refuses_a_layout_the_phase_refuses(recipe, override, field, capsys):
    """review24: `plan memory ... parallel.cp=2` printed a plan (exit 0) for the series and memdec
    phases, whose runs refuse cp / etp at any rank count; the plan now refuses it as launch does."""
    root = Path(__file__).resolve().parents[2] / "recipes"
    assert main(["plan", "memory", str(root / recipe), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field}: phase.kind" in err[0]
