"""An ``rl`` phase on a verifiers environment (``rollout.environment.kind: verifiers``), end to end on
CPU with the tiny model and the BPE tokenizer: the co-located engine is served in-process by our
OpenAI-compatible app, real verifiers 0.4.0 episodes (SingleAgentEnv -> interception server ->
TrainClient -> renderers -> /inference/v1/generate) run against it, and every trained sample is
exactly what the engine generated (each assistant turn's ids = one engine request's output, its
context = that request's prompt), carries the rubric's reward, the R3 record of every fed position
and its policy version. The two-turn environment checks the loss mask of a multi-turn session.
The unfiltered rollout metrics cover every episode, the groups dynamic sampling dropped included;
held-out tasks (``environment.eval_taskset``) are evaluated through the same server into eval.jsonl."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_s2.config.posttrain import AdvantageConfig, RolloutConfig
from megatron_s2.config.posttrain.environment import EnvironmentConfig
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.posttrain.orchestrator import Orchestrator
from megatron_s2.posttrain.rollout import vf_backend
from megatron_s2.posttrain.trainer import PosttrainTrainer
from tests.posttrain.rollout_steps import check_unfiltered_metrics, rollout_steps

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "phases" / "rl_addition_verifiers.yaml"
PLUGINS = Path(__file__).parent / "vf_plugins"
SMALL = ["training.train_steps=2", "training.seq_length=96", "training.global_batch_size=4",
         "training.micro_batch_size=4", "rl.rollout.group_size=2", "rl.rollout.batch_groups=2",
         "rl.rollout.max_in_flight=4", "rl.rollout.max_new_tokens=4", "rl.rollout.engine.max_num_seqs=4",
         "rl.rollout.environment.max_concurrent=4", "rl.advantage.dynamic_sampling=false",
         "rl.eval.interval=0", "rl.eval.at_start=false", "rl.rollout.environment.eval_taskset={}",
         "checkpoint.save_interval=0", "logging.progress_bar=false", "logging.tensorboard=false"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, monkeypatch, taskset: str, plugins: str, *extra: str, steps: int = 2):
    """Train (up to) ``steps`` steps; returns (trained samples per step, {sample_id: trace}, engine calls)."""
    overrides = SMALL + [f"rl.rollout.environment.taskset={{id: {taskset}}}",
                         f"rl.rollout.environment.plugin_path={plugins}", *extra]
    recipe = load_recipe(str(RECIPE), overrides)
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    calls: dict[str, dict] = {}
    add_request = trainer.engine.add_request

    def spy(prompt, params=None, *, request_id=None, on_output=None, **kwargs):  # kwargs: e.g. images
        rec = calls[request_id] = {"prompt": list(prompt), "ids": [], "versions": []}

        def out(o):
            rec["ids"] += list(o.token_ids)
            rec["versions"] += list(o.versions)
            on_output(o)
        return add_request(prompt, params, request_id=request_id, on_output=out, **kwargs)

    monkeypatch.setattr(trainer.engine, "add_request", spy)
    traces, trained = {}, []
    convert = vf_backend.trace_sample

    def keep(trace, sample_id, **kw):
        if kw.get("layer_ids") is not None:  # a training episode (held-out ones keep no routing; their ids repeat)
            traces[sample_id] = trace
        return convert(trace, sample_id, **kw)

    monkeypatch.setattr(vf_backend, "trace_sample", keep)
    train_on = trainer._train_on
    monkeypatch.setattr(trainer, "_train_on", lambda samples, groups: (trained.append(list(samples)),
                                                                       train_on(samples, groups))[1])
    result = trainer.train()
    assert result.final_step == steps and not result.preempted
    assert trainer.backend.server is None  # closed with the run
    return trained, traces, list(calls.values())


def _check_token_in_token_out(samples, traces, calls):
    for s in samples:
        assert s.spans and s.num_generated >= len(s.spans)
        for start, end in s.spans:  # every trained turn is one engine request, token for token
            match = [c for c in calls if c["prompt"] == s.tokens[:start] and c["ids"] == s.tokens[start:end]]
            assert match, f"sample {s.sample_id}: turn {start}..{end} is not an engine request's output"
            assert s.versions[start:end] == match[0]["versions"]
        assert all(m == (v >= 0) for m, v in zip(s.policy_mask, s.versions))
        assert s.routing is not None and (s.routing.start, s.routing.end) == (0, len(s.tokens) - 1)
        trace = traces[s.sample_id]
        assert s.reward == pytest.approx(trace.reward)
        branch = trace.branches[-1]
        assert branch.token_ids[:len(s.tokens)] == s.tokens


@pytest.mark.slow
def test_rl_on_a_verifiers_single_turn_environment(tmp_path, monkeypatch):
    trained, traces, calls = _run(tmp_path, monkeypatch, "megatron_s2_single_turn", str(ROOT / "tests/serve/vf_plugins"))
    assert [len(step) for step in trained] == [4, 4]
    _check_token_in_token_out([s for step in trained for s in step], traces, calls)
    assert all(len(s.spans) == 1 for step in trained for s in step)
    for s in (s for step in trained for s in step):  # the rubric: right number + 0.5 x brevity
        trace = traces[s.sample_id]
        reply, answer = trace.last_reply or "", trace.task.data.answer
        numbers = re.findall(r"-?\d+", reply)
        assert s.reward == pytest.approx(float(bool(numbers) and int(numbers[-1]) == answer) + 0.5 / (1 + len(reply)))
    assert {v for s in trained[0] for v in s.policy_versions} == {0}
    assert {v for s in trained[1] for v in s.policy_versions} <= {0, 1}  # drained before the update, or after it


@pytest.mark.slow
@pytest.mark.parametrize("renderer", ["bridge", "default"])
def test_rl_on_a_verifiers_two_turn_environment_masks_the_environment_tokens(tmp_path, monkeypatch, renderer):
    """With the bridging renderer (megatron_s2/posttrain/envs/vf_renderer.py) the second call's
    prompt extends the first call's ids verbatim, so every session is one branch: one sample with
    both turns trained and the user's follow-up (and the close of a reply cut by the length limit)
    between them loss-masked. renderers' DefaultRenderer re-renders the history instead; a reply
    that re-tokenises differently or was cut splits the session, and the sample is then the final
    call's exact context + completion."""
    trained, traces, calls = _run(tmp_path, monkeypatch, "megatron_s2_two_turn", str(Path(__file__).parent / "vf_plugins"),
                                  f"rl.rollout.environment.renderer={renderer}")
    samples = [s for step in trained for s in step]
    _check_token_in_token_out(samples, traces, calls)
    sessions = 0
    for s in samples:
        trace = traces[s.sample_id]
        assert trace.num_turns == 2 and s.spans[-1][1] == len(s.tokens) and not any(s.policy_mask[:s.spans[0][0]])
        if len(trace.branches) == 1:  # the whole session is one sample
            (a, b), (c, d) = s.spans
            assert b < c and not any(s.policy_mask[b:c])  # the follow-up: environment tokens, masked
            (second,) = [call for call in calls if call["prompt"] == s.tokens[:c]]
            assert second["prompt"][:b] == s.tokens[:b]  # it extends the first turn's exact ids
            sessions += 1
        else:
            assert len(s.spans) == 1
        assert s.reward == pytest.approx(1.0 / (1 + len(trace.last_reply or "")))
    if renderer == "bridge":
        assert sessions == len(samples) == 8
    else:
        assert sessions < len(samples)  # the tiny model's replies do not survive a re-render


