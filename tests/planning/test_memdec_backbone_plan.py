"""`plan memory` of the Memory Decoder's phases counts their frozen backbone (walkthrough Ch. 2,
megatron_s2/planning/posttrain.py::memdec_resident): every layer on each rank, sharded only by the
layout's tensor / expert groups. With a Qwen3.5-397B-A17B-shaped backbone and the layouts the phases
support (dp, tp <= 2 for its 2 key/value heads, pp; ep untested) that is 730 GiB per rank: no GPU
holds it, which is why no flagship-shaped Memory Decoder recipe ships (README, memdec row)."""

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


@pytest.mark.parametrize("model, gib, fits", [("intern_s2_397b_a17b", 730.43, False),
                                              ("intern_s2_35b_a3b", 62.81, True)])
def test_the_frozen_backbone_is_counted_whole_on_every_rank(model, gib, fits, tmp_path):
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={_backbone(tmp_path, model)}", "parallel.tp=2"])
    peak = estimate_memory(recipe, 2).peak
    [(label, size)] = peak.resident.items()
    assert "memdec frozen backbone" in label and "tp=2 ep=1" in label
    assert size / 2 ** 30 == pytest.approx(gib, abs=0.05)
    assert (peak.total < 0.95 * H200_BYTES) == fits


def test_an_unwritten_backbone_is_named_not_counted(tmp_path):
    recipe = load_recipe(RECIPES_DIR / "memdec" / "memory_pretrain.yaml",
                         [f"phase.memdec_backbone={tmp_path / 'missing'}"])
    [(label, size)] = estimate_memory(recipe, 1).peak.resident.items()
    assert "NOT COUNTED" in label and "not found" in label and size == 0
