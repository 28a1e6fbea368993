"""`plan memory` of the Memory Decoder's phases counts their frozen backbone (walkthrough Ch. 2,
megatron_s2/planning/posttrain.py::memdec_resident): every layer on each rank, sharded only by the
layout's tensor / expert groups. A Qwen3.5-397B-A17B-shaped backbone is 730 GiB per rank at tp=2
(tp <= 2 for its 2 key/value heads): no GPU holds it. Split over ep its routed experts shrink by
1/ep (ep=4: 190 GiB here; the flagship recipes' ep=32: 32.9 GiB,
tests/intern_s2/test_recipes.py); the count is what the ranks build (the shard of a real
skeleton), and a backbone the layout cannot split is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_s2.config.recipe import RECIPES_DIR, load_recipe
from megatron_s2.models.family.registry import BLOCK_KEY
from megatron_s2.planning.memory import estimate_memory

H200_BYTES = 141e9


def _backbone(tmp_path: Path, model: str) -> Path:
    """A stand-in export: the architecture only (config.json), as the planner reads it."""
    folder = tmp_path / model
    folder.mkdir()
    mapping = yaml.safe_load((RECIPES_DIR / "models" / f"{model}.yaml").read_text())
    (folder / "config.json").write_text(json.dumps({BLOCK_KEY: {"model": mapping}}))
    return folder


def _backbone_line(resident: dict) -> list:
    return [(label, size) for label, size in resident.items() if label.startswith("memdec frozen backbone")]


@pytest.mark.parametrize("model, gib, fits", [("intern_s2_397b_a17b", 730.43, False),
                                              ("intern_s2_35b_a3b", 62.81, True)])
def test_the_frozen_backbone_is_counted_whole_on_every_rank(model, gib, fits, tmp_path):
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={_backbone(tmp_path, model)}", "parallel.tp=2"])
    peak = estimate_memory(recipe, 2).peak
    [(label, size)] = _backbone_line(peak.resident)
    assert "memdec frozen backbone" in label and "tp=2 ep=1" in label
    assert size / 2 ** 30 == pytest.approx(gib, abs=0.05)
    assert (peak.total < 0.95 * H200_BYTES) == fits


def test_the_frozen_backbone_is_split_over_ep_as_the_ranks_build_it(tmp_path):
    """ep=4 (tp=2, dp=4): the plan's line is the bytes of the backbone each rank really builds."""
    from megatron_s2.config.model_schema import ModelSchema
    from megatron_s2.config.schema import from_mapping
    from megatron_s2.models.family import family_of
    from megatron_s2.parallel.layout import ParallelLayout
    from megatron_s2.parallel.offline_groups import layout_groups

    backbone = _backbone(tmp_path, "intern_s2_397b_a17b")
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={backbone}", "parallel.tp=2", "parallel.dp=4", "parallel.ep=4", "training.micro_batch_size=4"])
    [(label, size)] = _backbone_line(estimate_memory(recipe, 8).peak.resident)
    assert "tp=2 ep=4" in label
    whole = estimate_memory(load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                                        [f"phase.memdec_backbone={backbone}", "parallel.tp=2"]), 2)
    assert size / 2 ** 30 == pytest.approx(190.43, abs=0.05) and size < whole.peak.total / 3
    # the same count from the tiny backbone's real (not meta) model on an ep rank of that layout
    tiny = from_mapping(ModelSchema, yaml.safe_load((RECIPES_DIR / "models" / "intern_s2_tiny.yaml").read_text()), "m")
    layout = ParallelLayout.from_recipe(recipe, 8)
    model = family_of(tiny).build_model(tiny, layout_groups(layout, 3))
    model.apply_precision_map()
    built = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    from megatron_s2.planning.posttrain import frozen_model_bytes

    assert frozen_model_bytes(tiny, layout_groups(layout, 3)) == built


def test_a_backbone_the_layout_cannot_split_is_refused_in_one_line(tmp_path):
    from megatron_s2.config.schema import ConfigError

    folder = tmp_path / "six_experts"
    folder.mkdir()
    mapping = yaml.safe_load((RECIPES_DIR / "models" / "intern_s2_tiny.yaml").read_text())
    (folder / "config.json").write_text(json.dumps({BLOCK_KEY: {"model": {**mapping, "num_routed_experts": 6}}}))
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={folder}", "parallel.dp=4", "parallel.ep=4", "training.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"^parallel\.ep: ep=4 does not divide the 6 routed experts of "
                                          r"phase\.memdec_backbone") as err:
        estimate_memory(recipe, 4)
    assert "\n" not in str(err.value)


def test_an_unwritten_backbone_is_counted_from_memdec_backbone_model(tmp_path):
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={tmp_path / 'missing'}", "phase.memdec_backbone_model=intern_s2_35b_a3b",
                          "parallel.tp=2"])
    [(label, size)] = _backbone_line(estimate_memory(recipe, 2).peak.resident)
    assert "model intern_s2_35b_a3b assumed" in label and "not found" in label
    assert size / 2 ** 30 == pytest.approx(62.81, abs=0.05)


def test_an_unwritten_backbone_is_named_not_counted(tmp_path):
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={tmp_path / 'missing'}"])
    [(label, size)] = _backbone_line(estimate_memory(recipe, 1).peak.resident)
    assert "NOT COUNTED" in label and "not found" in label and size == 0


@pytest.mark.parametrize("recipe_name, kind", [("memory_pretrain", "memdec"), ("router", "memdec_router")])
def test_the_objective_working_set_is_counted_on_the_last_stage(recipe_name, kind, tmp_path):
    """The objectives run over the whole vocabulary on every tp rank of the last stage: the measured
    bytes per position and vocabulary entry (bench/memdec_objective_bytes.py) x mbs x seq x V."""
    from megatron_s2.planning.posttrain import MEMDEC_OBJECTIVE_BYTES

    recipe = load_recipe(RECIPES_DIR / "memdec" / f"{recipe_name}.yaml",
                         [f"phase.memdec_backbone={_backbone(tmp_path, 'intern_s2_tiny')}", "parallel.pp=2"])
    first, last = estimate_memory(recipe, 2).ranks
    t = recipe.training
    [working] = [size for label, size in last.resident.items() if label.startswith("memdec objective working set")]
    assert working == MEMDEC_OBJECTIVE_BYTES[kind] * t.micro_batch_size * t.seq_length * recipe.model.vocab_size
    assert not any(label.startswith("memdec objective") for label in first.resident)
    assert len(_backbone_line(first.resident)) == len(_backbone_line(last.resident)) == 1  # every stage holds the backbone