@pytest.mark.slow
def test_rl_on_the_second_try_environment_trains_each_session_as_one_sample(tmp_path, monkeypatch):
    """The learnable multi-turn environment (plugin id megatron_s2_retry, recipes/
    rl_tiny_verifiers_multiturn.yaml) with the bridging renderer: a wrong first reply gets the
    feedback and a second try, and the session is one sample (feedback masked) carrying the rubric's
    1 / try reward; first-try accuracy is reported for the rollouts (before any filtering) and for
    the held-out tasks (eval.jsonl, eval_metric_first_try_correct) beside the final accuracy. The
    rubric's per-turn rewards (turn_reward_<k>) become the sample's turn_rewards, which
    rl.advantage.credit: turn trains on (one advantage per reply: tests/posttrain/test_advantages.py)."""
    from megatron_s2.posttrain.envs.vf_retry import FEEDBACK
    from megatron_s2.posttrain.envs.vf_tasks import plugin_dir

    trained, traces, calls = _run(tmp_path, monkeypatch, "megatron_s2_retry", str(plugin_dir()),
                                  "rl.rollout.environment.renderer=bridge", "training.seq_length=96",
                                  "rl.rollout.max_new_tokens=6", "rl.eval.interval=2", "rl.eval.at_start=true",
                                  "rl.rollout.environment.taskset={id: megatron_s2_retry, split: train, count: 40}",
                                  "rl.rollout.environment.eval_taskset={split: eval, count: 4}",
                                  "rl.advantage.credit=turn")
    samples = [s for step in trained for s in step]
    _check_token_in_token_out(samples, traces, calls)
    for s in samples:
        trace = traces[s.sample_id]
        first = trace.metrics["first_try_correct"]
        assert s.metrics == {k: trace.metrics[k] for k in ("first_try_correct", "second_try_correct",
                                                           "first_try_well_formed")} and len(trace.branches) == 1
        assert trace.metrics["second_try_correct"] == float(not first and bool(s.correct))
        assert len(s.spans) == trace.num_turns == (1 if first else 2)
        assert s.turn_rewards == ([1.0] if first else [0.0, float(bool(s.correct))])
        assert s.reward == pytest.approx(1.0 if first else 0.5 * float(bool(s.correct)))
        if trace.num_turns == 2:
            (a, b), (c, d) = s.spans
            assert not any(s.policy_mask[b:c]) and FEEDBACK in trace.messages[3].content
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= m["rollout_metric_first_try_correct"] <= m["rollout_accuracy"] for m in metrics)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert e["eval_prompts"] == 4 and 0.0 <= e["eval_metric_first_try_correct"] <= e["eval_accuracy"]
        assert 0.0 <= e["eval_greedy_metric_first_try_correct"] <= e["eval_greedy_accuracy"]


