"""The pure layout object: validation messages, megatron-core rank order, stage placement."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_s2.models.v41.config import V41Config
from megatron_s2.config.parallel import ParallelConfig
from megatron_s2.config.schema import ConfigError, from_mapping
from megatron_s2.parallel.layout import ParallelLayout, rank_groups

MODELS = Path(__file__).resolve().parents[2] / "recipes" / "models"


def model(name: str) -> V41Config:
    return from_mapping(V41Config, yaml.safe_load((MODELS / f"{name}.yaml").read_text()))


BAD = [
    ("flagship", dict(ep=5), 10, "parallel.ep: ep=5 does not divide 384 routed experts"),
    ("flagship", dict(tp=3), 3, "parallel.tp: 64 query heads not divisible by tp=3"),
    ("flagship", dict(tp=2, pp=2, dp=4), 12, "parallel: world size 12 != tp*pp*cp*dp = 2*2*1*4 = 16"),
    ("flagship", dict(tp=4, pp=3), 24, "parallel: 40 layers do not split evenly over pp*vpp = 3 stages"),
    ("flagship", dict(pp=2, pipeline_layers=(30, 9)), 2, "parallel.pipeline_layers: [30, 9] sums to 39"),
    ("tiny", dict(tp=2), 3, "parallel: world size 3 is not divisible by tp*pp*cp = 2"),
    ("tiny", dict(etp=2, ep=4), 4, "parallel: etp*ep = 2*4 must divide tp*cp*dp = 4"),
    ("tiny", dict(engram_parallel=4), 2, "parallel.engram_parallel: 4 must divide dp*cp = 2"),
    ("tiny", dict(tp=8), 8, "parallel.tp: 4 query heads not divisible by tp=8"),
    ("tiny", dict(pp=16), 16, "parallel: 8 layers do not split evenly over pp*vpp = 16 stages"),
]


@pytest.mark.parametrize("name, sizes, world, message", BAD)
def test_bad_layouts_name_the_fix(name, sizes, world, message):
    with pytest.raises(ConfigError) as err:
        ParallelLayout.build(ParallelConfig(**sizes), model(name), world)
    assert message in str(err.value)


@pytest.mark.parametrize("sizes, message", [
    (dict(sequence_parallel=True), "parallel.sequence_parallel: needs tp > 1"),
    (dict(vpp=2), "parallel.vpp: virtual stages need pp > 1"),
    (dict(pp=2, pipeline_layers=(4,)), "parallel.pipeline_layers: 1 entries for pp*vpp = 2 stages"),
])
def test_config_level_errors(sizes, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        ParallelConfig(**sizes)


def test_batch_and_sequence_checks():
    tiny = model("tiny")
    with pytest.raises(ConfigError, match="seq_length: 30 is not divisible by 2\\*cp = 4"):
        ParallelLayout.build(ParallelConfig(cp=2), tiny, 2, seq_length=30)
    with pytest.raises(ConfigError, match="global_batch_size: 6 is not a multiple of micro_batch_size\\*dp = 2\\*2"):
        ParallelLayout.build(ParallelConfig(), tiny, 2, global_batch_size=6, micro_batch_size=2)


def test_rank_order_is_megatron_core():
    from megatron.core.parallel_state import RankGenerator

    for tp, cp, dp, pp in [(2, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 2)]:
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp"):
            assert rank_groups({"tp": tp, "cp": cp, "dp": dp, "pp": pp}, "tp-cp-dp-pp", token) == \
                sorted(gen.get_ranks(token))


def test_groups_and_placement():
    layout = ParallelLayout.build(ParallelConfig(tp=2, pp=2, ep=2), model("tiny"), 8)
    assert layout.dp == 2 and layout.edp == 2
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("embedding") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.stage_layers == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "etp": 0, "ep": 1, "edp": 0, "engram": 0}
    uneven = ParallelLayout.build(ParallelConfig(pp=2, vpp=2, pipeline_layers=(1, 3, 2, 2)), model("tiny"), 2)
    assert uneven.stage_layers == ((0,), (1, 2, 3), (4, 5), (6, 7))
    assert uneven.stages_of_rank(1) == [1, 3]
