"""The pieces composed: orchestrated groups -> advantages -> micro-batches -> objective through the
real tiny model; the objective and gradients do not depend on the micro-batch split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.posttrain.batch import collate
from megatron_s2.config.posttrain import AdvantageConfig, LossConfig, RolloutConfig
from megatron_s2.posttrain.losses import PosttrainObjective
from megatron_s2.posttrain.orchestrator import Orchestrator
from megatron_s2.posttrain.step import global_normalisers, micro_batch_objective
from tests.posttrain.sim_engine import PromptList, SimulatedEngine
from tests.posttrain.tiny import tiny_config

SINGLE = Group.single()


@pytest.fixture(scope="module")
def rollout_batch():
    cfg = RolloutConfig(group_size=2, max_in_flight=8, batch_groups=2, max_staleness=-1)
    pipe = AdvantagePipeline(AdvantageConfig(estimator="group_mean"))
    informative = lambda ss: pipe.informative(GroupRollouts.from_samples(ss))  # noqa: E731
    engine = SimulatedEngine(length=lambda r: 3 + r.seed % 6)
    orch = Orchestrator(cfg, {"default": PromptList(20)}, engine, seed=1, group_filter=informative)
    for _ in range(2):  # one update: samples may span versions 0 and 1
        orch.pump()
        while not orch.batch_ready():
            engine.tick()
            orch.pump()
        groups = orch.begin_training()
        orch.finish_update(orch.version + 1)
        orch.resume()
    adv = pipe.compute([GroupRollouts.from_samples(g.accepted) for g in groups])
    samples = [dataclasses.replace(s, routing=None) for g in groups for s in g.accepted]  # simulated routing
    advantages = [float(a) for res in adv for a in res.advantages]
    return samples, advantages, orch.version - 1  # the learner trains at the version before the update


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(), seed=3)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_objective_and_gradients_do_not_depend_on_the_micro_batch_split(rollout_batch, model, aggregation):
    samples, advantages, version = rollout_batch
    objective = PosttrainObjective(LossConfig(aggregation=aggregation, masks=("bkl",)))

    def run(splits):
        model.zero_grad()
        mbs, first = [], 0
        for part in splits:
            mbs.append(collate([samples[i] for i in part], [advantages[i] for i in part], seq_length=max(len(s.tokens) for s in samples) - 1,
                               first_sequence_id=first))
            first += len(part)
        norm = global_normalisers(mbs, SINGLE)
        total = 0.0
        for mb in mbs:
            logits = model(mb.tokens, ForwardContext.create(mb.tokens, model.plan, routing=mb.routing))
            res = micro_batch_objective(objective, logits, mb, norm, tp=SINGLE, current_version=version)
            res.objective.backward()
            total += float(res.objective)
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, g_whole = run([list(range(len(samples)))])
    split, g_split = run([[0, 2], [1, 3]])
    assert whole == pytest.approx(split, rel=1e-5, abs=1e-7)
    assert g_whole.keys() == g_split.keys() and g_whole
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(float(g.abs().max()) > 0 for g in g_whole.values())
