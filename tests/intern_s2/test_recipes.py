"""The Intern-S2 family's recipes (issue 23): ``megatron-s2 account`` counts the public models'
sizes from their shapes, the flagship-shaped recipes fit their clusters (``plan memory``) and
pass ``launch --slurm --dry-run``'s checks, the tiny recipe trains on CPU, and what the family
cannot run is refused before any rank starts with one line and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_s2.config.recipe import RECIPES_DIR, load_recipe
from megatron_s2.models.family import family_of

REPO = Path(__file__).resolve().parents[2]
INTERN = REPO / "recipes" / "intern_s2"
H200_BYTES = 141e9


@pytest.mark.parametrize("model, total, active", [("intern_s2_35b_a3b", 34.66e9, 3.455e9),
                                                  ("intern_s2_397b_a17b", 396.3e9, 17.35e9)])
def test_account_counts_the_public_models_sizes(model, total, active):
    """35B-A3B and 397B-A17B: the names state total and active parameters; the shapes give them."""
    cfg = load_recipe(INTERN / "pretrain_tiny.yaml", [f"model={model}"]).model
    figures = family_of(cfg).account(cfg).figures
    assert figures["params"] == pytest.approx(total, rel=2e-3)
    assert figures["active_params"] == pytest.approx(active, rel=2e-3)
    # a request's recurrent state does not grow with its length; KV grows only in 1 of 4 layers
    assert figures["linear_layers"] == 3 * figures["full_attention_layers"]
    assert figures["recurrent_state_bytes_per_request"] > 1000 * figures["kv_bytes_per_token"]


@pytest.fixture
def cluster_inputs(tmp_path, monkeypatch):
    """Stand-ins for what `launch --slurm` checks on the submit host (tokenizer folder, data)."""
    from megatron_s2.data.jsonl import preprocess_jsonl
    from megatron_s2.data.tokenizer import load_tokenizer

    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    for name in ("Qwen3.5-35B-A3B", "Qwen3.5-397B-A17B"):
        shutil.copytree(RECIPES_DIR / "tokenizers" / "tiny-bpe", tmp_path / "checkpoints" / name)
    preprocess_jsonl([text], tmp_path / "data/pretrain/text", load_tokenizer(tmp_path / "checkpoints" / name))
    preprocess_jsonl([text], tmp_path / "data/memdec/domain_text", load_tokenizer(tmp_path / "checkpoints" / name))
    _series_stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    # no cluster: a configuration naming no controller, so sinfo says "cannot tell" at once (a
    # missing file makes it retry until the capacity query's 10 s timeout)
    conf = tmp_path / "no-cluster" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text("ClusterName=none\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    return tmp_path


def _series_stand_ins(root: Path) -> None:
    """The time-series phase's inputs: a series file and the pretraining checkpoint it loads."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    steps = np.arange(20_000, dtype=np.float32)
    (root / "data" / "timeseries").mkdir(parents=True)
    pq.write_table(pa.table({"a": np.sin(steps / 20), "b": np.cos(steps / 33)}),
                   root / "data" / "timeseries" / "train.parquet")
    step = root / "runs" / "intern_s2_397b" / "pretrain" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("stand-in")


@pytest.mark.parametrize("name, nodes", [("pretrain_35b_a3b", 4), ("pretrain_397b_a17b", 32),
                                         ("timeseries_forecast_397b_a17b", 32)])
def test_flagship_shaped_recipes_fit_their_clusters(name, nodes, cluster_inputs):
    from megatron_s2.launcher.launch import prepare_runs
    from megatron_s2.planning.memory import estimate_memory

    recipe = load_recipe(INTERN / f"{name}.yaml")
    assert recipe.launcher.nodes == nodes and f"{nodes} nodes x 8 H200" in (INTERN / f"{name}.yaml").read_text()
    plan = estimate_memory(recipe, nodes * 8)
    assert plan.peak.total < 0.95 * H200_BYTES, f"{name}: {plan.peak.total / 2 ** 30:.1f} GiB"
    assert plan.peak.state.parameters.get("moe routed experts", 0) > plan.peak.state.parameters["linear attention"]
    [run] = prepare_runs(str(INTERN / f"{name}.yaml"), [], {}, None, local=False)
    assert run.plan.world_size == nodes * 8


