"""The rl: and opd: sections: YAML round trip, composition from registries, errors naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from megatron_s2.cli import main
from megatron_s2.config.schema import ConfigError, from_mapping, to_mapping
from megatron_s2.posttrain.advantages import AdvantagePipeline
from megatron_s2.config.posttrain import OPDConfig, RLConfig
from megatron_s2.posttrain.losses import PosttrainObjective

RL_YAML = """
rollout:
  group_size: 8
  max_in_flight: 32
  batch_groups: 4
  max_staleness: 2
  staleness_action: mask
  datasets:
    - {name: addition, weight: 2.0, max_in_flight: 16}
    - {name: brackets, max_in_flight: 8}
  discard_short: {warmup_samples: 64, min_tokens: 3}
advantage:
  estimator: leave_one_out
  transforms: [gepo, length_regularization]
  gepo: {thresholds: batch_quantile, low_quantile: 0.2, high_quantile: 0.8}
loss:
  terms: [{kind: policy_gradient}, {kind: reference_kl, coef: 0.01, kl_estimator: k3}]
  masks: [bkl, staleness]
  aggregation: sequence_mean
"""

OPD_YAML = """
mode: sampled_token
teachers:
  - {name: reasoning, domains: [math, science], checkpoint: runs/rl_reasoning/checkpoints}
  - {name: agentic, domains: [swe], endpoint: "http://teacher:8000/v1"}
domain_weights: {math: 1.0, swe: 0.5}
rollout:
  group_size: 1
  datasets: [{name: gsm, domain: math}, {name: swe}]
