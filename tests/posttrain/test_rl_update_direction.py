"""The RL update moves the policy the way the advantage says (issue 14's RL-does-not-learn hunt).

One rollout sample -> :func:`~megatron_s2.posttrain.batch.collate` -> the objective through the
real tiny model -> one plain gradient step: a positive advantage must raise the log-probability
of the sample's completion, a negative one must lower it, and only the completion's labels
(EOS included; not the prompt, not the padding) may carry loss.
"""

from __future__ import annotations

import pytest
import torch

from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.batch import collate
from megatron_s2.config.posttrain import LossConfig
from megatron_s2.posttrain.losses import PosttrainObjective
from megatron_s2.posttrain.orchestrator import RolloutSample
from megatron_s2.posttrain.step import global_normalisers, micro_batch_objective
from tests.posttrain.tiny import tiny_config

SINGLE = Group.single()
PROMPT, COMPLETION = [1, 5, 6, 7], [8, 9, 10, 2]  # bos + prompt, completion + eos (id 2)
SEQ = len(PROMPT) + len(COMPLETION) - 1 + 3       # three padding positions


def _sample() -> RolloutSample:
    n, m = len(PROMPT), len(COMPLETION)
    return RolloutSample(0, PROMPT + COMPLETION, [False] * n + [True] * m, [0.0] * n + [-2.0] * m, [-1] * n + [0] * m)


def _completion_logprob(model) -> float:
    ids = torch.tensor([PROMPT + COMPLETION[:-1]])
    with torch.no_grad():
        logits = model(ids, ForwardContext.create(ids, model.plan)).float()
    lp = torch.log_softmax(logits, -1)[0, len(PROMPT) - 1:, :]
    return float(lp.gather(-1, torch.tensor(COMPLETION).unsqueeze(-1)).sum())


def test_loss_mask_covers_the_completion_and_eos_only():
    batch = collate([_sample()], [1.0], SEQ)
    labels, mask = batch.labels[0], batch.loss_mask[0]
    assert labels[mask].tolist() == COMPLETION
    assert not mask[:len(PROMPT) - 1].any() and not mask[len(PROMPT) + len(COMPLETION) - 1:].any()
    assert batch.advantages[0][mask].eq(1.0).all() and batch.advantages[0][~mask].eq(0.0).all()


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_step_moves_the_completion_log_probability_with_the_sign_of_the_advantage(advantage):
    model = build_model(tiny_config(), seed=3)
    before = _completion_logprob(model)
    batch = collate([_sample()], [advantage], SEQ)
    objective = PosttrainObjective(LossConfig(masks=()))
    logits = model(batch.tokens, ForwardContext.create(batch.tokens, model.plan))
    res = micro_batch_objective(objective, logits, batch, global_normalisers([batch], SINGLE), tp=SINGLE,
                                current_version=0)
    res.objective.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    change = _completion_logprob(model) - before
    assert change * advantage > 0.5, (before, change)