def test_the_series_phase_runs_on_the_pretraining_layout(cluster_inputs):
    """The 397B forecasting phase takes the pretraining recipe's layout (its experts split over
    ep=32; the lane refuses only cp / etp, run_checks.check_series_layout), far under 80 GB (its
    header's figure), and the pipeline file chains it after pretraining (launch --slurm --dry-run)."""
    from megatron_s2.launcher.launch import prepare_runs
    from megatron_s2.planning.memory import estimate_memory

    recipe = load_recipe(INTERN / "timeseries_forecast_397b_a17b.yaml")
    pretraining = load_recipe(INTERN / "pretrain_397b_a17b.yaml").parallel
    assert all(getattr(recipe.parallel, k) == getattr(pretraining, k)
               for k in ("tp", "pp", "pipeline_layers", "ep", "dp", "etp", "cp", "sequence_parallel"))
    plan = estimate_memory(recipe)
    assert plan.peak.total / 2 ** 30 == pytest.approx(26.28, abs=0.05)
    assert "26.3 GiB per rank" in (INTERN / "timeseries_forecast_397b_a17b.yaml").read_text()  # with the forecaster and encoder replica
    assert plan.peak.state.parameters["forecaster"] > 0 and plan.peak.state.parameters["series encoder replica"] > 0
    assert plan.peak.pp_rank == recipe.parallel.pp - 1
    pretrain, series = prepare_runs(str(INTERN / "timeseries_pipeline.yaml"), [], {}, None, local=False)
    assert (pretrain.phase, series.phase) == ("pretrain", "timeseries_forecast")
    assert series.recipe.checkpoint.load == str(pretrain.job.run_dir / "checkpoints")
    assert (pretrain.plan.world_size, series.plan.world_size) == (256, 256)


@pytest.mark.parametrize("name, gib", [("memdec_pretrain_397b_a17b", 45.54), ("memdec_router_397b_a17b", 46.90)])
def test_the_memdec_phases_fit_80_gib_with_the_frozen_backbone_split_over_ep(name, gib, cluster_inputs):
    """The Memory Decoder's phases against the 397B backbone (walkthrough Ch. 2): `plan memory`
    counts the frozen backbone's shard each rank builds — 1/32 of its routed experts, 32.9 GiB
    (730 GiB whole at tp=2) — and the most loaded rank stays under 80 GiB (the header's figure)."""
    from megatron_s2.launcher.launch import prepare_runs
    from megatron_s2.planning.memory import estimate_memory

    recipe = load_recipe(INTERN / f"{name}.yaml")
    assert (recipe.parallel.tp, recipe.parallel.ep, recipe.parallel.pp, recipe.launcher.nodes) == (2, 32, 1, 4)
    plan = estimate_memory(recipe, 32)
    [(label, size)] = [(k, v) for k, v in plan.peak.resident.items() if k.startswith("memdec frozen backbone")]
    assert label.startswith("memdec frozen backbone (intern-s2-397b-a17b;") and "tp=2 ep=32" in label
    assert size / 2 ** 30 == pytest.approx(32.93, abs=0.05)
    assert plan.peak.total / 2 ** 30 == pytest.approx(gib, abs=0.05) and plan.peak.total < 80 * 2 ** 30
    assert f"{gib:.1f} GiB per rank" in (INTERN / f"{name}.yaml").read_text()
    if name == "memdec_router_397b_a17b":  # the memory decoder is frozen: only the router has grads / state
        assert plan.peak.state.gradients == 0 and not any(plan.peak.state.optimizer.values())
        assert any(k.startswith("memdec router (trained") for k in plan.peak.resident)
    if name == "memdec_router_397b_a17b":  # alone it loads the memory phase's checkpoint
        step = cluster_inputs / "runs" / "intern_s2_397b" / "memdec_memory" / "checkpoints" / "step_00000001"
        step.mkdir(parents=True)
        (step / "COMMITTED").write_text("stand-in")
    [run] = prepare_runs(str(INTERN / f"{name}.yaml"), [], {}, None, local=False)
    assert run.plan.world_size == 32


