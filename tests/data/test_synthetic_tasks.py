"""Synthetic verifiable tasks: samplers, exact verifiers, registry, determinism."""

import random

import pytest

from megatron_s2.config.data import TASK_NAMES, DataConfig, TaskDifficulty
from megatron_s2.data.errors import DataError
from megatron_s2.data.synthetic import build_synthetic_documents, near_miss, noisy_answers, sample_problems
from megatron_s2.data.tasks import TASK_REGISTRY, build_task, build_tasks, is_balanced


def _wrong_answers(task: str, answer: str) -> list[str]:
    if task in ("addition", "multiplication"):
        return [str(int(answer) + 1), str(int(answer) - 1), "0" + answer, answer + "0", f"{answer}=", ""]
    if task == "brackets":
        return ["no" if answer == "yes" else "yes", "", "maybe", answer + answer]
    wrong = [answer + answer[-1], answer[:-1] + ("x" if answer[-1] != "x" else "y"), ""]
    if len(set(answer)) > 1:
        wrong.append(answer[::-1] if answer[::-1] != answer else answer[1:] + answer[0])
    return wrong


def test_registry_matches_config_names():
    assert tuple(TASK_REGISTRY) == TASK_NAMES


@pytest.mark.parametrize("name", TASK_NAMES)
def test_verifier_accepts_reference_and_rejects_wrong_answers(name):
    task = build_task(name)
    rng = random.Random(7)
    for _ in range(200):
        sample = task.sample(rng)
        assert sample.task == name
        assert task.verify(sample.prompt, sample.answer)
        assert task.verify(sample.prompt, f"  {sample.answer}\n")
        for wrong in _wrong_answers(name, sample.answer):
            if wrong != sample.answer:
                assert not task.verify(sample.prompt, wrong), (sample, wrong)


@pytest.mark.parametrize("name, prompt, correct, wrong", [
    ("addition", "12+30", "42", "43"),
    ("addition", "99999999999999999999+1", "100000000000000000000", "1e20"),
    ("multiplication", "12*345", "4140", "4141"),
    ("sort", "sort:31415", "11345", "13145"),
    ("sort", "sort:banana", "aaabnn", "aaanbn"),
    ("copy", "copy:aB3", "aB3", "ab3"),
    ("reverse", "reverse:aB3", "3Ba", "aB3"),
    ("brackets", "balanced:([)]", "no", "yes"),
    ("brackets", "balanced:([]{<>})", "yes", "no"),
])
def test_verifier_recomputes_the_solution_from_the_prompt(name, prompt, correct, wrong):
    task = build_task(name)
    assert task.verify(prompt, correct)
    assert not task.verify(prompt, wrong)


@pytest.mark.parametrize("name, prompt", [
    ("addition", "12*3"), ("multiplication", "12+3"), ("sort", "sort:a1"), ("copy", "copy:"),
    ("reverse", "copy:abc"), ("brackets", "balanced:(a)"),
])
def test_malformed_prompt_is_an_error_naming_the_format(name, prompt):
    with pytest.raises(DataError, match=f"task '{name}'.*does not match the format"):
        build_task(name).verify(prompt, "x")


def test_unknown_task_lists_valid_names():
    with pytest.raises(DataError, match="valid names: addition, multiplication"):
        build_task("division")


def test_difficulty_knobs_bound_the_problems():
    difficulty = TaskDifficulty(addition_max_digits=2, sort_max_length=3, string_max_length=4,
                                brackets_max_length=6, multiplication_max_digits=1)
    tasks = {t.name: t for t in build_tasks(TASK_NAMES, difficulty)}
    rng = random.Random(0)
    for _ in range(300):
        a, b = tasks["addition"].sample(rng).prompt.split("+")
        assert len(a) <= 2 and len(b) <= 2
        assert all(len(x) == 1 for x in tasks["multiplication"].sample(rng).prompt.split("*"))
        assert 1 <= len(tasks["sort"].sample(rng).prompt) - len("sort:") <= 3
        assert len(tasks["reverse"].sample(rng).prompt) - len("reverse:") <= 4
        brackets = tasks["brackets"].sample(rng).prompt[len("balanced:"):]
        assert len(brackets) % 2 == 0 and 2 <= len(brackets) <= 6


