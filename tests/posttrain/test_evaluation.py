"""Held-out evaluation (posttrain/rollout/evaluation.py): avg@k over several sampled episodes
per prompt, reproducible draws, and the greedy/k>1 refusal."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.tokenizer import CharTokenizer
from megatron_s2.inference import EngineConfig, InferenceEngine
from megatron_s2.models.v41.model import build_model
from megatron_s2.config.posttrain.environment import EnvironmentConfig, EvaluationConfig
from megatron_s2.posttrain.envs import TaskEnvironment
from megatron_s2.posttrain.rollout.evaluation import Evaluator
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
from tests.posttrain.tiny import tiny_config

TOK = CharTokenizer()


def _evaluator(config: EvaluationConfig) -> Evaluator:
    torch.set_num_threads(1)
    model = build_model(tiny_config(), seed=5).eval()
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=8, max_model_len=24, page_tokens=8),
                             eos_token_ids=[TOK.eos_id])
    env = TaskEnvironment("add", EnvironmentConfig(kind="task", task="addition", num_prompts=8, eval_prompts=5), TOK)
    return Evaluator(engine, {"add": env}, ReplicaTopology.single(), config, max_new_tokens=6, max_model_len=24)


def test_samples_per_prompt_averages_k_seeded_episodes_per_prompt():
    ev = _evaluator(EvaluationConfig(temperature=1.0, samples_per_prompt=3))
    assert ev.episodes() == [it for it in ev.mine() for _ in range(3)]
    played = ev.play(ev.engine, ev.episodes(), 1.0)
    first = ev.run(0)
    assert first["eval_prompts"] == 5 and first["eval_episodes"] == 15
    assert first["eval_accuracy"] == pytest.approx(sum(p.correct for p in played) / 15)
    assert first["eval_response_length"] == pytest.approx(sum(p.generated for p in played) / 15)
    responses = [tuple(p.response) for p in played]
    assert len(set(responses)) > 5, "the k episodes of a prompt drew the same tokens (seeds not distinct)"
    assert ev.run(1) == first, "two evaluations of the same weights must draw the same random numbers"


def test_greedy_evaluation_with_several_samples_is_refused():
    with pytest.raises(ConfigError, match="samples_per_prompt: 2 greedy episodes"):
        EvaluationConfig(temperature=0.0, samples_per_prompt=2)
    with pytest.raises(ConfigError, match="samples_per_prompt: must be >= 1"):
        EvaluationConfig(temperature=1.0, samples_per_prompt=0)


class _FirstTokenEven(TaskEnvironment):
    """Correct when the first generated token id is even: a random model scores ~0.5, and its
    greedy and sampled accuracies differ, which the addition verifier (~0 for both) cannot show."""

    class episode_type(TaskEnvironment.episode_type):
        def verify(self, completion, finish_reason) -> bool:
            return bool(completion) and completion[0] % 2 == 0


@pytest.mark.slow
def test_also_greedy_reports_the_greedy_accuracy_beside_the_sampled_one():
    ev = _evaluator(EvaluationConfig(temperature=1.0, samples_per_prompt=3, also_greedy=True))
    cfg = EnvironmentConfig(kind="task", task="addition", num_prompts=8, eval_prompts=16)
    ev.envs = {"even": _FirstTokenEven("even", cfg, TOK)}
    greedy = ev.play(ev.engine, ev.mine(), 0.0)
    sampled = ev.play(ev.engine, ev.episodes(), 1.0)
    out = ev.run(0)
    assert out["eval_greedy_accuracy"] == pytest.approx(sum(p.correct for p in greedy) / 16)
    assert out["eval_accuracy"] == pytest.approx(sum(p.correct for p in sampled) / 48)
    assert out["eval_episodes"] == 48, "the greedy episodes must not count as sampled ones"
    assert 0 < out["eval_greedy_accuracy"] < 1 and out["eval_greedy_accuracy"] != out["eval_accuracy"]
    ev.config = EvaluationConfig(temperature=1.0, samples_per_prompt=3)
    assert "eval_greedy_accuracy" not in ev.run(0)
    with pytest.raises(ConfigError, match="also_greedy: the evaluation is already greedy"):
        EvaluationConfig(temperature=0.0, also_greedy=True)
