"""`plan memory` for RL / OPD phases counts what the co-located rollout keeps resident (report
§5.2.1): the rollout weight copy, the rollout and evaluation engines' KV pools, in-process teachers
and the KL reference — each line checked against the bytes of the real objects a tiny RL and OPD
trainer builds on CPU; pretrain plans are unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
from megatron_s2.config.recipe import RECIPES_DIR, load_recipe
from megatron_s2.models.v41.model import V41Model
from megatron_s2.planning.memory import estimate_memory
from megatron_s2.posttrain.trainer import PosttrainTrainer

PHASES = RECIPES_DIR / "phases"
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "training.train_steps=1",
         "checkpoint.save_interval=0"]


def model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes(engine) -> int:
    stores = (*engine.executor.global_kv.main.values(), *engine.executor.global_kv.index.values(), *engine.executor.swa.rings.values())
    return sum(t.numel() * t.element_size() for bufs in stores for t in bufs)


def line(resident: dict[str, float], prefix: str) -> float:
    [value] = [v for k, v in resident.items() if k.startswith(prefix)]
    return value


def close(planned: float, measured: int) -> bool:
    return abs(planned - measured) <= 0.10 * measured


def checkpoint(recipe, root, **model_changes):
    """A committed model-only checkpoint of a freshly initialised model (``model_changes``: a
    differently sized architecture sharing the tokenizer)."""
    recipe = recipe.replace(model=recipe.model.replace(**model_changes))
    state = V41Model(recipe.model).init_weights(7).state_dict()
    write_full_state(state, recipe, root)
    return root, recipe.model


def test_rl_plan_counts_rollout_copy_kv_pools_and_reference(tmp_path):
    base = load_recipe(PHASES / "rl_addition.yaml", ["model.params_dtype=bfloat16"])
    ref, _ = checkpoint(base, tmp_path / "ref")
    recipe = load_recipe(PHASES / "rl_addition.yaml", QUIET + [
        "model.params_dtype=bfloat16", "rl.rollout.engine.share_weights=never", "rl.rollout.engine.max_num_seqs=24",
        "training.seq_length=40", f"rl.reference_checkpoint={ref}",
        "rl.loss.terms=[{kind: policy_gradient}, {kind: reference_kl, coef: 0.01}]"])
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    assert trainer.transfer is not None and trainer.reference is not None
    planned = estimate_memory(recipe, 1).peak
    res = planned.resident
    assert close(line(res, "rollout weight copy"), model_bytes(trainer.rollout_model))
    assert close(line(res, "rollout engine KV"), kv_bytes(trainer.engine))
    assert close(line(res, "eval engine KV"), kv_bytes(trainer.eval_engine))
    assert close(line(res, "reference model (checkpoint's model"), model_bytes(trainer.reference))
    assert planned.total == planned.state.total + planned.activations + sum(res.values())


def test_opd_plan_counts_teachers_with_their_own_architecture(tmp_path):
    base = load_recipe(PHASES / "opd_addition.yaml")
    big, big_cfg = checkpoint(base, tmp_path / "big", moe_ffn_hidden_size=96, engram_table_size=509)
    small, _ = checkpoint(base, tmp_path / "small")
    recipe = load_recipe(PHASES / "opd_addition.yaml", QUIET + [
        "opd.rollout.engine.max_num_seqs=16",
        f"opd.teachers=[{{name: big, domains: [default], checkpoint: {big}}}, "
        f"{{name: small, domains: [other], checkpoint: {small}}}]"])
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    assert trainer.placement.shared and trainer.transfer is None  # the engine runs the training model
    assert trainer.teachers.teachers["big"].config == big_cfg
    res = estimate_memory(recipe, 1).peak.resident
    assert not any(k.startswith("rollout weight copy") for k in res)
    for name in ("big", "small"):
        assert close(line(res, f"teacher {name} (checkpoint's model"), model_bytes(trainer.teachers.teachers[name]))
    assert line(res, "teacher big") > line(res, "teacher small") * 1.2
    assert close(line(res, "rollout engine KV"), kv_bytes(trainer.engine))
    assert close(line(res, "eval engine KV"), kv_bytes(trainer.eval_engine))


def test_unreadable_teacher_checkpoint_is_planned_with_the_policy_model(tmp_path):
    recipe = load_recipe(PHASES / "opd_addition.yaml", [
        f"opd.teachers=[{{name: t, domains: [default], checkpoint: {tmp_path / 'missing'}}}]"])
    res = estimate_memory(recipe, 1).peak.resident
    assert line(res, "teacher t (policy's model") > 0


@pytest.mark.parametrize("overrides", [[], ["parallel.pp=2", "parallel.tp=2"]])
def test_pretrain_plan_is_unchanged(overrides):
    plan = estimate_memory(load_recipe(RECIPES_DIR / "v41" / "tiny_pretrain.yaml", overrides))
    for r in plan.ranks:
        assert r.resident == {}
        assert r.total == r.state.total + r.saved_activations + r.payload_buffers + r.transient


def test_memory_check_names_the_rollout_engine_when_its_kv_does_not_fit():
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.training.run_checks import HostMemory, check_memory

    recipe = load_recipe(PHASES / "rl_addition.yaml", ["rl.rollout.engine.max_num_seqs=1000000"])
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.engine: .* GiB rollout copy, engine KV and frozen models"):
        check_memory(recipe, 1, HostMemory(8 * 2 ** 30, "8 GiB (test)"))


def _sharded_worker(rank, world, out, overrides):
    import json
    from pathlib import Path

    recipe = load_recipe(PHASES / "rl_addition.yaml", overrides)
    t = PosttrainTrainer(recipe, Path(out) / "run", rank=rank, world_size=world, log=lambda *a: None)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "rollout weight copy": model_bytes(t.rollout_model), "rollout engine KV": kv_bytes(t.engine),
        "eval engine KV": kv_bytes(t.eval_engine), "reference model": model_bytes(t.reference)}))


@pytest.mark.slow
def test_rl_plan_under_tp2_sp_with_an_ep2_rollout_copy(tmp_path):
    """Training TP2 + SP forces a rollout copy, here TP2 x EP2: each rank's shards are planned."""
    import json

    from tests.parallel.spawn import run_distributed

    ref, _ = checkpoint(load_recipe(PHASES / "rl_addition.yaml", ["model.params_dtype=bfloat16"]), tmp_path / "ref")
    overrides = QUIET + ["model.params_dtype=bfloat16", "parallel.tp=2", "parallel.sequence_parallel=true",
                         "rl.rollout.engine.rollout_ep=2", "rl.rollout.engine.max_num_seqs=24",
                         f"rl.reference_checkpoint={ref}",
                         "rl.loss.terms=[{kind: policy_gradient}, {kind: reference_kl, coef: 0.01}]"]
    run_distributed(2, _sharded_worker, str(tmp_path), overrides)
    res = estimate_memory(load_recipe(PHASES / "rl_addition.yaml", overrides), 2).peak.resident
    assert "tp=2 ep=2" in next(k for k in res if k.startswith("rollout weight copy"))
    unsharded = [o for o in overrides if not o.startswith(("parallel.", "rl.rollout.engine.rollout_ep"))]
    single = estimate_memory(load_recipe(PHASES / "rl_addition.yaml", unsharded
                                         + ["rl.rollout.engine.share_weights=never"]), 1)
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for prefix, value in measured.items():
            assert close(line(res, prefix), value), (rank, prefix)
    assert line(res, "rollout weight copy") < 0.8 * line(single.peak.resident, "rollout weight copy")