@pytest.mark.slow
def test_resumed_verifiers_run_trains_no_prompt_twice(tmp_path, monkeypatch):
    """Checkpoints store the orchestrator's state; in-flight episodes (no partial traces) start
    again after the restart: every dispatched prompt is trained once, none is skipped."""
    plugins = str(ROOT / "tests/serve/vf_plugins")
    keep = ["checkpoint.save_interval=1", "rl.rollout.environment.taskset={id: megatron_s2_tasks, split: train, count: 40}"]
    first, _, _ = _run(tmp_path, monkeypatch, "megatron_s2_tasks", plugins, *keep, steps=2)
    second, _, _ = _run(tmp_path, monkeypatch, "megatron_s2_tasks", plugins, *keep, "training.train_steps=3", steps=3)
    assert [len(s) for s in first] == [4, 4] and [len(s) for s in second] == [4]
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    trained = [uid for r in records for uid in r["trained"]]
    assert len(trained) == len(set(trained)) == 6
    assert {s.prompt_uid for s in second[0]} == set(records[-1]["trained"])


def test_verifiers_recipes_refuse_what_is_not_supported_yet():
    with pytest.raises(ConfigError, match=r"opd\.eval: the distillation metrics .* set opd\.eval\.interval=0"):
        load_recipe(str(ROOT / "recipes" / "phases" / "opd_addition.yaml"),
                    ["data.tokenizer=recipes/tokenizers/tiny-bpe", "model.vocab_size=512", "model.engram_pad_id=2",
                     "opd.rollout.environment={kind: verifiers, taskset: {id: megatron_s2_tasks}, "
                     "eval_taskset: {split: eval}}", "opd.eval.interval=5", "training.seq_length=96"])
    with pytest.raises(ConfigError, match="data.tokenizer"):
        load_recipe(str(RECIPE), ["data.tokenizer=char"])
    with pytest.raises(ConfigError, match="taskset"):
        load_recipe(str(RECIPE), ["rl.rollout.environment.taskset={}"])
    with pytest.raises(ConfigError, match="train_aware_replay"):
        load_recipe(str(RECIPE), ["rl.rollout.engine.decoder_bounded_replay=true",
                                  "rl.rollout.engine.train_aware_replay=true"])


