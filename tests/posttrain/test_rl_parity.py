"""RL / OPD optimiser steps under every training layout against the single-rank run (issue 14:
"works under every training layout the trainer supports"; charter: parity is the test of
parallelism — fp32 on CPU, same seed, same data).

One fixed rollout batch (built once from the single-rank policy, :func:`rollout_batch`): two
groups of four samples of exact token ids with prompt/response loss masks, rewards, behaviour
log-probabilities near the policy's (so the truncated importance weight and the BKL mask both
act), tokens from two policy versions, and a concatenated R3 routing record per sample whose
second segment was routed by perturbed routers (report §5.2.1). Every layout trains on it with
the real :class:`~megatron_s2.posttrain.trainer.PosttrainTrainer` (its ``_train_on``: advantages
-> micro-batches -> CP split -> the layout's schedule -> gradient reduction, then
``apply_gradients``) for two optimiser steps, and must reproduce the single-rank loss, gradient
norm, loss statistics, the per-token policy log-probabilities the loss computed, the gradients
of the first step and every parameter after the second step (gathered to full shape).

R3 replays the same experts in every layout, so MoE routing cannot flip; tolerances are those of
the pre-training parity tests (tests/parallel/parity.py TOLERANCES).
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from tests.parallel.parity import (ENGRAM_GATE_AND_TABLE, MHC_COEFFICIENTS, TOLERANCES, _shards, assemble,
                                   assert_close, load_records)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "phases" / "rl_addition.yaml"
BASE = ["training.seq_length=32", "training.global_batch_size=8", "training.micro_batch_size=4",
        "rl.rollout.group_size=4", "rl.rollout.batch_groups=2", "rl.rollout.max_in_flight=8",
        "rl.rollout.engine.max_num_seqs=8", "rl.eval.interval=0", "rl.eval.at_start=false",
        "rl.rollout.environment.num_prompts=16", "rl.rollout.environment.eval_prompts=2",
        "rl.advantage.dynamic_sampling=false", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.save_at_end=false", "schedule.lr=1e-3", "schedule.min_lr=1e-3",
        "optimizer.adamw_eps=1e-8"]  # see tests/parallel/parity.py BASE
SEQ, GROUP, GROUPS = 32, 4, 2  # CP2: chunks of 8 tokens = the SWA window
CURRENT = 2
"""The learner's version when the batch trains: tokens of versions 1 and 2 (max_staleness 2)."""
STEPS = 2
MBS = 4
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "dp2": [],
    "pp2": ["parallel.pp=2"],
    "ep2": ["parallel.ep=2"],
    "cp2": ["parallel.cp=2"],
}


def build_trainer(overrides: list[str], run_dir: Path, rank: int, world: int):
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.posttrain.trainer import PosttrainTrainer

    recipe = load_recipe(RECIPE, [*BASE, *overrides, f"training.run_dir={run_dir}"])
    return PosttrainTrainer(recipe, run_dir, rank=rank, world_size=world, log=lambda *a, **k: None)


