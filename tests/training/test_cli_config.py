"""Configuration errors exit with code 2 and name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError

# one intra-op thread for the in-process runs (tests/conftest.py): tiny models, 2 shared cores
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain_tiny.yaml"


@pytest.mark.parametrize("override, message", [
    ("training.trian_steps=3", "unknown key 'training.trian_steps'; did you mean 'train_steps'?"),
    ("training.train_steps=abc", "training.train_steps: expected an integer"),
    ("model.num_attention_heads=3", "o_groups: 3 attention heads are not divisible by o_groups=2"),
    ("parallel.tp=3", "parallel.tp: 4 query heads not divisible by tp=3"),
    ("training.global_batch_size=5", "training.global_batch_size: 5 is not a multiple of micro_batch_size=4"),
    ("parallel.tp=2", "parallel: this layout needs 2 ranks but the process runs alone"),
    ("parallel.sequence_parallel=true", "parallel.sequence_parallel: needs tp > 1"),
])
def test_config_errors_exit_2(override, message, capsys, tmp_path):
    single = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0"]
    code = main(["train", str(RECIPE), *single, override, "--run-dir", str(tmp_path)])
    assert code == 2
    assert message in capsys.readouterr().err


def test_override_precedence_and_model_include(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("model: tiny\ntraining: {train_steps: 7, seed: 1}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nmodel: {file: tiny, hidden_size: 96}\ntraining: {seed: 2}\n")
    recipe = load_recipe(child, ["training.seed=3"])
    assert (recipe.training.train_steps, recipe.training.seed, recipe.model.hidden_size) == (7, 3, 96)
    assert recipe.model.num_attention_heads == 4  # rest of the tiny model file kept


def test_missing_recipe_and_cycle(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\nmodel: tiny\n")
    b.write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_recipe(a)
