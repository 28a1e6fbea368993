"""Multi-phase pipelines: format, chaining of checkpoints, dependent SLURM jobs."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import yaml
from launcher_helpers import PAYLOADS, RECIPES

from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.launch import launch_slurm, prepare_runs

pytestmark = pytest.mark.usefixtures("no_cluster")

RECIPE = RECIPES / "tiny_4rank.yaml"
PHASE = PAYLOADS / "phase.py"


def write_pipeline(tmp_path, phases, **top) -> str:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({**top, "phases": phases}))
    return str(path)


def two_phases(tmp_path) -> str:
    return write_pipeline(tmp_path, [
        {"name": "pretrain", "recipe": str(RECIPE), "overrides": ["training.train_steps=4"]},
        {"name": "sft", "recipe": str(RECIPE), "overrides": ["phase.kind=sft"]},
    ], run_dir=str(tmp_path / "runs"))


def test_phases_chain_checkpoints_and_run_dirs(tmp_path):
    runs = prepare_runs(two_phases(tmp_path), ["training.seed=7"], {}, None, local=False)
    pretrain, sft = runs
    assert pretrain.job.run_dir == tmp_path / "runs" / "pretrain" and sft.job.run_dir == tmp_path / "runs" / "sft"
    assert pretrain.recipe.checkpoint.load == "" and pretrain.recipe.training.train_steps == 4
    assert sft.recipe.checkpoint.load == str(tmp_path / "runs" / "pretrain" / "checkpoints")
    assert sft.recipe.checkpoint.load_optimizer is False
    assert sft.recipe.phase.kind == "sft"
    assert sft.recipe.training.train_steps == load_recipe(RECIPE).training.train_steps
    assert {r.recipe.training.seed for r in runs} == {7}, "command-line overrides apply to every phase"
    assert [r.job.name for r in runs] == ["pipeline-pretrain", "pipeline-sft"]


def test_a_phase_names_an_earlier_phases_run_dir(tmp_path):
    """``${phase:<name>}`` resolves to that phase's run directory wherever --run-dir puts the
    pipeline (recipes/opd_tiny.yaml's teacher), and is refused for later phases or alone."""
    ref = "checkpoint.load_optimizer=false"
    path = write_pipeline(tmp_path, [
        {"name": "teacher", "recipe": str(RECIPE)},
        {"name": "opd", "recipe": str(RECIPE), "from_previous": False,
         "overrides": ['checkpoint.load="${phase:teacher}/checkpoints"', ref]},
    ], run_dir="unused")
    runs = prepare_runs(path, [], {}, str(tmp_path / "elsewhere"), local=False)
    assert runs[1].recipe.checkpoint.load == str(tmp_path / "elsewhere" / "teacher") + "/checkpoints"
    later = write_pipeline(tmp_path, [
        {"name": "a", "recipe": str(RECIPE), "overrides": ['checkpoint.load="${phase:b}/checkpoints"']},
        {"name": "b", "recipe": str(RECIPE)},
    ], run_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"checkpoint\.load: '\$\{phase:b\}' is not an earlier phase"):
        prepare_runs(later, [], {}, None, local=False)
    with pytest.raises(ConfigError, match="only resolves when the recipe runs as a phase of a pipeline"):
        load_recipe(RECIPE, ['checkpoint.load="${phase:teacher}/x"'])


def test_opd_tiny_finds_its_teacher_under_any_run_dir(tmp_path):
    runs = prepare_runs(str(RECIPES.parents[2] / "recipes" / "opd_tiny.yaml"), [], {}, str(tmp_path), local=True)
    teacher, = runs[-1].recipe.opd.teachers
    assert teacher.checkpoint == str(tmp_path / "teacher" / "checkpoints")


def test_two_experts_tiny_derives_every_phase_from_the_sft_checkpoint(tmp_path):
    """Walkthrough Ch. 8: both experts, the distilled student and the joint-RL baseline start from
    the same SFT checkpoint; each domain's teacher is its expert."""
    runs = prepare_runs(str(RECIPES.parents[2] / "recipes" / "two_experts_tiny.yaml"), [], {}, str(tmp_path), local=True)
    by_name = {r.phase: r.recipe for r in runs}
    sft = str(tmp_path / "sft" / "checkpoints")
    assert [r.phase for r in runs] == ["sft", "expert_addition", "expert_sort", "student", "joint_rl"]
    assert {name: by_name[name].checkpoint.load for name in by_name if name != "sft"} == dict.fromkeys(
        ["expert_addition", "expert_sort", "student", "joint_rl"], sft)
    teachers = {t.name: (t.domains, t.checkpoint) for t in by_name["student"].opd.teachers}
    assert teachers == {"addition_expert": (("addition",), str(tmp_path / "expert_addition" / "checkpoints")),
                        "sort_expert": (("sort",), str(tmp_path / "expert_sort" / "checkpoints"))}

    def samples(name: str) -> int:  # RL compute: trained samples (steps x rollout batch)
        rollout = by_name[name].rl.rollout
        return by_name[name].training.train_steps * rollout.batch_groups * rollout.group_size

    assert samples("joint_rl") == samples("expert_addition") + samples("expert_sort"), \
        "the baseline gets the experts' RL compute"


def test_summary_prints_first_and_last_evaluation_of_each_phase(tmp_path, capsys):
    path = two_phases(tmp_path)
    sft = tmp_path / "runs" / "sft"
    sft.mkdir(parents=True)
    rows = [{"step": 10, "eval_accuracy": 0.75, "eval_accuracy_sort": 0.5, "eval_reward": 0.7},
            {"step": 0, "eval_accuracy": 0.5, "eval_accuracy_sort": 0.25, "eval_reward": 0.4,
             "eval_greedy_accuracy": True}]
    hostile = ['{"step": 5, "eval_accuracy": 1' + "9" * 400 + "}",  # beyond float range
               '{"step": 6, "eval_accuracy": ' + "9" * 5000 + "}",  # beyond int parsing limits
               "[" * 100_000, "[1, 2, 3]", '{"step": true}',
               '{"step": 20, "eval_acc']  # the last line as a run killed mid-write leaves it
    (sft / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n".join(hostile))
    assert main(["launch", path, "--summary", "--nodes", "4"]) == 0, "launcher flags do not apply to --summary"
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["pretrain", "(has", "not"], "a phase without a run directory has not run"
    assert out[2].split() == ["sft", "eval_accuracy", "0.5000", "0", "0.7500", "10"]
    assert out[3].split() == ["sft", "eval_accuracy_sort", "0.2500", "0", "0.5000", "10"]
    assert "(5 unreadable line(s) of eval.jsonl skipped)" in out[4]
    assert len(out) == 5, "only the held-out metrics (not eval_reward; a bool is no accuracy; the step-5 row lost its value)"
    assert not (tmp_path / "runs" / "pretrain").exists(), "--summary starts nothing"


@pytest.mark.parametrize("phases, top, message", [
    ([], {"run_dir": "x"}, "at least one phase"),
    ([{"name": "a", "recipe": str(RECIPE)}, {"name": "a", "recipe": str(RECIPE)}], {"run_dir": "x"}, "used twice"),
    ([{"name": "../up", "recipe": str(RECIPE)}], {"run_dir": "x"}, "phases[0].name: '../up' must be"),
    ([{"name": "a", "recipe": str(RECIPE), "depends": "b"}], {"run_dir": "x"}, "unknown key 'phases[0].depends'"),
    ([{"name": "a", "recipe": str(RECIPE)}], {}, "needs a parent run directory"),
    ([{"name": "a", "recipe": str(RECIPE), "from_previous": True}, {"name": "b", "recipe": str(RECIPE)}],
     {"run_dir": "x"}, "phases[0].from_previous: the first phase"),
])
def test_pipeline_errors_name_the_field(tmp_path, phases, top, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        prepare_runs(write_pipeline(tmp_path, phases, **top), [], {}, None, local=False)


def test_pipeline_overrides_name_the_phase_that_refuses_them_and_run_dir_is_a_flag(tmp_path, capsys):
    path = two_phases(tmp_path)
    with pytest.raises(ConfigError, match=r"^phase pretrain: .*training\.train_stepz"):
        prepare_runs(path, ["training.train_stepz=3"], {}, None, local=True)
    with pytest.raises(ConfigError, match=r"^training\.run_dir: a pipeline puts each phase in .*--run-dir"):
        prepare_runs(path, ["training.run_dir=/tmp/x"], {}, None, local=True)
    assert main(["launch", path, "--local", "--dry-run", "training.run_dir=/tmp/x"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # scoped to one phase it would be dropped just the same (each phase's run directory is set by
    # the launcher): refused, not silently ignored
    with pytest.raises(ConfigError, match=r"^training\.run_dir: a pipeline puts each phase in .*'sft:training"):
        prepare_runs(path, ["sft:training.run_dir=/tmp/x"], {}, None, local=True)
    with pytest.raises(ConfigError, match=r"^training\.run_dir: a pipeline puts each phase in "):
        prepare_runs(path, ["sft: training.run_dir = /tmp/x"], {}, None, local=True)


def test_a_phase_prefix_scopes_a_command_line_override_to_that_phase(tmp_path, capsys):
    """``PHASE:section.key=value`` reaches one phase (an RL batch shrunk from the command line must
    not reach the SFT phase, where an ``rl.*`` key fails its check); unknown phases and a prefix on a
    single recipe are one-line errors naming the override."""
    path = two_phases(tmp_path)
    pretrain, sft = prepare_runs(path, ["sft:training.train_steps=3", "training.seed=5",
                                        "pretrain:logging.log_interval=2"], {}, None, local=False)
    assert (pretrain.recipe.training.train_steps, sft.recipe.training.train_steps) == (4, 3)
    assert pretrain.recipe.logging.log_interval == 2
    assert sft.recipe.logging.log_interval == load_recipe(RECIPE).logging.log_interval
    assert pretrain.recipe.training.seed == sft.recipe.training.seed == 5
    with pytest.raises(ConfigError, match=r"^rl:training\.seed=1: no phase named 'rl' in this pipeline "
                                          r"\(phases: pretrain, sft\)"):
        prepare_runs(path, ["rl:training.seed=1"], {}, None, local=False)
    with pytest.raises(ConfigError, match=r"^sft:training\.seed=1: .*single recipe, so drop the 'PHASE:' prefix"):
        prepare_runs(str(RECIPE), ["sft:training.seed=1"], {}, None, local=False)
    assert main(["launch", path, "--local", "--dry-run", "rl:training.seed=1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_first_phase_may_say_from_previous_false(tmp_path):
    path = write_pipeline(tmp_path, [{"name": "a", "recipe": str(RECIPE), "from_previous": False},
                                     {"name": "b", "recipe": str(RECIPE)}], run_dir=str(tmp_path / "runs"))
    first, second = prepare_runs(path, [], {}, None, local=False)
    assert first.recipe.checkpoint.load == "" and second.recipe.checkpoint.load == str(tmp_path / "runs/a/checkpoints")


@pytest.mark.parametrize("mode", ["--local", "--slurm"])
def test_a_later_phase_that_loads_a_missing_checkpoint_is_refused_before_the_first_starts(mode, tmp_path, capsys):
    """Phase 1 used to train to completion before phase 2's rank found its checkpoint.load missing.
    Paths under an earlier phase's run directory (chained, or ``${phase:...}``) are not refused:
    that phase writes them first."""
    missing = tmp_path / "nowhere" / "checkpoints"
    path = write_pipeline(tmp_path, [
        {"name": "a", "recipe": str(RECIPE)},
        {"name": "b", "recipe": str(RECIPE), "overrides": ['checkpoint.load="${phase:a}/checkpoints/step_00000004"']},
        {"name": "c", "recipe": str(RECIPE), "from_previous": False, "overrides": [f"checkpoint.load={missing}"]},
    ], run_dir=str(tmp_path / "runs"))
    code = main(["launch", path, mode, "--dry-run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == (f"megatron-s2 launch: configuration error: checkpoint.load: {missing} does not exist; give a "
                        "run, checkpoints or step directory of a saved run")
    assert not (tmp_path / "runs").exists()


def test_dry_run_shows_each_phase_and_its_dependency(tmp_path, capsys):
    code = main(["launch", two_phases(tmp_path), "--slurm", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("#!/bin/bash\n") == 2
    assert "'--dependency=afterok:<job id of phase pretrain>' --kill-on-invalid-dep=yes" in err
    assert not (tmp_path / "runs").exists()


def stand_in(run, *args: str):
    job = dataclasses.replace(run.job, command=(sys.executable, str(PHASE), str(run.job.run_dir), *args),
                              nproc_per_node=1)
    return dataclasses.replace(run, job=job)


def test_dependent_jobs_on_slurm(slurm, tmp_path, capsys):
    runs = [stand_in(r) for r in prepare_runs(two_phases(tmp_path), [], {}, None, local=False)]
    assert launch_slurm(runs) == 0
    first, second = capsys.readouterr().out.split()
    assert slurm.job(second)["Dependency"] == f"afterok:{first}(unfulfilled)"
    assert slurm.wait_done(second, timeout=120)["JobState"] == "COMPLETED"
    seen = json.loads((runs[1].job.run_dir / "seen.json").read_text())
    assert seen["previous_finished"], "phase 2 started before phase 1 finished"
    assert seen["load"] == str(runs[0].job.run_dir / "checkpoints") and seen["load_optimizer"] is False
    assert json.loads(runs[1].job.dir.plan.read_text())["jobs"] == [second]


def test_failed_phase_cancels_the_next(slurm, tmp_path, capsys):
    prepared = prepare_runs(two_phases(tmp_path), [], {}, None, local=False)
    runs = [stand_in(prepared[0], "--fail"), stand_in(prepared[1])]
    assert launch_slurm(runs) == 0
    first, second = capsys.readouterr().out.split()
    assert slurm.wait_done(first, timeout=60)["JobState"] == "FAILED"
    assert slurm.wait_done(second, timeout=60)["JobState"] == "CANCELLED"
    assert not (runs[1].job.run_dir / "seen.json").exists()