"""


def load(cls, text: str, section: str):
    return from_mapping(cls, yaml.safe_load(text), section)


def test_rl_round_trip_and_builds_pipeline_and_objective():
    cfg = load(RLConfig, RL_YAML, "rl")
    assert cfg.rollout.datasets[0].weight == 2.0 and cfg.loss.aggregation == "sequence_mean"
    again = from_mapping(RLConfig, yaml.safe_load(yaml.safe_dump(to_mapping(cfg))), "rl")
    assert again == cfg
    AdvantagePipeline(cfg.advantage, cfg.effort)
    PosttrainObjective(cfg.loss, cfg.rollout.max_staleness)


def test_opd_round_trip_and_teacher_lookup():
    cfg = load(OPDConfig, OPD_YAML, "opd")
    assert cfg.teacher_for("science").name == "reasoning" and cfg.weight_of("swe") == 0.5
    assert cfg.weight_of("science") == 1.0
    assert from_mapping(OPDConfig, yaml.safe_load(yaml.safe_dump(to_mapping(cfg))), "opd") == cfg


@pytest.mark.parametrize("patch,match", [
    ({"advantage": {"transforms": ["length_regularization", "gepo"]}}, r"rl\.advantage\.transforms: .*Eq\. 28"),
    ({"loss": {"eps_low": math.nan}}, r"rl\.loss\.eps_low: must be a finite number"),
    ({"loss": {"eps_high": math.inf}}, r"rl\.loss\.eps_high: must be a finite number"),
    ({"loss": {"terms": [{"kind": "reference_kl"}]}}, r"rl\.loss\.terms: RL needs a 'policy_gradient'"),
    ({"loss": {"aggregation": "fixed"}}, r"rl\.loss\.aggregation_constant"),
    ({"loss": {"masks": ["staleness"]}}, r"rl\.rollout\.staleness_action: .*set staleness_action: mask"),
    ({"rollout": {"staleness_action": "mask"}}, r"rl\.loss\.masks: .*add 'staleness'"),
    ({"rollout": {"max_in_flight": 4}}, r"rl\.rollout\.max_in_flight: 4 is below group_size=8"),
    ({"rollout": {"discard_short": {"warmup_samples": 10}}}, r"rl\.rollout\.discard_short\.min_tokens"),
    ({"rollout": {"datasets": [{"name": "a", "max_in_flight": 4}]}}, r"datasets\.a\.max_in_flight: 4 is below"),
    ({"rollout": {"top_p": 0.0}}, r"rl\.rollout\.top_p"),
    ({"effort": {"levels": [50, 100], "samples_per_level": 2}}, r"rl\.rollout\.group_size: .*set group_size: 4"),
    ({"effort": {"levels": [0, 100]}}, r"rl\.effort\.levels: effort level 0 is outside 1\.\.100"),
    ({"effort": {"k0": math.nan}}, r"rl\.effort\.k0: must be a finite number"),
    ({"advantage": {"gepo": {"h_low": 5.0, "h_high": 1.0}}}, r"rl\.advantage\.gepo\.h_low"),
    ({"advantage": {"gepo": {"low_positive_scale": 1.5}}}, r"rl\.advantage\.gepo\.low_positive_scale"),
    ({"advantage": {"length_regularization": {"gamma": 0}}}, r"length_regularization\.gamma: must be > 0"),
    ({"advantage": {"credit": "episode"}}, r"rl\.advantage\.credit: must be 'session' or 'turn'"),
    ({"advantage": {"credit": "turn", "transforms": ["gepo"]}}, r"rl\.advantage\.credit: 'turn' takes no transforms"),
    ({"advantage": {"credit": "turn"}, "effort": {"levels": [50, 100], "samples_per_level": 2},
      "rollout": {"group_size": 4}}, r"rl\.advantage\.credit: 'turn' does not combine with effort levels"),
    ({"advantage": {"gepo": {"h_lo": 1.0}}}, r"unknown key 'rl\.advantage\.gepo\.h_lo'; did you mean 'h_low'"),
    # rl.mode: disaggregated (issue 25)
    ({"mode": "disaggregated", "eval": {"at_start": False}}, r"rl\.rollout\.max_staleness: .*set max_staleness: 1"),
    ({"mode": "disaggregated", "disaggregated": {"max_async_level": -1}},
     r"rl\.disaggregated\.max_async_level: must be >= 0"),
    ({"mode": "disaggregated", "disaggregated": {"num_servers": 0}}, r"rl\.disaggregated\.num_servers"),
    ({"mode": "remote"}, r"rl\.mode"),
])
def test_rl_errors_name_the_field_and_fix(patch, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping(RLConfig, patch, "rl")


def test_disaggregated_mode_is_opt_in_and_round_trips():
    assert load(RLConfig, RL_YAML, "rl").mode == "colocated"  # the default stays co-located
    cfg = from_mapping(RLConfig, {"mode": "disaggregated", "rollout": {"max_staleness": 2},
                                  "disaggregated": {"max_async_level": 2, "num_servers": 3},
                                  "eval": {"at_start": False}}, "rl")
    assert cfg.disaggregated.num_servers == 3
    assert from_mapping(RLConfig, yaml.safe_load(yaml.safe_dump(to_mapping(cfg))), "rl") == cfg
    # held-out evaluation runs through the inference servers (posttrain/disaggregated/served_eval.py)
    evaluated = from_mapping(RLConfig, {"mode": "disaggregated", "rollout": {"max_staleness": 1},
                                        "eval": {"interval": 2, "at_start": True}}, "rl")
    assert evaluated.eval.interval == 2


@pytest.mark.parametrize("patch,match", [
    ({"advantage": {"estimator": "rloo"}}, r"rl\.advantage\.estimator: 'rloo' is not a registered group estimator"),
    ({"advantage": {"transforms": ["entropy_bonus"]}}, r"rl\.advantage\.transforms: 'entropy_bonus'"),
    ({"loss": {"masks": ["kl"]}}, r"rl\.loss\.masks: 'kl' is not a registered token mask"),
    ({"loss": {"terms": [{"kind": "policy_gradient"}, {"kind": "ppo_clip"}]}}, r"rl\.loss\.terms\[1\]\.kind: 'ppo_clip'"),
])
def test_registry_names_are_checked_by_posttrain(patch, match):
    """The section loads without torch; the registry names are checked by the post-training code."""
    from types import SimpleNamespace

    from megatron_s2.posttrain.checks import check_registered_names

    cfg = from_mapping(RLConfig, patch, "rl")
    with pytest.raises(ConfigError, match=match):
        check_registered_names(SimpleNamespace(phase=SimpleNamespace(kind="rl"), rl=cfg, opd=None))


def test_effort_group_size_consistency_accepts_matching_size():
    cfg = from_mapping(RLConfig, {"effort": {"levels": [50, 75, 100], "samples_per_level": 2},
                                  "rollout": {"group_size": 6}}, "rl")
    assert cfg.effort.group_size == 6


@pytest.mark.parametrize("patch,match", [
    ({"teachers": []}, r"opd\.teachers: at least one teacher"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c", "endpoint": "http://t:8000/v1"}]},
     r"opd\.teachers\[0\]\.checkpoint: teacher 'a' needs exactly one"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}, {"name": "b", "domains": ["x"], "checkpoint": "d"}]},
     r"domain 'x' is supervised by both 'a' and 'b'"),
    ({"teachers": [{"name": "a", "domains": ["x", "x"], "checkpoint": "c"}]},
     r"opd\.teachers: teacher 'a' lists domain 'x' twice; list each once"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}], "domain_weights": {"y": 1.0}},
     r"opd\.domain_weights: domain 'y' has no teacher"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}], "domain_weights": {"x": math.nan}},
     r"opd\.domain_weights\.x: must be a finite number"),
    ({"teachers": [{"name": "a", "domains": ["x"], "endpoint": "http://t:8000/v1"}], "mode": "full_vocab",
      "loss": {"terms": [{"kind": "full_vocab_kl"}]}}, r"full_vocab mode needs every teacher's full distribution"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}], "mode": "full_vocab"},
     r"opd\.loss\.terms: full_vocab mode needs a 'full_vocab_kl' term"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}], "rollout": {"datasets": [{"name": "y"}]}},
     r"opd\.rollout\.datasets\.y: its domain 'y' has no teacher"),
    ({"teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}], "sft_warmup": {"steps": -1}},
     r"opd\.sft_warmup\.steps: must be >= 0"),
    ({"teachers": [{"name": "a", "domains": ["x"], "endpoint": "not a url"}]},
     r"^opd\.teachers\[0\]\.endpoint: teacher 'a': 'not a url' is not an http\(s\) URL"),
    ({"teachers": [{"name": "a", "domains": ["x"], "endpoint": "teacher:8000/v1"}]}, r"teachers\[0\]\.endpoint"),
    ({"teachers": [{"name": "a", "domains": ["math", "code"], "checkpoint": "c"}]},
     r"^opd\.teachers: the prompts of rollout\.environment are domain 'default', which no teacher supervises"),
    ({"teachers": [{"name": "a", "domains": ["math"], "checkpoint": "c"}, {"name": "b", "domains": ["code"],
                                                                         "checkpoint": "d"}]}, r"domain 'default'"),
])
def test_opd_errors_name_the_field_and_fix(patch, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping(OPDConfig, patch, "opd")


def test_full_vocab_mode_with_explicit_terms():
    cfg = from_mapping(OPDConfig, {"mode": "full_vocab", "teachers": [{"name": "a", "domains": ["x"], "checkpoint": "c"}],
                                   "loss": {"terms": [{"kind": "full_vocab_kl"}], "masks": []}}, "opd")
    assert cfg.loss.has_term("full_vocab_kl") and not cfg.loss.has_term("policy_gradient")


def test_the_default_dataset_goes_to_the_only_domains_teacher():
    one = from_mapping(OPDConfig, {"teachers": [{"name": "a", "domains": ["math"], "checkpoint": "c"}]}, "opd")
    assert one.dataset_domain("default") == "math"
    own = from_mapping(OPDConfig, {"teachers": [{"name": "a", "domains": ["default", "math"], "checkpoint": "c"}]}, "opd")
    assert own.dataset_domain("default") == "default"
    named = from_mapping(OPDConfig, {"teachers": [{"name": "a", "domains": ["math"], "checkpoint": "c"}],
                                     "rollout": {"datasets": [{"name": "gsm", "domain": "math"}]}}, "opd")
    assert named.dataset_domain("gsm") == "math"


# ---- refused before any rank starts: `launch --local` (pre-flight) and `train` (before the model) ----
RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "phases"
RL, OPD = str(RECIPES / "rl_addition.yaml"), str(RECIPES / "opd_addition.yaml")
REFERENCE_KL = "rl.loss.terms=[{kind: policy_gradient}, {kind: reference_kl}]"


def _teacher(**where: str) -> str:
    fields = ", ".join(f'{k}: "{v}"' for k, v in where.items())
    return f"opd.teachers=[{{name: t, domains: [default], {fields}}}]"


# (recipe, overrides, words of the one-line error); {file} is an existing file, {none} a missing path
REFUSED = {
    "page_tokens": (RL, ["rl.rollout.engine.page_tokens=3"], ["rl.rollout.engine.page_tokens", "multiple of 2"]),
    "reference_missing": (RL, [REFERENCE_KL, "rl.reference_checkpoint={none}"],
                          ["rl.reference_checkpoint", "does not exist"]),
    "reference_file": (RL, [REFERENCE_KL, "rl.reference_checkpoint={file}"], ["rl.reference_checkpoint", "is a file"]),
    "reference_unset": (RL, [REFERENCE_KL], ["rl.reference_checkpoint", "needs a frozen reference"]),
    "teacher_missing": (OPD, [_teacher(checkpoint="{none}")], ["opd.teachers[0].checkpoint", "does not exist"]),
    "teacher_file": (OPD, [_teacher(checkpoint="{file}")], ["opd.teachers[0].checkpoint", "is a file"]),
    "endpoint": (OPD, [_teacher(endpoint="not a url")], ["opd.teachers[0].endpoint", "not an http(s) URL"]),
    "default_domain": (OPD, ["opd.teachers=[{name: t, domains: [math, code], checkpoint: x}]"],
                       ["opd.teachers", "domain 'default'"]),
    "seq_length": (RL, ["training.seq_length=4"], ["training.seq_length", "longest prompt", "at least 12"]),
    "max_model_len": (RL, ["rl.rollout.engine.max_model_len=6"], ["rl.rollout.engine.max_model_len", "raise it to 13"]),
    "eval_prompts": (RL, ["rl.rollout.environment.eval_prompts=0"],
                     ["rl.rollout.environment.eval_prompts", "rl.eval.interval=0"]),
}


@pytest.mark.parametrize("command", ["launch", "train"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_posttrain_inputs_are_refused_before_any_rank_starts(case, command, capsys, tmp_path):
    """Each was refused only inside the rank, after `[launch] started` (exit 2 but 7-9 lines, some
    naming the wrong key: "page_tokens", "checkpoint"), or not at all: PromptTooLong traceback
    (exit 1), accuracy 0.000 logged. Now one line naming the key, before a rank starts (launch)
    or the model is built (train), and the run directory stays untouched."""
    recipe, overrides, words = REFUSED[case]
    afile = tmp_path / "a_file"
    afile.write_text("not a checkpoint")
    overrides = [o.replace("{file}", str(afile)).replace("{none}", str(tmp_path / "none")) for o in overrides]
    run_dir = tmp_path / "run"
    argv = [command, recipe, *overrides, "--run-dir", str(run_dir)]
    code = main([*argv, "--local", "--dry-run"] if command == "launch" else argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert code == 2, err
    assert "[launch] started" not in err and not run_dir.exists()
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("tokenizer", ["char", "recipes/tokenizers/tiny-bpe"])
def test_the_prompt_length_bound_agrees_with_tokenizing_every_prompt(tokenizer):
    """TaskEnvironment bounds prompts by their text's bytes and tokenizes only those that may
    reach the limit (a million prompts per rank would take minutes); same answer as tokenizing
    all, at every limit around the longest prompt, with and without effort instructions."""
    from megatron_s2.config.posttrain.environment import EnvironmentConfig
    from megatron_s2.data.tokenizer import CharTokenizer, load_tokenizer
    from megatron_s2.posttrain.envs import Environment, TaskEnvironment

    tok = CharTokenizer() if tokenizer == "char" else load_tokenizer(Path(__file__).resolve().parents[2] / tokenizer)
    env = TaskEnvironment("d", EnvironmentConfig(task="sort", num_prompts=64, eval_prompts=16), tok)
    for efforts in [(None,), (25, 100)]:
        exact = max(len(env.episode(i, "train", e).prompt_tokens()) for i in range(64) for e in efforts)
        for limit in range(exact - 2, exact + 3):
            got = env.longest_prompt_from(limit, "train", efforts)
            assert got == Environment.longest_prompt_from(env, limit, "train", efforts) == (exact if exact >= limit else 0)


def test_evaluation_without_held_out_prompts_is_refused_before_the_model_is_built(capsys, tmp_path):
    """1-digit additions: 100 distinct prompts, all among the 4000 training prompts, so the
    held-out set is empty and every evaluation logged accuracy 0.000. Knowing it needs the drawn
    prompt sets, which the trainer has (the launch pre-flight does not draw a million prompts)."""
    run_dir = tmp_path / "run"
    code = main(["train", RL, "rl.rollout.environment.difficulty.addition_max_digits=1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "rl.rollout.environment.eval_prompts: every held-out prompt also occurs among the training prompts" in err
    assert not run_dir.exists()


def test_the_launch_pre_flight_draws_prompts_only_when_the_task_bound_does_not_settle_it(monkeypatch):
    """A flagship recipe has a million prompts (tens of seconds to draw): the task's longest prompt
    bounds them all, and they are drawn only when that bound reaches max_model_len."""
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.tokenizer import CharTokenizer
    from megatron_s2.posttrain import envs
    from megatron_s2.posttrain.checks import check_prompts

    drawn = []
    real = envs.build_environment
    monkeypatch.setattr(envs, "build_environment", lambda *a, **k: drawn.append(a[0]) or real(*a, **k))
    check_prompts(load_recipe(RL), CharTokenizer())
    assert drawn == []
    check_prompts(load_recipe(RL, ["training.seq_length=10"]), CharTokenizer())  # bound 11 >= 11: drawn, all fit
    assert drawn == ["default"]
    with pytest.raises(ConfigError, match=r"^training\.seq_length: the longest prompt .* has 7 tokens"):
        check_prompts(load_recipe(RL, ["training.seq_length=6"]), CharTokenizer())
