"""DataConfig validation and its recipe mapping."""

import pytest

from megatron_s2.config.data import TASK_NAMES, DataConfig, TaskDifficulty
from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping


def test_defaults_are_valid_synthetic_data():
    cfg = DataConfig()
    assert cfg.kind == "synthetic" and cfg.tasks == TASK_NAMES and cfg.tokenizer == "char"
    assert cfg.num_documents == 20_000


@pytest.mark.parametrize("kwargs, message", [
    ({"tasks": ("addition", "division")}, r"tasks: unknown task 'division'; valid names: addition, multiplication"),
    ({"tasks": ()}, "tasks: synthetic data needs at least one task"),
    ({"tasks": ("sort", "sort")}, "tasks: duplicate"),
    ({"num_documents": 0}, "num_documents: must be >= 1"),
    ({"dataset_seed": -1}, "dataset_seed"),
    ({"kind": "indexed"}, "paths: kind 'indexed' needs at least one dataset prefix"),
    ({"paths": ("data/x",)}, "paths: only kinds 'indexed', 'chat', 'image_text' and 'timeseries' read files"),
    ({"kind": "indexed", "paths": ("a", "b"), "weights": (1.0,)}, "weights: 1 weights for 2 paths"),
    ({"kind": "indexed", "paths": ("a", "b"), "weights": (1.0, 0.0)}, "weights: every weight must be a positive"),
    ({"kind": "indexed", "paths": ("a", "a")}, "paths: duplicate prefixes"),
    ({"tasks": ("addition",), "near_miss_fraction": 1.0}, r"near_miss_fraction: must be in \[0, 1\), got 1.0"),
    ({"tasks": ("addition",), "near_miss_fraction": -0.1}, r"near_miss_fraction: must be in \[0, 1\)"),
    ({"tasks": ("addition", "sort"), "near_miss_fraction": 0.3}, r"near_miss_fraction: needs integer-answer tasks .* drop \['sort'\]"),
    ({"kind": "chat", "paths": ("a.jsonl",), "near_miss_fraction": 0.3}, "near_miss_fraction: applies to kind 'synthetic' only"),
])
def test_invalid_configs_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kwargs)


def test_difficulty_bounds():
    with pytest.raises(ConfigError, match="addition_max_digits: must be in 1..30, got 0"):
        TaskDifficulty(addition_max_digits=0)
    with pytest.raises(ConfigError, match="brackets_max_length: must be in 2..200"):
        TaskDifficulty(brackets_max_length=1)


def test_recipe_mapping_round_trip_and_unknown_keys():
    cfg = from_mapping(DataConfig, {"tasks": ["addition", "sort"], "difficulty": {"addition_max_digits": 9},
                                    "loss_on": "answer"}, "data")
    assert cfg.tasks == ("addition", "sort") and cfg.difficulty.addition_max_digits == 9
    assert from_mapping(DataConfig, to_mapping(cfg), "data") == cfg
    with pytest.raises(ConfigError, match="unknown key 'data.difficulty.addition_digits'"):
        from_mapping(DataConfig, {"difficulty": {"addition_digits": 3}}, "data")
    with pytest.raises(ConfigError, match="data.kind: 'hdf5' is not one of"):
        from_mapping(DataConfig, {"kind": "hdf5"}, "data")


def test_loss_mode_and_generation_seed():
    assert DataConfig().loss_mode("sft") == "answer"
    assert DataConfig().loss_mode("pretrain") == "all"
    assert DataConfig(loss_on="all").loss_mode("sft") == "all"
    assert DataConfig().generation_seed(5) == 5 and DataConfig(dataset_seed=9).generation_seed(5) == 9
