"""The rollout half of ``PosttrainTrainer.train_step`` over any rollout backend, and the check that
a step's unfiltered ``rollout_*`` metrics cover every episode the backend returned — including
those of the groups dynamic sampling dropped — while ``trained_*`` cover the trained groups."""

from __future__ import annotations

from typing import Callable

import pytest

from megatron_s2.posttrain.metrics import rollout_metrics


def rollout_steps(orch, backend, steps: int, tick: Callable[[], None] | None = None, max_polls: int = 20000):
    """Per step: (trained groups, metrics, every sample the backend returned in the step's window)."""
    returned = []
    poll = backend.poll

    def recording_poll():
        done = poll()
        returned.extend(done)
        return done

    backend.poll = recording_poll
    out, polls = [], 0
    for _ in range(steps):
        if orch.paused:
            orch.resume()
        start = len(returned)
        while not orch.batch_ready():
            if tick is not None:
                tick()
            orch.pump()
            polls += 1
            assert polls < max_polls, "rollouts made no progress"
        groups = orch.begin_training()
        metrics = rollout_metrics(groups, orch.take_outcomes(), current_version=orch.version, max_staleness=0)
        out.append((groups, metrics, returned[start:]))
        orch.finish_update(orch.version + 1)
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def check_unfiltered_metrics(orch, steps, reward_of: Callable) -> None:
    """``reward_of(sample)``: the sample's reward recomputed by the test from what was generated
    (never read from ``sample.reward``); the rubric's verdict is ``reward_of(sample) > 0``."""
    trained_groups = {s.group_id for groups, _, _ in steps for g in groups for s in g.accepted}
    dropped = 0
    for groups, metrics, returned in steps:
        trained = [s for g in groups for s in g.accepted]
        assert metrics["rollout_episodes"] == len(returned)
        if not returned:  # the batch was ready before the step (groups left over): no figure, not a 0
            assert "rollout_reward_mean" not in metrics and "rollout_accuracy" not in metrics
        else:
            assert metrics["rollout_reward_mean"] == pytest.approx(_mean(reward_of(s) for s in returned))
            assert metrics["rollout_accuracy"] == pytest.approx(_mean(float(reward_of(s) > 0) for s in returned))
        assert metrics["trained_reward_mean"] == pytest.approx(_mean(reward_of(s) for s in trained))
        assert metrics["trained_accuracy"] == pytest.approx(_mean(float(reward_of(s) > 0) for s in trained))
        assert all(len({reward_of(s) for s in g.accepted}) > 1 for g in groups)  # DAPO kept mixed groups only
        # episodes of groups neither trained nor still open: those dynamic sampling dropped
        dropped += sum(1 for s in returned if s.group_id not in trained_groups and s.group_id not in orch.groups)
    filtered = sum(m["rollout_filtered_groups"] for _, m, _ in steps)
    assert filtered == orch.ledger["filtered"] > 0, "no group was dropped: the check did not cover dynamic sampling"
    assert dropped == filtered * orch.config.group_size
    assert any(m.get("rollout_reward_mean", m["trained_reward_mean"]) != pytest.approx(m["trained_reward_mean"])
               for _, m, _ in steps)