@pytest.mark.parametrize("name", TASK_NAMES)
def test_max_prompt_chars_is_the_longest_prompt_a_task_draws(name):
    """The RL start-up check bounds prompt lengths by it instead of drawing a million prompts: it
    must never be exceeded, and is reached (so it is not a loose guess)."""
    difficulty = TaskDifficulty(addition_max_digits=2, sort_max_length=3, string_max_length=4,
                                brackets_max_length=7, multiplication_max_digits=2)
    task, rng = build_task(name, difficulty), random.Random(1)
    lengths = [len(task.sample(rng).prompt.encode("utf-8")) for _ in range(2000)]
    assert max(lengths) == task.max_prompt_chars


def test_brackets_are_half_balanced_and_balance_check_is_exact():
    task = build_task("brackets", TaskDifficulty(brackets_max_length=20))
    rng = random.Random(3)
    answers = [task.sample(rng).answer for _ in range(1000)]
    assert 0.4 < answers.count("yes") / len(answers) < 0.6
    assert is_balanced("") and is_balanced("<[{()}]>()") and not is_balanced("(]") and not is_balanced("((")
    assert not is_balanced(")(")


def test_problem_streams_are_deterministic_in_the_seed():
    tasks = build_tasks(TASK_NAMES)
    first = sample_problems(tasks, 300, seed=11)
    assert first == sample_problems(tasks, 300, seed=11)
    assert first != sample_problems(tasks, 300, seed=12)
    assert {p.task for p in first} == set(TASK_NAMES)


def test_near_miss_is_the_last_digit_one_higher_and_always_wrong():
    assert [near_miss(a) for a in ("0", "57", "39", "199", "100")] == ["1", "58", "30", "190", "101"]
    task = build_task("addition", TaskDifficulty(addition_max_digits=2))
    rng = random.Random(5)
    for _ in range(300):
        sample = task.sample(rng)
        wrong = near_miss(sample.answer)
        assert len(wrong) == len(sample.answer) and not task.verify(sample.prompt, wrong)
    with pytest.raises(ValueError, match="near_miss: needs a decimal integer answer"):
        near_miss("yes")


def test_noisy_teacher_keeps_the_problems_and_corrupts_the_stated_share():
    problems = sample_problems(build_tasks(("addition", "multiplication")), 4000, seed=3)
    pairs = noisy_answers(problems, 0.35, seed=3)
    assert [q for q, _ in pairs] == [p.prompt for p in problems]
    corrupted = [(a, p.answer) for (_, a), p in zip(pairs, problems) if a != p.answer]
    assert all(a == near_miss(answer) for a, answer in corrupted)
    assert abs(len(corrupted) / len(problems) - 0.35) < 0.03
    assert pairs == noisy_answers(problems, 0.35, seed=3) and pairs != noisy_answers(problems, 0.35, seed=4)
    assert noisy_answers(problems, 0.0, seed=3) == [(p.prompt, p.answer) for p in problems]


def test_near_miss_fraction_reaches_the_synthetic_documents():
    from megatron_s2.data.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    clean = build_synthetic_documents(DataConfig(tasks=("addition",), num_documents=400), 9, tokenizer)
    noisy = build_synthetic_documents(DataConfig(tasks=("addition",), num_documents=400, near_miss_fraction=0.5), 9, tokenizer)
    changed = sum(clean.tokens(i).tolist() != noisy.tokens(i).tolist() for i in range(len(clean)))
    assert len(clean) == len(noisy) == 400 and 150 < changed < 250