@torch.no_grad()
def rollout_batch(model, seed: int = 7) -> list:
    """Eight samples (two groups) from the single-rank policy ``model`` (module docstring)."""
    from megatron_s2.models.v41.context import ForwardContext
    from megatron_s2.models.v41.moe import RoutingMode, RoutingReplay
    from megatron_s2.posttrain.orchestrator import RolloutSample
    from megatron_s2.posttrain.routing import RoutingRecord

    gen = torch.Generator().manual_seed(seed)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    rows = GROUP * GROUPS
    lengths = [SEQ + 1 - 3 * (i % 4) for i in range(rows)]  # some rows padded
    prompts = [3 + i % 3 for i in range(rows)]
    cuts = [p + (n - p) // 2 for p, n in zip(prompts, lengths)]  # tokens from `cut` on: version 2
    ids = torch.randint(3, 128, (rows, SEQ + 1), generator=gen)
    routers = list(model.routers())
    model.eval()  # a training-mode forward would count tokens into the routers' expert loads

    def record(perturb: float) -> RoutingReplay:
        saved = [r.weight.clone() for r in routers]
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * perturb)
        rec = RoutingReplay(RoutingMode.RECORD)
        model(ids[:, :-1], ForwardContext.create(ids[:, :-1], model.plan, routing=rec))
        for r, w in zip(routers, saved):
            r.weight.copy_(w)
        return rec

    first, second = record(0.0), record(0.5)  # segment 2 routed by other routers than the policy's
    routing = []
    for i, (n, cut) in enumerate(zip(lengths, cuts)):
        a = RoutingRecord.from_replay(first, row=i, positions=slice(0, cut - 1), version=1)
        b = RoutingRecord.from_replay(second, row=i, positions=slice(cut - 1, n - 1), start=cut - 1, version=2)
        routing.append(RoutingRecord.concatenate([a, b]))
    replay = RoutingRecord.batch([[r] for r in routing], SEQ)
    logits = model(ids[:, :-1], ForwardContext.create(ids[:, :-1], model.plan, routing=replay))
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:].unsqueeze(-1))[..., 0]
    lp = lp + torch.randn(lp.shape, generator=gen, dtype=torch.float64) * 0.15  # importance weights != 1
    lp[:, ::5] = math.log(0.5)  # far from the policy's probability: the BKL mask drops these tokens
    samples = []
    for i, (n, prompt, cut) in enumerate(zip(lengths, prompts, cuts)):
        mask = [t >= prompt for t in range(n)]
        behaviour = [0.0] + [min(float(x), -1e-6) for x in lp[i, :n - 1]]
        samples.append(RolloutSample(
            sample_id=i, tokens=ids[i, :n].tolist(), policy_mask=mask,
            logprobs=[b if m else 0.0 for b, m in zip(behaviour, mask)],
            versions=[(1 if t < cut else 2) if m else -1 for t, m in enumerate(mask)], prompt_length=prompt,
            group_id=i // GROUP, prompt_uid=f"default:0:{i // GROUP}", dataset="default", routing=routing[i],
            reward=rewards[i], finish_reason="stop"))
    model.train()
    return samples


def _train(trainer, samples: list) -> dict:
    """STEPS optimiser steps of ``trainer`` on ``samples``; the record the parent compares."""
    import megatron_s2.posttrain.train_batch as train_batch
    import megatron_s2.posttrain.trainer as trainer_module

    logprobs: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []

    class RecordingLoss(trainer_module.PosttrainLoss):
        """The trainer's loss; keeps the per-token log-probabilities it computed."""

        def __call__(self, model, logits, mb, ctx):
            original = train_batch.token_log_probs

            def spy(*args, **kwargs):
                lp = original(*args, **kwargs)
                logprobs.append(lp.detach().clone())
                return lp

            train_batch.token_log_probs = spy
            try:
                return super().__call__(model, logits, mb, ctx)
            finally:
                train_batch.token_log_probs = original
                positions.append(mb["position_ids"].clone())

    groups = [types.SimpleNamespace(accepted=samples[g * GROUP:(g + 1) * GROUP]) for g in range(GROUPS)]
    saved, trainer_module.PosttrainLoss = trainer_module.PosttrainLoss, RecordingLoss
    record: dict = {"losses": [], "grad_norms": [], "stats": []}
    try:
        trainer.step = CURRENT
        for step in range(STEPS):
            trainer.schedule.apply(trainer.optimizer, trainer.step)
            result, stats, _ = trainer._train_on(samples, groups)
            if step == 0:
                record["grads"] = _shards(trainer.model.named_parameters(), "grad")
                record["logprobs"], record["positions"] = list(logprobs), list(positions)
            record["losses"].append(result.loss)
            record["stats"].append(stats)
            record["grad_norms"].append(trainer.apply_gradients(result.loss))
    finally:
        trainer_module.PosttrainLoss = saved
    record["params"] = _shards(trainer.model.named_parameters(), "")
    record["buffers"] = {n: b.detach().clone() for n, b in trainer.model.named_buffers() if "bias" in n}
    record["dp_rank"], record["dp"] = trainer.dp_rank, trainer.layout.dp
    return record


