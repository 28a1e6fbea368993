"""The DSpark training stage and co-training (report §2.4.3): only the drafter trains in the
stage; co-training leaves the backbone's gradients bitwise as without the drafter; bad recipes
are refused before a rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "recipes" / "phases" / "dspark_sort_copy.yaml"
QUICK = ["training.seq_length=32", "training.global_batch_size=4", "training.micro_batch_size=2",
         "data.num_documents=200", "logging.tensorboard=false", "logging.progress_bar=false",
         "checkpoint.save_at_end=false", "checkpoint.resume=false", "training.train_steps=2"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread (tests/conftest.py)."""


def _trainer(tmp_path, recipe=STAGE, overrides=()):
    from megatron_s2.training.trainer import Trainer

    run = tmp_path / "run"
    r = load_recipe(recipe, [*QUICK, *overrides, f"training.run_dir={run}"])
    return Trainer(r, run, log=lambda *a, **k: None)


def test_the_stage_trains_only_the_drafter(tmp_path):
    trainer = _trainer(tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    biases = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")}
    metrics = {}
    for _ in range(2):
        trainer.schedule.apply(trainer.optimizer, trainer.step)
        result = trainer.compute_gradients(trainer.data.next_step())
        trainer.apply_gradients(result.loss)
        metrics = result.metrics
    names = {n for n, _ in trainer.model.named_parameters()}
    trained = {n for n in names if not torch.equal(before[n], dict(trainer.model.named_parameters())[n])}
    assert trained and all(n.startswith("dspark.") for n in trained)
    assert {n for n in names if n.startswith("dspark.") and n not in trained} <= {"dspark.markov_w2"} | set()
    state_names = {n for opt in trainer.optimizer.optimizers.values() for g in opt.param_groups
                   for n in g["param_names"]}
    assert state_names and all(n.startswith("dspark.") for n in state_names)  # no backbone optimiser state
    for n, b in trainer.model.named_buffers():
        if n in biases and not n.startswith("dspark."):
            assert torch.equal(b, biases[n]), f"{n}: a frozen router's bias moved"
    assert {"draft_accept_1_raw", "draft_lk_raw", "draft_confidence_raw"} <= set(metrics)


def test_cotraining_leaves_the_backbone_gradients_bitwise_unchanged(tmp_path):
    sft = ROOT / "recipes" / "phases" / "sft_sort_copy.yaml"
    drafter = ["model.dspark_layers=2", "model.dspark_block_size=4", "model.dspark_noise_token_id=127",
               "model.dspark_target_layer_ids=[5,6,7]", "model.dspark_markov_rank=8",
               "model.dspark_num_routed_experts=4", "model.dspark_moe_topk=2"]
    grads = {}
    for train_drafter in (False, True):
        torch.manual_seed(0)
        trainer = _trainer(tmp_path / str(train_drafter), sft, [*drafter, f"phase.train_drafter={train_drafter}"])
        trainer.compute_gradients(trainer.data.next_step())
        grads[train_drafter] = {n: p.grad for n, p in trainer.model.named_parameters()}
    backbone = [n for n in grads[False] if not n.startswith("dspark.")]
    assert backbone
    for n in backbone:
        assert torch.equal(grads[False][n], grads[True][n]), n
    assert all(grads[False][n] is None for n in grads[False] if n.startswith("dspark."))  # frozen without it
    assert any(grads[True][n] is not None for n in grads[True] if n.startswith("dspark."))


@pytest.mark.parametrize("overrides, message", [
    (["model=tiny"], "model.dspark_layers: phase.kind: dspark trains the DSpark drafter, but the model has none"),
    # under cp each chunk's last anchors read the next chunk's first dspark_block_size rows
    (["parallel.cp=2", "model.dspark_block_size=12"],
     "parallel.cp: phase.kind: dspark under cp=2 cuts training.seq_length 32 into chunks of 8 tokens, shorter than "
     "model.dspark_block_size 12"),
])
def test_bad_stage_recipes_are_refused_before_ranks_start(tmp_path, overrides, message):
    from megatron_s2.training.run_checks import check_drafter_phase

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_drafter_phase(load_recipe(STAGE, [*QUICK, *overrides]))


def test_the_online_draft_update_never_reaches_the_policy(dspark_cfg):
    """RL / OPD (walkthrough Ch. 4): the drafter objective rides on the policy's own loss_fn; the
    policy's gradients are bitwise those of its loss alone, the drafter's are not None."""
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.training.draft_objective import DraftObjective

    tokens = torch.randint(0, 127, (2, 24), generator=torch.Generator().manual_seed(2))
    loss_mask = torch.zeros(2, 24)
    loss_mask[:, 10:20] = 1  # the rollout's sampled tokens (the drafter fits the policy there)
    mb = {"tokens": tokens, "loss_mask": loss_mask}

    def policy_loss(model, logits, mb, ctx):  # any policy objective on the logits (here: a log-likelihood)
        lp = logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None]).mean()
        return -lp, -lp.detach()

    grads = {}
    for with_drafter in (False, True):
        model = build_model(dspark_cfg, seed=4)
        model.capture_dspark = True
        ctx = model.make_context(mb)
        logits = model(tokens, ctx)
        loss_fn = (DraftObjective(torch.tensor([48.0]), 1, language_model=False, eta=3.0, temperature=0.7,
                                  primary=policy_loss) if with_drafter else policy_loss)
        objective, _ = loss_fn(model, logits, mb, ctx)
        objective.backward()
        grads[with_drafter] = {n: p.grad for n, p in model.named_parameters()}
    for n, g in grads[False].items():
        if not n.startswith("dspark."):
            other = grads[True][n]
            assert (g is None and other is None) or torch.equal(g, other), n
    assert all(grads[True][n] is not None for n in grads[True] if n.startswith("dspark.") and n != "dspark.confidence"
               ) and grads[True]["dspark.confidence"] is not None


