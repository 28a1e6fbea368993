"""An ``rl`` phase on the agentic tasks (``rollout.environment.kind: agentic``; issue 25).

Fast: the configuration and pre-flight refusals (one line, naming the key), and the seeded task
instances with their held-out split. Slow: two steps end to end on CPU with the tiny model and the
BPE tokenizer — the co-located engine served in-process with the agent gateway, the builtin harness
playing copy_word instances in real sandboxes; the engine is steered (``ScriptedPolicy``) so that in
each group one episode plays the instance's reference solution and the other submits at once. Every
trained sample is exactly what the engine generated (each policy span = one engine request's
output, its context = that request's prompt), carries the grade and the process weights, the
advantage on its tokens is Eq. 30 of the group's leave-one-out advantage
(``group_token_advantages``), the step's metrics count every episode, and the held-out instances
are evaluated through the same gateway into eval.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_s2.config.posttrain.agentic import AGENT_HARNESSES
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.agentic.harnesses import HARNESSES
from megatron_s2.posttrain.agentic.sandbox import SandboxUnavailable, detect_runtime
from megatron_s2.posttrain.agentic.tasks import WORD_LENGTH, task_variant, task_variants, variant_split
from megatron_s2.config.posttrain.agentic import SandboxConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "phases" / "rl_agentic.yaml"
EOS = "<｜end▁of▁sentence｜>"


# ---- configuration and pre-flight ------------------------------------------------------------------
def test_the_config_knows_every_harness_adapter():
    assert set(AGENT_HARNESSES) == set(HARNESSES)


@pytest.mark.parametrize("override, message", [
    ("rl.rollout.environment.agent={harness: codex}",
     "rl.rollout.environment.agent.harness: unknown harness 'codex'; known: builtin, openai_agents"),
    ("rl.rollout.environment.agent={harness: builtin, max_tokens: 9}",
     "rl.rollout.environment.agent.max_tokens: not a setting"),
    ("rl.rollout.environment.agent={harness: builtin, api: responses}",
     "rl.rollout.environment.agent.api: 'responses'"),
    ("rl.rollout.environment.agent={harness: builtin, declare_tools: false}",
     "rl.rollout.environment.agent.declare_tools: only with harness: anthropic (got harness: builtin"),
    ("rl.rollout.environment.agent={harness: anthropic, declare_tools: 0}",
     "rl.rollout.environment.agent.declare_tools: 0 — expected true or false"),
    ("rl.rollout.environment.tasks=[]", "rl.rollout.environment.tasks: an agentic environment needs its tasks"),
    ("rl.rollout.environment.sandbox={backend: docker}", "sandbox.backend: 'docker' is not one of"),
    ("data.tokenizer=char", "data.tokenizer: the agent gateway renders"),
    ("rl.effort={levels: [1, 2], samples_per_level: 2}", "rl.effort.levels: effort-conditioned prompts"),
    ("rl.rollout.engine.train_aware_replay=true", "not supported with verifiers or agentic environments"),
    ("rl.advantage.credit=turn", "rl.advantage.credit: turn needs a reward per assistant turn"),
])
def test_a_recipe_that_cannot_run_is_refused_in_one_line(override, message):
    extra = ["rl.rollout.engine.decoder_bounded_replay=true"] if "train_aware" in override else []
    with pytest.raises(ConfigError) as err:
        load_recipe(str(RECIPE), [override, *extra])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_loading_the_recipe_does_not_import_torch():
    import subprocess
    import sys

    code = (f"import sys; from megatron_s2.config.recipe import load_recipe; load_recipe({str(RECIPE)!r}, []); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def _environment(*overrides):
    from megatron_s2.data.tokenizer import load_tokenizer
    from megatron_s2.posttrain.envs import build_environment

    recipe = load_recipe(str(RECIPE), list(overrides))
    tokenizer = load_tokenizer(ROOT / "recipes/tokenizers/tiny-bpe")
    return build_environment("default", recipe.rl.rollout.environment, tokenizer, what="rl.rollout.environment")


@pytest.mark.parametrize("override, message", [
    ("rl.rollout.environment.tasks=[copy_word, sum_pairs]", "rl.rollout.environment.tasks: unknown agentic task "
     "'sum_pairs'; known: archive_logs"),
    ("rl.rollout.environment.tasks=[fix_median]", "rl.rollout.environment.eval_prompts: agentic tasks ['fix_median'] "
     "have no variants"),
])
def test_the_environment_refuses_unknown_tasks_by_key(override, message):
    with pytest.raises(ConfigError) as err:
        _environment(override)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_sandbox_says_how_to_install_bubblewrap(monkeypatch):
    from megatron_s2.posttrain.envs import agentic_env

    def unavailable(config):
        raise SandboxUnavailable("sandbox.backend=bwrap: no isolation backend works here (bwrap: not found); install "
                                 "bubblewrap (apt-get install bubblewrap) or allow unprivileged user namespaces")

    monkeypatch.setattr(agentic_env, "detect_runtime", unavailable)
    with pytest.raises(ConfigError) as err:
        _environment()
    assert str(err.value).startswith("rl.rollout.environment.sandbox.backend: ")
    assert "apt-get install bubblewrap" in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("rl.rollout.environment.tasks=[copy_word, sum_pairs]", "rl.rollout.environment.tasks: unknown agentic task "
     "'sum_pairs'; known: archive_logs"),
    ("rl.rollout.environment.eval_prompts=100000", "rl.rollout.environment.eval_prompts: agentic tasks "
     "['copy_word', 'sum_pair']: fewer than 100000 distinct eval instances exist"),
])
def test_the_launch_preflight_refuses_unknown_tasks_and_too_many_held_out_instances(override, message):
    """The launch pre-flight (no environments built: no sandbox probe) refuses what the trainer's
    environment would — before a pipeline's SFT phase runs for half an hour — and fast: asking for
    more held-out instances than exist must not draw 200 seeds per asked-for instance."""
    import time

    from megatron_s2.posttrain.checks import check_posttrain_inputs

    recipe = load_recipe(str(RECIPE), [override])
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        check_posttrain_inputs(recipe, None)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert time.perf_counter() - t0 < 10


# ---- task instances ------------------------------------------------------------------------------------
def test_task_instances_are_seeded_and_the_held_out_split_is_disjoint():
    a, b = task_variant("sum_pair", 7, max_operand=9), task_variant("sum_pair", 7, max_operand=9)
    assert a == b and len({task_variant("sum_pair", k, max_operand=9).variant for k in range(20)}) > 10
    x, y = (int(v) for v in a.files["input.txt"].split())
    assert max(x, y) <= 9 and a.reference[1]["arguments"] == {"path": "answer.txt", "content": str(x + y)}
    train = task_variants(["copy_word", "sum_pair"], "train", 400, seed=0, max_operand=9)
    held = task_variants(["copy_word", "sum_pair"], "eval", 24, seed=0, max_operand=9, distinct=True)
    assert [t.name for t in train[:4]] == ["copy_word", "sum_pair"] * 2
    assert all(variant_split(t) == "train" for t in train) and all(variant_split(t) == "eval" for t in held)
    assert len({(t.name, t.variant) for t in held}) == 24
    assert not {(t.name, t.variant) for t in held} & {(t.name, t.variant) for t in train}
    assert task_variants(["copy_word"], "train", 5, seed=3) == task_variants(["copy_word"], "train", 5, seed=3)
    words = [t.files["word.txt"].strip() for t in train if t.name == "copy_word"]
    assert all(len(w) == WORD_LENGTH and w.isalpha() and w.islower() for w in words)
    assert len(set(words)) > 0.9 * len(words)  # random letters, not a list whose spellings a policy can memorise


def test_spot_seven_instances_are_balanced_and_answered_by_their_reference():
    from megatron_s2.posttrain.agentic.tasks import SEVEN_DIGITS

    train = task_variants(["spot_seven"], "train", 400, seed=0)
    held = task_variants(["spot_seven"], "eval", 48, seed=0, distinct=True)
    assert not {t.variant for t in held} & {t.variant for t in train}
    for task in train + held:
        digits = task.files["input.txt"].split()
        assert len(digits) == SEVEN_DIGITS and all(len(d) == 1 and d.isdigit() for d in digits)
        assert digits.count("7") <= 1  # one 7 or none: the answer is a single fact about the file
        write = task.reference[1]
        assert write["name"] == "write_file" and list(write["arguments"]) == ["content", "path"]  # answer first
        assert write["arguments"] == {"content": "yes" if "7" in digits else "no", "path": "answer.txt"}
    yes = sum(t.reference[1]["arguments"]["content"] == "yes" for t in train) / len(train)
    assert 0.4 < yes < 0.6  # not answering from the file scores about 1/2


def _spot_seven_plays():
    """(calls, expected reward) on one instance with a 7 and one without."""
    seven, none = (next(t for t in task_variants(["spot_seven"], "train", 40, seed=5)
                        if ("7" in t.files["input.txt"].split()) == has) for has in (True, False))
    write = lambda content, path="answer.txt": {"name": "write_file", "arguments": {"content": content, "path": path}}
    submit = {"name": "submit", "arguments": {}}
    return [
        (seven, list(seven.reference), 1.0), (none, list(none.reference), 1.0),
        (seven, [write("no"), submit], 0.0), (none, [write("yes"), submit], 0.0),  # the wrong answer
        (seven, [write("yes\nno"), submit], 0.0), (none, [write("no yes"), submit], 0.0),  # both answers
        (none, [write("7 7 7 7\n", "input.txt"), write("yes"), submit], 0.0),  # the input is overlaid last
        (seven, [{"name": "bash", "arguments": {"command": "echo YES > answer.txt"}}, submit], 0.0),
        (seven, [submit], 0.0),  # no answer
    ]


def test_spot_seven_grades_the_answer_not_the_agents_copy_of_the_input():
    """Graded after the agent stopped, on the canonical input: the reference scores 1; the wrong
    answer, both answers, a rewritten input or no answer score 0."""
    from megatron_s2.posttrain.agentic.runner import run_episode, scripted_policy

    try:
        runtime = detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    for task, calls, reward in _spot_seven_plays():
        result = run_episode(task, scripted_policy(calls), runtime)
        assert result.reward == reward, (task.variant, calls, result.status)


def test_the_anthropic_harness_may_name_the_tools_without_declaring_them():
    env = _environment("rl.rollout.environment.agent={harness: anthropic, declare_tools: false}")
    assert env.settings(temperature=1.0, max_tokens=8).declare_tools is False
    assert _environment("rl.rollout.environment.agent={harness: anthropic}").settings(
        temperature=1.0, max_tokens=8).declare_tools is True


def test_sft_records_may_declare_the_tools_as_the_anthropic_harness_does(tmp_path):
    from megatron_s2.posttrain.agentic.sft_traces import write_sft_jsonl
    from megatron_s2.posttrain.agentic.tools import tool_schemas

    try:
        runtime = detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    tasks = task_variants(["spot_seven"], "train", 1, seed=0)
    write_sft_jsonl(tmp_path / "a.jsonl", tasks, runtime, declare_tools=True)
    write_sft_jsonl(tmp_path / "b.jsonl", tasks, runtime)
    declared, named = (json.loads((tmp_path / f).read_text()) for f in ("a.jsonl", "b.jsonl"))
    assert declared == {**named, "tools": tool_schemas()} and "tools" not in named


def test_an_instance_is_solved_by_its_reference_and_graded_on_its_own_input():
    """The reference of instance k solves instance k in a real sandbox and fails another instance
    (the grader reads the instance's input, overlaid last)."""
    from megatron_s2.posttrain.agentic.runner import run_episode, scripted_policy

    try:
        runtime = detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    one, other = task_variants(["copy_word"], "train", 2, seed=11)
    assert one.variant != other.variant
    assert run_episode(one, scripted_policy(one.reference), runtime).reward == 1.0
    assert run_episode(other, scripted_policy(one.reference), runtime).reward == 0.0


# ---- end to end ----------------------------------------------------------------------------------------
SMALL = ["training.train_steps=2", "training.seq_length=832", "training.global_batch_size=2",
         "training.micro_batch_size=2", "rl.rollout.group_size=2", "rl.rollout.batch_groups=1",
         "rl.rollout.max_in_flight=2", "rl.rollout.max_new_tokens=64", "rl.rollout.engine.max_num_seqs=2",
         "rl.rollout.environment.max_concurrent=1", "rl.rollout.environment.tasks=[copy_word]",
         "rl.rollout.environment.max_turns=3", "rl.rollout.environment.num_prompts=8",
         "rl.rollout.environment.eval_prompts=2", "rl.advantage.dynamic_sampling=false",
         "rl.eval={interval: 2, at_start: false, temperature: 1.0}", "checkpoint.save_interval=0",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_rl_on_agentic_episodes_trains_the_engines_tokens(tmp_path, monkeypatch, one_thread):
    from megatron_s2.posttrain import batch as batch_module
    from megatron_s2.posttrain.agentic.gateway_episode import group_token_advantages
    from megatron_s2.posttrain.agentic.tools import format_call
    from megatron_s2.posttrain.rollout import agentic_backend
    from megatron_s2.posttrain.trainer import PosttrainTrainer
    from tests.serve.test_gateway import ScriptedPolicy

    try:
        detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    recipe = load_recipe(str(RECIPE), SMALL)
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    tok, engine = trainer.tokenizer, trainer.engine
    policy = ScriptedPolicy(engine)
    calls: dict[str, dict] = {}
    add_request = engine.add_request

    def spy(prompt, params=None, *, request_id=None, on_output=None, **kwargs):
        rec = calls[request_id] = {"prompt": list(prompt), "ids": [], "versions": []}

        def out(o):
            rec["ids"] += list(o.token_ids)
            rec["versions"] += list(o.versions)
            on_output(o)
        return add_request(prompt, params, request_id=request_id, on_output=out, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    played, episodes = [], {}
    play = agentic_backend.AgenticBackend._play

    def scripted_play(self, env, task, session, **kw):  # one call at a time (max_concurrent: 1)
        if session.startswith("ep"):  # training: reference solution, then an immediate submit, in turn
            script = task.reference if len(played) % 2 == 0 else [{"name": "submit", "arguments": {}}]
            policy.queue[:] = [tok.encode(format_call(c["name"], c["arguments"]) + EOS) for c in script]
            played.append(session)
        episode = play(self, env, task, session, **kw)
        assert not (Path(self.trace_dir) / session).exists()  # consumed: the gateway's store forgot it
        policy.queue[:] = []
        if session.startswith("ep"):
            episodes[int(session[2:])] = episode
        return episode

    monkeypatch.setattr(agentic_backend.AgenticBackend, "_play", scripted_play)
    trained, advantages = [], []
    collate = batch_module.collate

    def keep(samples, advs, *a, **kw):
        out = collate(samples, advs, *a, **kw)
        trained.append(list(samples))
        advantages.append(out.advantages.clone())
        return out

    monkeypatch.setattr(batch_module, "collate", keep)
    monkeypatch.setattr("megatron_s2.posttrain.train_batch.collate", keep)
    result = trainer.train()
    assert result.final_step == 2 and not result.preempted
    assert trainer.backend.server is None  # closed with the run

    assert [len(step) for step in trained] == [2, 2]
    for step, adv in zip(trained, advantages):
        group = [episodes[s.sample_id] for s in step]
        assert sorted(e.reward for e in group) == [0.0, 1.0]
        expected = group_token_advantages(group)
        for row, (s, episode, exp) in enumerate(zip(step, group, expected)):
            assert len(episode.samples) == 1  # builtin keeps its history verbatim: one branch
            assert s.tokens == episode.samples[0].token_ids.tolist()
            for start, end in s.spans:  # every policy span is one engine request's output, token for token
                match = [c for c in calls.values() if c["prompt"] == s.tokens[:start] and c["ids"] == s.tokens[start:end]]
                assert match, f"sample {s.sample_id}: span {start}..{end} is not an engine request's output"
                # (every instance's opening chat is the same: step 1's first call can match step 2's too)
                assert s.versions[start:end] in [c["versions"] for c in match]
            assert s.reward == episode.reward and s.correct == (episode.reward > 0)
            assert s.process_weights == episode.weights and len(s.spans) == len(episode.weights)
            assert s.routing is not None and (s.routing.start, s.routing.end) == (0, len(s.tokens) - 1)
            # the trainer's per-token advantage = Eq. 30 of the group's leave-one-out advantage
            n = len(s.tokens) - 1
            assert np.allclose(adv[row, :n].numpy(), exp[0][1:n + 1])
    assert {v for s in trained[0] for v in s.policy_versions} == {0}
    assert {v for s in trained[1] for v in s.policy_versions} == {1}

    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        extra = m.get("extra", m)
        assert extra["rollout_episodes"] == 2 and extra["rollout_accuracy"] == 0.5
        assert extra["trained_reward_mean"] == 0.5 and np.isfinite(m["loss"])
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2] and 0.0 <= evals[0]["eval_accuracy"] <= 1.0


@pytest.mark.slow
def test_rl_with_smolagents_trains_each_branch_of_an_episode(tmp_path, monkeypatch, one_thread):
    """One step with ``agent.harness: smolagents``, which writes its earlier calls back as its own
    text: the reference episode leaves one trace branch per model call, the immediate submit one.
    The step trains every branch as a row: each row's policy span is exactly one engine request's
    output (with its log-probs) in that request's context, every training call is trained once and
    nothing else is (the re-rendered history masked), every row of an episode carries the episode's
    leave-one-out advantage (Eq. 30, w = 1). ~3 min on 2 cores: smolagents' opening chat is ~5.2k
    tiny-BPE tokens, so each row is ~5.5k tokens."""
    from megatron_s2.posttrain.agentic.tools import format_call
    from megatron_s2.posttrain.rollout import agentic_backend
    from megatron_s2.posttrain.train_batch import collate as real_collate
    from megatron_s2.posttrain.trainer import PosttrainTrainer
    from tests.serve.test_gateway import ScriptedPolicy, record_calls

    try:
        detect_runtime(SandboxConfig())
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    overrides = [o for o in SMALL if not o.startswith(("training.train_steps", "training.seq_length", "rl.eval",
                                                        "rl.rollout.environment.eval_prompts"))]
    recipe = load_recipe(str(RECIPE), [*overrides, "training.train_steps=1", "training.seq_length=6144",
                                       "rl.rollout.environment.eval_prompts=0", "rl.eval={interval: 0, at_start: false}",
                                       "rl.rollout.environment.agent={harness: smolagents}"])
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    tok, engine = trainer.tokenizer, trainer.engine
    policy = ScriptedPolicy(engine)
    calls = record_calls(engine, monkeypatch.setattr)
    episodes = {}
    play = agentic_backend.AgenticBackend._play

    def scripted_play(self, env, task, session, **kw):  # the reference solution, then an immediate submit
        script = task.reference if not episodes else [{"name": "submit", "arguments": {}}]
        policy.queue[:] = [tok.encode(format_call(c["name"], c["arguments"]) + EOS) for c in script]
        episode = episodes[int(session[2:])] = play(self, env, task, session, **kw)
        policy.queue[:] = []
        return episode

    monkeypatch.setattr(agentic_backend.AgenticBackend, "_play", scripted_play)
    trained, step_calls = [], []

    def keep(samples, advs, *a, **kw):
        if not trained:  # the engine requests of the step's episodes (others may start after it)
            step_calls.extend(calls)
        out = real_collate(samples, advs, *a, **kw)
        trained.append((list(samples), out))
        return out

    monkeypatch.setattr("megatron_s2.posttrain.train_batch.collate", keep)
    result = trainer.train()
    assert result.final_step == 1 and len(episodes) == 2
    assert sorted(e.reward for e in episodes.values()) == [0.0, 1.0]

    calls = step_calls
    rows = [(row, out, i) for samples, out in trained for i, row in enumerate(samples)]
    branches = sorted(len(e.samples) for e in episodes.values())
    assert branches[0] == 1 and branches[1] > 1 and sum(branches) == len(calls)  # one branch per model call
    fillers = [row for row, _, _ in rows if not any(row.policy_mask)]
    assert len(fillers) == len(calls) % 2  # rows padded to a multiple of micro_batch_size
    rows = [(row, out, i) for row, out, i in rows if any(row.policy_mask)]
    assert len(rows) == len(calls) and all(len(row.spans) == 1 for row, _, _ in rows)
    advantages: dict[int, list] = {}
    spans = []
    for row, out, i in rows:
        (start, end), = row.spans
        match = [c for c in calls if c["prompt"] == row.tokens[:start] and c["ids"] == row.tokens[start:end]]
        assert match, f"row of sample {row.sample_id}: its span is not an engine request's output in its context"
        assert np.allclose(row.logprobs[start:end], match[0]["logprobs"], atol=1e-6)
        assert sum(row.policy_mask) == end - start  # the rest of the row (the re-rendered calls) is context
        spans.append(row.tokens[start:end])
        n = len(row.tokens) - 1
        (value,) = set(out.advantages[i, :n][out.loss_mask[i, :n]].tolist())
        advantages.setdefault(row.sample_id, []).append(value)
    assert sorted(spans) == sorted(c["ids"] for c in calls)  # every call trained once
    for k, episode in episodes.items():  # leave-one-out of (1, 0): +1 / -1 on every row, Eq. 30's w when positive
        a = 1.0 if episode.reward else -1.0
        assert advantages[k] == [w * a if a > 0 else a for w in episode.weights], episode.categories
    assert sum(int(out.loss_mask.sum()) for _, out in trained) == sum(len(c["ids"]) for c in calls)
    extra = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    extra = extra.get("extra", extra)
    assert extra["rows_per_sample"] == len(calls) / 2 and extra["rollout_accuracy"] == 0.5
