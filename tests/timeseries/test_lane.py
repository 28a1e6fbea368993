"""The time-series lane wired into the families (issue 24, Intern-S2 report §2.2.1): the
``model.timeseries`` section, ``data.kind: timeseries`` documents from the generator and from
files, ``embed(..., series=)`` in both families, the layout refusals, and checkpoints that carry
the encoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE_TEXT = """
model:
  file: {model}
  timeseries: {{hidden: 32, heads: 2, token_budget: 32, forecast_context: 32, max_horizon: 32}}
phase: {{kind: sft}}
training: {{run_dir: {run_dir}, train_steps: 2, global_batch_size: 4, micro_batch_size: 2, seq_length: 96, seed: 1}}
schedule: {{lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 1, decay_start_step: 1, decay_end_step: 2}}
data: {{kind: timeseries, num_documents: 32, series_length: 96, series_horizon: 16}}
checkpoint: {{save_interval: 0}}
"""


def lane_recipe(tmp_path: Path, overrides=(), model: str = "intern_s2_tiny"):
    path = tmp_path / "lane.yaml"
    path.write_text(RECIPE_TEXT.format(model=model, run_dir=tmp_path / "run"))
    return load_recipe(path, list(overrides))


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("model.timeseries.heads=3", "model.timeseries.heads"),
    ("model.timeseries.cnn_kernel=4", "model.timeseries.cnn_kernel"),
    ("model.timeseries.token_budget=2", "model.timeseries.token_budget"),
    ("model.timeseries.max_horizon=0", "model.timeseries.max_horizon"),
    ("model.timeseries.hiden=8", "model.timeseries.hiden"),
    ("data.series_noise=-1", "data.series_noise"),
    ("data.paths=[a.txt]", "data.paths"),
])
def test_bad_config_is_one_line_naming_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as err:
        lane_recipe(tmp_path, [override])
    assert field in str(err.value) and "\n" not in str(err.value)


def test_recipe_loads_without_torch_and_round_trips(tmp_path):
    recipe = lane_recipe(tmp_path)
    assert recipe.model.timeseries.token_budget == 32
    assert recipe.to_mapping()["model"]["timeseries"]["hidden"] == 32
    assert recipe.model.timeseries.placeholder_id(recipe.model.vocab_size) == 127


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.cp=2", "parallel.dp=1"], "parallel.cp: data.kind: 'timeseries' runs under dp, tp (+sequence_parallel), "
                                         "pp and ep, not cp=2 (context parallelism would cut"),
    (["parallel.etp=2", "parallel.tp=2", "parallel.dp=1"], "parallel.etp: data.kind: 'timeseries' runs under dp, "
                                                           "tp (+sequence_parallel), pp and ep, not etp=2 (expert tensor"),
    (["phase.kind=timeseries_forecast", "parallel.cp=2", "parallel.dp=1"], "parallel.cp: phase.kind: timeseries_"
                                                                           "forecast runs under"),
    (["model.timeseries=null"], "model.timeseries"),
    (["model.timeseries.token_id=500"], "model.timeseries.token_id"),
])
def test_layouts_and_models_the_lane_cannot_run_are_refused(tmp_path, overrides, needle):
    from megatron_s2.training.run_checks import check_phase_layout

    with pytest.raises(ConfigError) as err:
        check_phase_layout(lane_recipe(tmp_path, overrides))
    assert str(err.value).startswith(needle) if needle.startswith("parallel.") else needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["parallel.tp=2", "parallel.dp=1"], ["parallel.pp=2", "parallel.dp=1"],
                                       ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=1"]])
def test_tensor_and_pipeline_layouts_are_accepted(tmp_path, overrides):
    """tp (+sp) and pp run (parity with one rank: tests/timeseries/test_layouts.py)."""
    from megatron_s2.training.run_checks import check_phase_layout

    check_phase_layout(lane_recipe(tmp_path, ["phase.kind=timeseries_forecast", *overrides]))


# ---- data ----------------------------------------------------------------------------------------
def _iterator(recipe):
    from megatron_s2.data.loader import build_data_iterator
    from megatron_s2.data.tokenizer import build_tokenizer

    t = recipe.training
    return build_data_iterator(recipe.data, seq_length=t.seq_length, global_batch_size=t.global_batch_size,
                               micro_batch_size=t.micro_batch_size, dp_rank=0, dp_size=1, seed=t.seed,
                               phase="sft", tokenizer=build_tokenizer(recipe.data), model=recipe.model)


def test_micro_batch_carries_series_at_their_placeholder_spans(tmp_path):
    from megatron_s2.models.timeseries.patching import plan_patching

    recipe = lane_recipe(tmp_path)
    token = recipe.model.timeseries.placeholder_id(recipe.model.vocab_size)
    mb = _iterator(recipe).next_step()[0]
    assert len(mb["series"]) == 2 and any(mb["series"])
    for row, (placements, targets) in enumerate(zip(mb["series"], mb["series_targets"])):
        assert len(placements) == len(targets)
        for place, target in zip(placements, targets):
            n = plan_patching(place.series.values.shape[1], 32, 4).num_tokens
            assert (mb["tokens"][row, place.start:place.start + n] == token).all()
            assert mb["series_mask"][row, place.start:place.start + n].all()
            assert target.future.shape[0] == place.series.values.shape[0]
            assert target.context_start < place.start < target.prompt_end
    # nothing predicts a series token; the answer is a target
    assert (mb["loss_mask"][mb["series_mask"]] == 0).all()
    assert mb["loss_mask"].sum() > 0


def test_series_documents_from_csv_and_npz(tmp_path):
    t = np.arange(200, dtype=np.float32)
    csv = tmp_path / "a.csv"
    csv.write_text("x,y\n" + "\n".join(f"{np.sin(v / 5):.4f},{np.cos(v / 5):.4f}" for v in t))
    npz = tmp_path / "b.npz"
    np.savez(npz, values=np.stack([np.sin(t / 7)]), sample_rate=np.float64(4.0))
    recipe = lane_recipe(tmp_path, [f"data.paths=[{csv},{npz}]", "data.series_length=80"])
    from megatron_s2.data.timeseries_text import file_items

    items = file_items(recipe.data)
    assert [i.values.shape[0] for i in items] == [2, 2, 1, 1]
    assert all(i.horizon == 16 for i in items)
    np.testing.assert_allclose(items[0].future[0], np.sin(np.arange(80, 96) / 5), atol=1e-4)
    assert _iterator(recipe).next_step()[0]["series"]


def test_nan_series_file_is_refused_in_one_line(tmp_path):
    from megatron_s2.data.errors import DataError

    csv = tmp_path / "bad.csv"
    csv.write_text("\n".join(["1.0", "nan", "2.0"] * 20))
    with pytest.raises(DataError) as err:
        _iterator(lane_recipe(tmp_path, [f"data.paths=[{csv}]"]))
    assert "bad.csv" in str(err.value) and "NaN" in str(err.value) and "\n" not in str(err.value)


def test_series_too_long_for_the_sequence_is_refused(tmp_path):
    from megatron_s2.data.errors import DataError

    with pytest.raises(DataError, match="training.seq_length"):
        _iterator(lane_recipe(tmp_path, ["training.seq_length=40"]))


# ---- families ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["intern_s2_tiny", "tiny"])
def test_both_families_embed_series_and_train_the_encoder(tmp_path, model, dtype):
    """Also in bfloat16 (the flagship recipes' params_dtype): the encoder's nn layers see one dtype
    (they raised "Input type BFloat16 and bias type float" when the precision map cast only matrices)."""
    from megatron_s2.models.family import family_of

    recipe = lane_recipe(tmp_path, [f"model.params_dtype={dtype}", f"model.compute_dtype={dtype}"], model=model)
    torch.manual_seed(0)
    net = family_of(recipe.model).build_model(recipe.model).init_weights(0)
    assert net.timeseries is not None
    mb = _iterator(recipe).next_step()[0]
    text_only = net.embed(mb["tokens"])[0]
    with_series = net.embed(mb["tokens"], series=mb["series"])[0]
    span = mb["series_mask"]
    if with_series.dim() == 4:  # V4.1's mHC streams: every stream starts from the embedding
        text_only, with_series = text_only[:, :, 0], with_series[:, :, 0]
    assert torch.equal(text_only[~span], with_series[~span])
    assert not torch.allclose(text_only[span], with_series[span])
    loss = net(mb["tokens"], net.make_context(mb), labels=mb["labels"], series=mb["series"])
    (loss * mb["loss_mask"]).sum().backward()
    grads = [p.grad for p in net.timeseries.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.slow
def test_checkpoint_saves_and_restores_the_encoder(tmp_path):
    from megatron_s2.training.trainer import Trainer

    recipe = lane_recipe(tmp_path, ["checkpoint.save_interval=2"])
    first = Trainer(recipe, tmp_path / "run", log=lambda *a, **k: None)
    first.train()
    saved = {k: v.clone() for k, v in first.model.timeseries.state_dict().items()}
    again = Trainer(recipe, tmp_path / "run", log=lambda *a, **k: None)
    assert any(not torch.equal(v, saved[k]) for k, v in again.model.timeseries.state_dict().items())  # it trained
    assert again.restore()
    for name, value in again.model.timeseries.state_dict().items():
        assert torch.equal(value, saved[name]), name


@pytest.mark.slow
def test_a_text_checkpoint_continues_with_a_fresh_encoder(tmp_path):
    from megatron_s2.training.trainer import Trainer

    quiet = lambda *a, **k: None  # noqa: E731
    text = lane_recipe(tmp_path, ["model.timeseries=null", "data.kind=synthetic", "training.train_steps=1",
                                  "schedule.warmup_steps=0", "schedule.decay_start_step=0", "schedule.decay_end_step=1",
                                  "checkpoint.save_interval=1", "training.run_dir=" + str(tmp_path / "text")])
    Trainer(text, tmp_path / "text", log=quiet).train()
    lines = []
    series = lane_recipe(tmp_path, ["checkpoint.load=" + str(tmp_path / "text"), "checkpoint.load_optimizer=false"])
    trainer = Trainer(series, tmp_path / "run", log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert trainer.restore()
    assert any("start from their initialisation" in line and "timeseries." in line for line in lines)


def test_run_checks_read_local_series_files_not_token_indexes(tmp_path):
    """``data.kind: timeseries`` with ``data.paths``: the start-up data check reads the series
    files (a good .csv passes; a NaN one is refused naming the file) instead of demanding a
    ``.idx`` token index beside each, which refused every local series file."""
    from megatron_s2.training.run_checks import check_data

    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("a,b\n" + "".join(f"{i % 7},{i % 5}\n" for i in range(200)))
    bad.write_text("a,b\n1,2\nnan,3\n" + "".join(f"{i},{i}\n" for i in range(50)))
    check_data(lane_recipe(tmp_path, [f"data.paths=[{good}]"]), tokenizer=None)
    with pytest.raises(ConfigError, match=r"^data\.paths: .*bad\.csv: 1 of .* NaN") as err:
        check_data(lane_recipe(tmp_path, [f"data.paths=[{good},{bad}]"]), tokenizer=None)
    assert "\n" not in str(err.value)