@pytest.mark.slow
def test_the_rl_log_shows_the_online_draft_update(tmp_path):
    """RL with ``phase.train_drafter`` (recipes/phases/rl_sort_dspark.yaml): the step's record
    carries the drafter objective's metrics (draft_lk, draft_accept_k), as the DSpark stage's
    does; the RL trainer dropped every metric of the forward."""
    import json

    from megatron_s2.cli import main

    run = tmp_path / "rl"
    rc = main(["train", str(ROOT / "recipes" / "phases" / "rl_sort_dspark.yaml"), f"training.run_dir={run}",
               "training.train_steps=1", "training.global_batch_size=4", "training.micro_batch_size=2",
               "rl.rollout.group_size=2", "rl.rollout.batch_groups=2", "rl.rollout.max_in_flight=4",
               "rl.rollout.max_new_tokens=6", "rl.rollout.environment.num_prompts=20",
               "rl.rollout.environment.eval_prompts=2", "rl.eval.interval=0", "rl.advantage.dynamic_sampling=false",
               "checkpoint.save_interval=0", "checkpoint.save_at_end=false", "logging.tensorboard=false",
               "logging.progress_bar=false"])
    assert rc == 0
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"draft_lk_raw", "draft_accept_1_raw", "draft_confidence_raw"} <= set(record), sorted(record)
    # the rollouts' speculation: acceptance, tokens per verification, decode steps that drafted
    assert 0.0 <= record["rollout_drafting_steps"] <= 1.0 and "rollout_draft_acceptance" in record, sorted(record)


def test_train_names_the_drafter_layout_before_the_rank_count(tmp_path, capsys):
    """`megatron-s2 train <dspark recipe> parallel.cp=2` with draft blocks longer than the CP chunks,
    in one process: the layout the drafter cannot use is the error (exit 2, one line), not "start
    it with launch" — launching would only be refused again."""
    from megatron_s2.cli import main

    code = main(["train", str(STAGE), *QUICK, "parallel.cp=2", "model.dspark_block_size=12",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "parallel.cp" in lines[0] and "dspark" in lines[0] and "start it with" not in lines[0], err
    assert not (tmp_path / "run").exists()


def test_pipeline_target_layers_must_sit_on_the_last_stage():
    """PP2 runs the drafter on the last stage (tests/dspark/test_parity.py); a target layer on an
    earlier stage is refused before any rank starts, naming the key and the fix."""
    from megatron_s2.training.run_checks import check_drafter_stages

    check_drafter_stages(load_recipe(STAGE, [*QUICK, "parallel.pp=2"]), 2)  # targets 5-7 on layers 4-7
    with pytest.raises(ConfigError, match=r"model.dspark_target_layer_ids: layer\(s\) \[3\] are not on the last"):
        check_drafter_stages(load_recipe(STAGE, [*QUICK, "parallel.pp=2", "model.dspark_target_layer_ids=[3,6,7]"]), 2)
    with pytest.raises(ConfigError, match="parallel.pipeline_layers"):
        check_drafter_stages(load_recipe(STAGE, [*QUICK, "parallel.pp=2", "parallel.pipeline_layers=[6,2]"]), 2)
