"""Held-out evaluation (posttrain/rollout/evaluation.py): avg@k over several sampled episodes
per prompt, reproducible draws, and the greedy/k>1 refusal."""

from __future__ import annotations

import pytest
import torch

from megatron_s2.config.data import TaskDifficulty
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


@pytest.mark.slow
def test_two_teachers_report_each_domains_distance_beside_the_pooled_one():
    """Two experts, one student (walkthrough Ch. 8): with one teacher per domain, every teacher
    metric is reported per domain too, and the pooled value is the token-weighted mean of them."""
    from megatron_s2.parallel.groups import ParallelGroups
    from megatron_s2.posttrain.frozen import TeacherPool

    ev = _evaluator(EvaluationConfig(temperature=1.0, samples_per_prompt=2))
    cfg = EnvironmentConfig(kind="task", task="addition", num_prompts=8, eval_prompts=4)
    ev.envs = {"add": TaskEnvironment("add", cfg, TOK),
               "sort": TaskEnvironment("sort", EnvironmentConfig(kind="task", task="sort", num_prompts=8,
                                                                 eval_prompts=4, difficulty=TaskDifficulty(sort_max_length=4)), TOK)}
    teachers = {name: build_model(tiny_config(), seed=seed).eval() for name, seed in (("a", 11), ("b", 12))}
    pool = TeacherPool(teachers, {"add": "a", "sort": "b"}, {"a": 1.0, "b": 1.0})
    out = ev.run(0, teacher=(pool, {"add": "add", "sort": "sort"}), scorer_groups=ParallelGroups())
    for metric in ("student_logprob_teacher", "teacher_logprob_teacher", "kl_to_teacher"):
        pooled, add, sort = (out[f"eval_{metric}{suffix}"] for suffix in ("", "_add", "_sort"))
        assert min(add, sort) <= pooled <= max(add, sort) and add != sort, (metric, add, sort, pooled)
    assert out["eval_kl_to_teacher_add"] > 0 and out["eval_kl_to_teacher_sort"] > 0
    # one domain: no per-domain keys (the pooled value is that domain's)
    ev.envs = {"add": ev.envs["add"]}
    ev._teacher_answers = None
    single = ev.run(0, teacher=(TeacherPool(teachers, {"add": "a"}, {"a": 1.0}), {"add": "add"}),
                    scorer_groups=ParallelGroups())
    assert "eval_kl_to_teacher_add" not in single and "eval_kl_to_teacher" in single