@pytest.mark.parametrize("overrides, message", [
    (["rl.rollout.environment.eval_taskset={}"],
     r"^rl\.rollout\.environment\.eval_taskset: evaluation is on \(rl\.eval\.interval=10, rl\.eval\.at_start=true\) "
     r"but the verifiers environment declares no held-out tasks; set eval_taskset .* or rl\.eval\.interval=0 and "
     r"rl\.eval\.at_start=false$"),
    (["rl.eval.interval=0", "rl.rollout.environment.eval_taskset={}"],
     r"^rl\.rollout\.environment\.eval_taskset: evaluation is on \(rl\.eval\.interval=0, rl\.eval\.at_start=true\)"),
    (["rl.eval.interval=-2"], r"^rl\.eval\.interval: must be >= 0 .*got -2$"),
    (["rl.rollout.environment.eval_taskset={split: train}"],
     r"^rl\.rollout\.environment\.eval_taskset: it names the training taskset itself"),
    (["rl.rollout.environment={kind: task, eval_taskset: {split: eval}}"],
     r"^rl\.rollout\.environment\.taskset: taskset / eval_taskset / plugin_path configure a verifiers"),
])
def test_verifiers_evaluation_config_errors_exit_2_with_one_line_before_any_rank_starts(overrides, message, tmp_path,
                                                                                       capsys):
    from megatron_s2.cli import main

    code = main(["launch", str(RECIPE), "--local", *overrides, f"training.run_dir={tmp_path / 'run'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert re.search(message, err[0].split("configuration error: ", 1)[1]), err[0]
    assert not (tmp_path / "run").exists()  # refused before anything started


_EVAL = "rl.rollout.environment.eval_taskset"


@pytest.mark.parametrize("value, message", [
    ("eval", r"expected a mapping, got 'eval'$"),                                   # wrong type
    ("[split, eval]", r"expected a mapping, got \['split', 'eval'\]$"),
    ("{splt: eval}", r"verifiers cannot build the environment 'megatron_s2_tasks' \(splt: Extra inputs"),
    ("{split: eval, count: ten}", r"verifiers cannot build .*\(count: Input should be a valid integer"),
    ("{split: evaluation}", r"verifiers cannot build .*\(split: Input should be 'train' or 'eval'"),
    ("{split: eval, count: 0}", r"verifiers cannot build .*\(count: Input should be greater than or equal to 1"),
    ("{split: eval, count: -5}", r"verifiers cannot build .*\(count: Input should be greater than or equal to 1"),
    ("{split: train, count: 128}", r"every held-out task's opening chat is also a training task's"),  # not held out
    ("{count: 64}", r"every held-out task's opening chat is also a training task's"),  # split: train inherited
    ("{id: no_such_taskset}", r"verifiers cannot build the environment 'no_such_taskset' \("),
    ("{split: eval, system_prompt: ''}", r"verifiers cannot build .*\(\[Errno 21\] Is a directory"),  # verifiers' file field
])
def test_careless_eval_tasksets_are_one_line_config_errors_in_the_launch_pre_flight(value, message, capsys):
    """What a careless user writes for eval_taskset: before, only the wrong types were refused at
    launch; the rest started the rank and failed there (unknown fields, a missing id, count 0,
    a held-out set that is the training set) or ran on (a negative count sliced the split from its
    end: 512 - 5 tasks). Now each is refused by the pre-flight (`launch --dry-run` runs it too)."""
    from megatron_s2.cli import main

    code = main(["launch", str(RECIPE), "--local", "--dry-run", f"{_EVAL}={value}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert re.search(r"^" + re.escape(_EVAL) + r": " + message, err[0].split("configuration error: ", 1)[1]), err[0]


def test_held_out_tasks_that_are_training_tasks_are_dropped_and_none_left_is_refused(tmp_path):
    """An eval_taskset that (partly) selects training tasks: those are not held out and are dropped;
    when none is left the trainer refuses to start (one line naming the field)."""
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment
    from megatron_s2.config.posttrain.environment import EnvironmentConfig as Env

    env = VerifiersEnvironment("d", Env(kind="verifiers", taskset={"id": "megatron_s2_parity", "count": 4},
                                        eval_taskset={"offset": 2}, plugin_path=str(PLUGINS)), None)
    assert [t.data.prompt for t in env.tasks] == ["Item 0?", "Item 2?", "Item 4?", "Item 6?"]
    assert env.eval_dropped == 2 and [t.data.prompt for t in env.eval_tasks] == ["Item 8?", "Item 10?"]
    recipe = load_recipe(str(RECIPE), [*SMALL, "rl.eval.interval=1", f"rl.rollout.environment.plugin_path={PLUGINS}",
                                       "rl.rollout.environment.taskset={id: megatron_s2_parity, count: 4}",
                                       "rl.rollout.environment.eval_taskset={count: 2}"])
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.environment\.eval_taskset: every held-out task's opening "
                                          r"chat is also a training task's") as err:
        PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    assert "\n" not in str(err.value)


def test_an_opd_warmup_that_would_generate_on_a_verifiers_environment_is_refused_at_load():
    """The warm-up's teacher generation plays token-level episodes, which a verifiers
    environment does not have: refused at load unless trajectories come from a file."""
    opd = ROOT / "recipes" / "phases" / "opd_addition.yaml"
    overrides = ["data.tokenizer=recipes/tokenizers/tiny-bpe", "model.vocab_size=512", "model.engram_pad_id=2",
                 "opd.rollout.environment={kind: verifiers, taskset: {id: megatron_s2_tasks, task_name: addition}}",
                 "opd.eval.interval=0", "opd.eval.at_start=false", "training.seq_length=96"]
    load_recipe(str(opd), overrides)  # without the warm-up: accepted
    with pytest.raises(ConfigError, match=r"opd\.sft_warmup\.data: the warm-up generates"):
        load_recipe(str(opd), [*overrides, "opd.sft_warmup.steps=1"])


def test_verifiers_build_errors_name_the_field_and_a_broken_plugin(tmp_path):
    """An unknown taskset field names the field (not pydantic's "1 validation error for ..."); a plugin
    with a syntax error is a one-line ConfigError naming the file and line, not a traceback."""
    from megatron_s2.config.posttrain.environment import EnvironmentConfig
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment
    with pytest.raises(ConfigError, match=r"^rollout\.environment\.taskset: .*\(bogus_field: Extra inputs") as err:
        VerifiersEnvironment("d", EnvironmentConfig(kind="verifiers", taskset={"id": "megatron_s2_tasks",
                                                                               "bogus_field": 3}), None)
    assert "\n" not in str(err.value)
    (tmp_path / "broken_ts_r14.py").write_text("def load_taskset(:\n")
    with pytest.raises(ConfigError, match=r"syntax error in .*broken_ts_r14\.py:1") as err:
        VerifiersEnvironment("d", EnvironmentConfig(kind="verifiers", taskset={"id": "broken_ts_r14"},
                                                    plugin_path=str(tmp_path)), None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("agent", ["{max_turns: 0}", "{max_output_tokens: -1}", "{max_turns: two}"])
def test_an_agent_cap_below_one_is_refused_at_load(agent):
    """verifiers accepts max_turns: 0, then every trace has no model turn and training died mid-run
    with 'the trace has no trainable branch' (a traceback)."""
    with pytest.raises(ConfigError, match=r"^rl\.rollout\.environment\.agent\.max_\w+: must be an integer >= 1") as err:
        load_recipe(str(RECIPE), [f"rl.rollout.environment.agent={agent}"])
    assert "\n" not in str(err.value)


def test_a_prompt_longer_than_the_engine_context_is_a_one_line_config_error(tmp_path):
    """seq_length below the rendered prompt: every episode failed with a ProviderError and the run
    died with a RuntimeError traceback; now a ConfigError (exit 2) naming training.seq_length."""
    recipe = load_recipe(str(RECIPE), [*SMALL, "training.seq_length=24", "rl.rollout.max_new_tokens=2"])
    trainer = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"^training\.seq_length: .*context length.*raise training\.seq_length") as err:
        trainer.train()
    assert "\n" not in str(err.value)
    assert trainer.backend.server is None  # closed on the way out


@pytest.mark.slow
def test_episodes_reach_the_loopback_server_with_a_proxy_in_the_environment(tmp_path, monkeypatch):
    """http_proxy / ALL_PROXY set (as on many clusters) sent the episodes' loopback requests to the
    proxy: every episode failed with APIConnectionError."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "example.org")
    monkeypatch.setenv("no_proxy", "example.org")
    recipe = load_recipe(str(RECIPE), [*SMALL, "training.train_steps=1"])
    result = PosttrainTrainer(recipe, tmp_path / "run", log=lambda *a: None).train()
    assert result.final_step == 1
    import os
    assert os.environ["NO_PROXY"].split(",") == ["example.org", "127.0.0.1", "localhost"]


@pytest.mark.slow
def test_unfiltered_rollout_metrics_count_every_episode_of_a_verifiers_environment(monkeypatch):
    """The verifiers code path (episodes over the in-process server, rubric rewards from traces):
    rollout_* over every finished episode, the groups DAPO dropped included; trained_* over the
    trained groups. The parity rubric is recomputed from each trace's reply."""
    import dataclasses

    from megatron_s2.data.tokenizer import load_tokenizer
    from megatron_s2.inference import EngineConfig, InferenceEngine
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment
    from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
    from tests.posttrain.tiny import tiny_config
    from tests.posttrain.vf_plugins.megatron_s2_parity import reply_reward

    tok = load_tokenizer(ROOT / "recipes" / "tokenizers" / "tiny-bpe")
    model = build_model(dataclasses.replace(tiny_config(), vocab_size=512, engram_pad_id=2), seed=2)
    model.set_token_map(tok.compressed_token_map(num_ids=512))
    engine = InferenceEngine(model.eval(), EngineConfig(max_num_seqs=8, max_model_len=96, page_tokens=8),
                             eos_token_ids=[tok.eos_id])
    env = VerifiersEnvironment("default", EnvironmentConfig(kind="verifiers", taskset={"id": "megatron_s2_parity"},
                                                            plugin_path=str(PLUGINS)), tok)
    backend = vf_backend.VerifiersBackend(engine, {"default": env}, tokenizer=tok, topology=ReplicaTopology.single(),
                                          layer_ids=model.layer_ids, record_routing=False, max_concurrent=8)
    replies: dict[int, str] = {}
    convert = vf_backend.trace_sample

    def keep(trace, sample_id, **kw):
        replies[sample_id] = trace.last_reply
        return convert(trace, sample_id, **kw)

    monkeypatch.setattr(vf_backend, "trace_sample", keep)
    cfg = RolloutConfig(group_size=2, max_in_flight=8, batch_groups=2, max_new_tokens=3, max_staleness=-1)
    dapo = AdvantagePipeline(AdvantageConfig(dynamic_sampling=True))
    orch = Orchestrator(cfg, {"default": env}, backend, seed=3,
                        group_filter=lambda ss: dapo.informative(GroupRollouts.from_samples(ss)))
    try:
        steps = rollout_steps(orch, backend, 3)
    finally:
        backend.close()
    check_unfiltered_metrics(orch, steps, lambda s: reply_reward(replies[s.sample_id]))


@pytest.mark.slow
def test_a_verifiers_run_evaluates_its_held_out_tasks_at_the_interval_into_eval_jsonl(tmp_path, monkeypatch):
    """eval.interval=2 over 3 steps: eval.jsonl rows before the first update, at step 2 and after
    the last; each plays every held-out task (the parity taskset's eval split, never trained on)
    twice at temperature 1 and once greedy, as verifiers episodes through the run's own server and
    engine; accuracy and reward are the rubric recomputed from those episodes' replies."""
    from tests.posttrain.vf_plugins.megatron_s2_parity import reply_reward

    played, inside = [], []
    play, convert = vf_backend.VerifiersBackend.play_held_out, vf_backend.trace_sample

    def play_spy(self, items, **kw):
        inside.append([])
        samples = play(self, items, **kw)
        played.append((list(items), kw["temperature"], samples, inside.pop()))
        return samples

    def trace_spy(trace, sample_id, **kw):
        if inside:
            inside[-1].append(trace)
        return convert(trace, sample_id, **kw)

    monkeypatch.setattr(vf_backend.VerifiersBackend, "play_held_out", play_spy)
    monkeypatch.setattr(vf_backend, "trace_sample", trace_spy)
    _, _, calls = _run(tmp_path, monkeypatch, "megatron_s2_parity", str(PLUGINS), "training.train_steps=3",
                       "rl.eval.interval=2", "rl.eval.at_start=true", "rl.eval.temperature=1.0",
                       "rl.eval.samples_per_prompt=2", "rl.eval.also_greedy=true",
                       "rl.rollout.environment.eval_taskset={split: eval, count: 3}", steps=3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 3] and len(played) == 2 * len(rows)
    for row, (sampled, greedy) in zip(rows, zip(played[::2], played[1::2])):
        items, temperature, samples, traces = sampled
        assert temperature == 1.0 and items == [("default", i) for i in range(3) for _ in range(2)]
        assert greedy[1] == 0.0 and greedy[0] == [("default", i) for i in range(3)]
        assert {t.task.data.prompt for t in traces} == {"Item 1?", "Item 3?", "Item 5?"}  # the eval split
        assert row["eval_prompts"] == 3 and row["eval_episodes"] == 6
        rewards = [reply_reward(t.last_reply) for t in traces]
        assert row["eval_accuracy"] == pytest.approx(sum(rewards) / 6) == pytest.approx(row["eval_reward"])
        assert row["eval_greedy_accuracy"] == pytest.approx(sum(reply_reward(t.last_reply) for t in greedy[3]) / 3)
        for s in samples:  # each held-out episode's call was a request of the run's own engine
            start, end = s.spans[0]
            assert any(c["prompt"] == s.tokens[:start] and c["ids"] == s.tokens[start:end] for c in calls)
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert metrics[2]["eval_accuracy"] == rows[1]["eval_accuracy"] and "eval_accuracy" not in metrics[1]


def test_the_repair_recipe_trains_sft_on_a_noisy_teacher_and_rl_in_the_same_format(capsys):
    """recipes/rl_tiny_verifiers_repair.yaml: the SFT phase's data answers a near miss in 35% of the
    documents, both phases use the digit tokenizer, the taskset asks the bare prompt as the SFT documents."""
    import yaml

    from megatron_s2.cli import main

    pipeline = yaml.safe_load((ROOT / "recipes/rl_tiny_verifiers_repair.yaml").read_text())
    sft_phase, rl_phase = pipeline["phases"]
    sft = load_recipe(ROOT / "recipes" / sft_phase["recipe"], sft_phase["overrides"])
    rl = load_recipe(ROOT / "recipes" / rl_phase["recipe"])
    assert sft.data.near_miss_fraction == 0.35 and sft.data.tasks == ("addition",)
    assert sft.data.tokenizer == rl.data.tokenizer == "recipes/tokenizers/tiny-bpe-digits"
    assert rl.rl.rollout.environment.taskset["use_system_prompt"] is False
    assert main(["launch", str(ROOT / "recipes/rl_tiny_verifiers_repair.yaml"), "--local", "--dry-run"]) == 0
    assert "phase sft" in capsys.readouterr().err