def _run_layouts(rank: int, world: int, root: str, states: list[dict], layouts: dict[str, list[str]]) -> None:
    from megatron_s2.posttrain.orchestrator import RolloutSample

    samples = [RolloutSample.from_state_dict(s) for s in states]
    for name, overrides in layouts.items():
        out = Path(root) / name
        out.mkdir(parents=True, exist_ok=True)
        trainer = build_trainer(overrides, out / "run", rank, world)
        torch.save(_train(trainer, samples), out / f"rank{rank}.pt")


def token_logprobs(record: dict, micro_batch_size: int) -> dict[tuple[int, int], float]:
    """(global row, position) -> the log-probability the rank's loss computed."""
    per_rank = GROUP * GROUPS // record["dp"]
    out = {}
    for k, (lp, pos) in enumerate(zip(record["logprobs"], record["positions"])):
        for r in range(lp.size(0)):
            row = record["dp_rank"] * per_rank + k * micro_batch_size + r
            for j in range(lp.size(1)):
                out[(row, int(pos[r, j]))] = float(lp[r, j])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.parallel.spawn import run_distributed

    root = tmp_path_factory.mktemp("rl_parity")
    (root / "reference").mkdir()
    trainer = build_trainer([], root / "reference" / "run", 0, 1)
    samples = rollout_batch(trainer.model)
    torch.save(_train(trainer, samples), root / "reference" / "rank0.pt")
    run_distributed(2, _run_layouts, str(root), [s.state_dict() for s in samples], LAYOUTS)
    return root, load_records(root / "reference", 1)[0]


def test_the_batch_exercises_the_importance_weight_the_bkl_mask_and_two_versions(results):
    _, ref = results
    stats = ref["stats"][0]
    assert 0.0 < stats["masked_bkl"] < 0.6, stats  # some tokens masked by BKL, most kept
    assert stats["importance_weight"] != pytest.approx(1.0, abs=1e-3), stats
    assert ref["losses"][0] != 0.0 and all(g > 0 for g in ref["grad_norms"])
    assert ref["losses"][1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the first step moved the policy


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rl_steps_match_single_rank(results, layout):
    root, ref = results
    records = load_records(root / layout, 2)
    tol = TOLERANCES
    for rec in records:
        assert rec["losses"] == pytest.approx(ref["losses"], rel=1e-6), layout
        assert rec["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), layout
        for got, want in zip(rec["stats"], ref["stats"]):
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), f"{layout}: {key}"
        for name, value in rec["buffers"].items():
            assert (value - ref["buffers"][name]).abs().max() <= 1e-6, f"{layout}: buffer {name}"
    want_lp = token_logprobs(ref, MBS)
    got_lp: dict = {}
    for rec in records:
        for key, value in token_logprobs(rec, MBS).items():
            assert got_lp.setdefault(key, value) == value, f"{layout}: ranks disagree on token {key}"
    assert got_lp.keys() == want_lp.keys(), f"{layout}: tokens scored differ"
    worst = max(abs(got_lp[k] - want_lp[k]) for k in want_lp)
    assert worst <= 1e-5, f"{layout}: per-token log-probabilities differ by up to {worst:.2e}"
    assert_close(assemble(records, "grads"), assemble([ref], "grads"), f"{layout} gradients", tol["grad_rtol"],
                 floor=tol["grad_floor"], loose=(ENGRAM_GATE_AND_TABLE, tol["engram_grad_rtol"]))
    assert_close(assemble(records, "params"), assemble([ref], "params"), f"{layout} parameters after {STEPS} steps",
                 tol["param_rtol"], loose=(MHC_COEFFICIENTS, tol["mhc_param_rtol"]))
