"""``phase.kind: contrastive`` (megatron_s2/training/contrastive_trainer.py): the 224 px cap,
layouts refused in one line before ranks start, the tiny recipe trained through
``megatron-s2 train`` with a falling loss and above-chance zero-shot retrieval, and the vision
encoder carried into a later phase's V41Model.vision from the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError, to_mapping
from tests.tiny_runs import REPO, tiny_recipe
from tests.vision.conftest import vision_config

RECIPE = REPO / "recipes" / "vision_contrastive_tiny.yaml"


def train_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("size,cap,expected", [((448, 300), 224, (154, 224)), ((64, 64), 224, (70, 70)),
                                               ((1000, 10), 224, (14, 224)), ((56, 56), 224, (56, 56))])
def test_contrastive_resolution_cap(size, cap, expected):
    """Report §4.2.2: larger images are downscaled to the 224 px cap, aspect kept; smaller ones are not
    scaled up; sides are whole 14-pixel patches (never past the cap's last whole patch)."""
    from megatron_s2.models.v41.vision.processor import plan_capped

    cfg = vision_config(vision_patch_size=14)
    grid = plan_capped(cfg, *size, cap)
    assert (grid.height, grid.width) == expected
    assert max(grid.height, grid.width) <= cap and grid.height % 14 == 0 and grid.width % 14 == 0


@pytest.mark.parametrize("override,field", [("parallel.tp=2", "parallel.tp"), ("parallel.pp=2", "parallel.pp"),
                                            ("parallel.cp=2", "parallel.cp"),
                                            ("model.vision_n_layers=0", "model.vision_n_layers"),
                                            ("parallel.dp=2", "training.micro_batch_size"),
                                            ("training.freeze_vision_until_decay=true",
                                             "training.freeze_vision_until_decay")])
def test_unsupported_layouts_refused_at_load(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_recipe(RECIPE, [override])


def test_contrastive_section_needs_its_phase():
    with pytest.raises(ConfigError, match="phase.kind is 'pretrain'"):
        load_recipe(RECIPE, ["phase.kind=pretrain"])


@pytest.mark.slow
def test_cli_refuses_tensor_parallelism_in_one_line(tmp_path):
    out = train_cli("parallel.tp=2", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "parallel.tp" in out.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_recipe_trains_ranks_captions_and_hands_the_encoder_on(tmp_path):
    run = tmp_path / "siglip"
    out = train_cli("training.train_steps=16", "contrastive.eval_items=48", "--run-dir", str(run))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < 0.6 * losses[0]
    retrieval = json.loads((run / "retrieval.json").read_text())
    assert retrieval["top1"] > retrieval["chance"], retrieval
    assert "zero-shot retrieval" in out.stdout

    # A later phase (here a pretrain of the backbone with the same vision tower) loads the
    # encoder from the contrastive checkpoint into V41Model.vision; the text tower stays behind.
    from megatron_s2.training.contrastive_trainer import ContrastiveTrainer
    from megatron_s2.training.trainer import Trainer

    contrastive = ContrastiveTrainer(load_recipe(RECIPE, [f"training.run_dir={run}"]), run, log=lambda *a: None)
    assert contrastive.restore()  # resumes its own finished run: the trained weights
    vision_fields = [f"model.{k}={v}" for k, v in to_mapping(load_recipe(RECIPE).model).items()
                     if (k.startswith("vision_") or k == "image_token_id") and v is not None]
    logs: list[str] = []
    later = Trainer(tiny_recipe(["parallel.tp=1", "parallel.pp=1", *vision_fields, f"checkpoint.load={run}",
                                 "checkpoint.load_optimizer=false"], run_dir=tmp_path / "later"),
                    tmp_path / "later", log=lambda *a: logs.append(" ".join(map(str, a))))
    initial = later.model.vision.tower.patch_embed.proj.weight.detach().clone()
    assert later.restore()
    trained = dict(contrastive.model.vision.named_parameters())
    loaded = dict(later.model.vision.named_parameters())
    assert trained.keys() == loaded.keys()
    for name, p in trained.items():
        assert torch.equal(p, loaded[name]), name
    assert not torch.equal(initial, loaded["tower.patch_embed.proj.weight"])  # training moved it
    assert any("start from their initialisation" in line for line in logs)  # the backbone is new


@pytest.mark.slow
def test_encoder_stages_pipeline_checks_every_phase(tmp_path):
    """recipes/vision_encoder_tiny.yaml: contrastive -> AR fine-tuning -> joint pre-training with only
    the encoder carried over; every phase (vision shapes, load_only) is checked before the first starts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "megatron_s2.cli", "launch", str(REPO / "recipes" / "vision_encoder_tiny.yaml"),
                          "--local", "--dry-run", "--run-dir", str(tmp_path / "stages")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert [line.split()[2].rstrip(":") for line in (out.stdout + out.stderr).splitlines() if line.startswith("[launch] phase")] == [
        "contrastive", "ar", "pretrain_mm"]
    from megatron_s2.launcher.pipeline import load_pipeline

    stages = {entry.name: load_recipe(entry.recipe, list(entry.overrides))
              for entry in load_pipeline(REPO / "recipes" / "vision_encoder_tiny.yaml").phases}
    shapes = {name: {k: v for k, v in to_mapping(r.model).items() if k.startswith("vision_")} for name, r in stages.items()}
    assert shapes["contrastive"] == shapes["ar"] == shapes["pretrain_mm"]  # one encoder through the stages
    assert stages["pretrain_mm"].checkpoint.load_only == ("vision.",)
    assert not stages["ar"].training.freeze_vision_until_decay and stages["pretrain_mm"].training.freeze_vision_until_decay


def test_local_pairs_train_in_order_and_hold_out_the_last_ones(tmp_path):
    """``data.kind: image_text`` with a folder source feeds the contrastive phase: each step takes
    the next global batch of local pairs (wrapping), data-parallel ranks take contiguous shares of
    it, the last ``eval_items`` pairs are held out, never trained on, and resume continues the order."""
    from megatron_s2.data.image_text_pairs import build_pair_source, heldout_pairs
    from megatron_s2.data.procedural_images import procedural_items

    for i, item in enumerate(procedural_items(10, seed=5, size=32)):
        item.image.save(tmp_path / f"{i:02d}.png")
        (tmp_path / f"{i:02d}.txt").write_text(f"caption {i}")
    recipe = load_recipe(RECIPE, ["data.kind=image_text", "data.source=folder", f"data.paths=[{tmp_path}]",
                                  "contrastive.eval_items=3"])
    source = lambda rank, dp: build_pair_source(recipe.contrastive, seed=0, global_batch_size=4, dp_rank=rank,  # noqa: E731
                                                dp_size=dp, data=recipe.data)
    one = source(0, 1)
    steps = [[caption for _, caption in one.next_step()] for _ in range(3)]
    assert steps == [[f"caption {i % 7}" for i in range(s * 4, s * 4 + 4)] for s in range(3)]  # 7 trained, wrapping
    halves = [source(r, 2) for r in range(2)]
    assert [c for h in halves for _, c in h.next_step()] == steps[0]
    held = heldout_pairs(3, seed=0, image_size=56, data=recipe.data)
    assert [c for _, c in held] == ["caption 7", "caption 8", "caption 9"] and held[0][0].size == (32, 32)
    resumed = source(0, 1)
    resumed.load_state_dict(one.state_dict())
    assert [c for _, c in resumed.next_step()] == [f"caption {i % 7}" for i in range(12, 16)]
    with pytest.raises(ConfigError, match="contrastive.eval_items: 10 held-out pairs leave none"):
        build_pair_source(load_recipe(RECIPE, ["data.kind=image_text", "data.source=folder",
                                               f"data.paths=[{tmp_path}]", "contrastive.eval_items=10"]).contrastive,
                          seed=0, global_batch_size=4, dp_rank=0, dp_size=1, data=recipe.data)


def test_plan_memory_counts_the_two_towers_not_the_language_model():
    """`plan memory` on a contrastive recipe plans what its ranks hold: the two towers (their real
    parameter count), gradients, optimiser state and the towers' activations — no backbone layers."""
    from megatron_s2.models.family import family_of
    from megatron_s2.planning.memory import estimate_memory

    recipe = load_recipe(RECIPE)
    plan = estimate_memory(recipe, 1)
    [rank] = plan.ranks
    with torch.device("meta"):
        model = family_of(recipe.model).build_contrastive_model(recipe.model, recipe.contrastive,
                                                                recipe.model.vocab_size)
    assert rank.state.parameter_bytes == 4 * sum(p.numel() for p in model.parameters())  # float32 parameters
    assert set(rank.state.parameters) == {"vision encoder", "text tower", "projections + t', b"}
    assert rank.layers == [] and rank.activation_parts["vision tower"] > 0
    bigger = estimate_memory(load_recipe(RECIPE, ["training.micro_batch_size=64", "training.global_batch_size=64"]), 1)
    assert bigger.peak.saved_activations > 1.9 * rank.saved_activations  # activations scale with the micro-batch