def test_the_memdec_pipeline_chains_pretraining_memory_and_router(cluster_inputs):
    """launch --slurm --dry-run of recipes/intern_s2/memdec_pipeline.yaml: the memory phase reads the
    pretraining run as its frozen backbone, the router phase loads the memory phase's checkpoint."""
    from megatron_s2.launcher.launch import prepare_runs

    pretrain, memory, router = prepare_runs(str(INTERN / "memdec_pipeline.yaml"), [], {}, None, local=False)
    assert (pretrain.phase, memory.phase, router.phase) == ("pretrain", "memory", "router")
    assert memory.recipe.phase.memdec_backbone == router.recipe.phase.memdec_backbone == str(pretrain.job.run_dir)
    assert router.recipe.checkpoint.load == str(memory.job.run_dir / "checkpoints")
    assert not memory.recipe.checkpoint.load
    assert (pretrain.plan.world_size, memory.plan.world_size, router.plan.world_size) == (256, 32, 32)


def test_opd_tiny_distils_an_intern_s2_teacher_into_an_intern_s2_student(tmp_path):
    """recipes/intern_s2/opd_tiny.yaml (its header holds the measured run): every phase builds the
    hybrid; the opd phase starts from the student and loads the teacher phase's checkpoints."""
    from megatron_s2.launcher.launch import prepare_runs

    teacher, student, opd = prepare_runs(str(INTERN / "opd_tiny.yaml"), [], {}, str(tmp_path), local=True)
    assert {r.recipe.model.family for r in (teacher, student, opd)} == {"intern_s2"}
    assert opd.recipe.phase.kind == "opd" and opd.recipe.checkpoint.load == str(tmp_path / "student" / "checkpoints")
    [distilled] = opd.recipe.opd.teachers
    assert distilled.checkpoint == str(tmp_path / "teacher" / "checkpoints")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("override, field", [("parallel.recompute=selective", "parallel.recompute"),
                                             ("model.linear_num_key_heads=3", "model.linear_num_key_heads"),
                                             ("model.layer_types=[linear_attention]", "model.layer_types"),
                                             ("parallel.tp=4", "parallel.tp")])
def test_what_the_family_cannot_run_is_refused_in_one_line(override, field, tmp_path):
    out = _cli("launch", str(INTERN / "pretrain_tiny.yaml"), "--local", override, "launcher.nproc_per_node=2",
               f"training.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # refused before any rank started


@pytest.mark.slow
def test_tiny_recipe_trains_and_its_loss_falls(tmp_path):
    out = _cli("train", str(INTERN / "pretrain_tiny.yaml"), f"training.run_dir={tmp_path / 'run'}",
               "training.train_steps=30", "checkpoint.save_interval=30")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = [line for line in out.stdout.splitlines() if line.startswith("trained steps")][0]
    first, last = (float(x) for x in summary.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first - 0.5, summary
    assert (tmp_path / "run" / "checkpoints" / "step_00000030").is_dir()


def test_serving_with_prefix_caching_is_refused_in_one_line(tmp_path):
    """A recurrent state is not a per-page prefix: the engine setting is refused, not ignored."""
    from megatron_s2.config.engine import EngineConfig
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.models.intern_s2.config import InternS2Config

    cfg = InternS2Config()
    model = family_of(cfg).build_model(cfg)
    with pytest.raises(ConfigError, match="prefix_caching"):
        family_of(cfg).executor(model, EngineConfig(prefix_caching=True), __import__("torch").device("cpu"))


def test_a_misspelt_memdec_backbone_model_is_refused_when_the_recipe_loads(cluster_inputs):
    """review24: `launch memdec_pretrain_397b_a17b.yaml --slurm --dry-run
    phase.memdec_backbone_model=nonexistent` exited 0 (only `plan memory` and, once queued, the
    trainer looked the model up); now the recipe refuses it in one line naming the field."""
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.launcher.launch import prepare_runs

    with pytest.raises(ConfigError, match=r"^phase\.memdec_backbone_model: 'nonexistent' is neither") as err:
        load_recipe(INTERN / "memdec_pretrain_397b_a17b.yaml", ["phase.memdec_backbone_model=nonexistent"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"phase\.memdec_backbone_model: 'nonexistent'"):
        prepare_runs(str(INTERN / "memdec_pipeline.yaml"), ["phase.memdec_backbone_model=nonexistent"], {}, None,
                     local=False)
