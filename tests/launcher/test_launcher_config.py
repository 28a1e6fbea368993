"""The ``launcher:`` recipe section, command-line flags over it, and the preemption guard."""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from launcher_helpers import RECIPES

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.cli import launcher_flags
from megatron_s2.launcher.environment import parse_env_flags, rank_environment
from megatron_s2.launcher.launch import apply_launcher_flags
from megatron_s2.runtime.preemption import EXIT_PREEMPTED, PreemptionGuard

RECIPE = RECIPES / "tiny_4rank.yaml"


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("1-12", 129600),
                                           ("1-12:30", 131400), ("2-00:00:05", 172805)])
def test_time_limits(text, seconds):
    assert LauncherConfig(time=text, signal_lead_time=60).time_limit_seconds() == seconds


@pytest.mark.parametrize("kwargs, field", [
    ({"nodes": 0}, "launcher.nodes"),
    ({"time": "4 hours"}, "launcher.time"),
    ({"time": "00:01:00", "signal_lead_time": 60}, "launcher.signal_lead_time"),
    ({"signal": "KILL"}, "launcher.signal"),
    ({"gpus_per_node": 4, "nproc_per_node": 8}, "launcher.nproc_per_node"),
    ({"container_mounts": ("/a",)}, "launcher.container_mounts"),
    ({"container_mounts": ("/a:/b,/c:/d",)}, "launcher.container_mounts"),
    ({"env": {"BAD NAME": "1"}}, "launcher.env"),
    ({"env_passthrough": ("X-Y",)}, "launcher.env_passthrough"),
    ({"partition": "a\nb"}, "launcher.partition"),
    ({"srun_args": ("--x\r",)}, "launcher.srun_args"),
    ({"max_restarts": -1}, "launcher.max_restarts"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LauncherConfig(**kwargs)


def test_recipe_section_is_strict_and_round_trips(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"base": str(RECIPE), "launcher": {"node": 2}}))
    with pytest.raises(ConfigError, match="unknown key 'launcher.node'; did you mean 'nodes'"):
        load_recipe(bad)
    recipe = load_recipe(RECIPE, ["launcher.container_mounts=[/a:/b]", "launcher.mode=torchrun"])
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(recipe.to_yaml())
    assert load_recipe(resolved) == recipe, "the job directory's config.yaml reproduces the run"


def test_flags_replace_scalars_and_extend_lists():
    base = LauncherConfig(srun_args=("--cpu-bind=none",), env={"A": "1"}, env_override={"B": "2"}, partition="p")
    merged = apply_launcher_flags(base, {"partition": "q", "srun_args": ("--exclusive", "--cpu-bind=none"),
                                         "env_override": {"C": "3"}})
    assert merged.partition == "q"
    assert merged.srun_args == ("--cpu-bind=none", "--exclusive")
    assert merged.env_override == {"B": "2", "C": "3"} and merged.env == {"A": "1"}


def test_env_flags_split_into_overrides_and_passthrough():
    assert parse_env_flags(["A=1", "B", "C=x=y", "B", "D="]) == ({"A": "1", "C": "x=y", "D": ""}, ("B",))


def test_command_line_to_fields():
    from argparse import ArgumentParser

    from megatron_s2.launcher.cli import register

    parser = ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["launch", "r.yaml", "a.b=1", "--slurm", "--nodes", "2", "--mount", "/x:/y",
                              "--env", "K=v", "--env", "P", "--srun-arg=--exclusive", "--nproc", "4"])
    assert launcher_flags(args) == {"nodes": 2, "nproc_per_node": 4, "container_mounts": ("/x:/y",),
                                    "srun_args": ("--exclusive",), "env_override": {"K": "v"},
                                    "env_passthrough": ("P",)}
    assert args.overrides == ["a.b=1"]


def test_local_rank_environment():
    config = LauncherConfig(env={"NCCL_DEBUG": "WARN", "X": "default"}, env_override={"Y": "forced"},
                            env_passthrough=("TOKEN",))
    env = rank_environment(config, {"X": "shell", "Y": "shell", "TOKEN": "t"}, nproc_local=2)
    assert (env["NCCL_DEBUG"], env["X"], env["Y"], env["TOKEN"]) == ("WARN", "shell", "forced", "t")
    with pytest.raises(ConfigError, match="launcher.env_passthrough: TOKEN not set"):
        rank_environment(config, {}, nproc_local=2)


def test_exit_code_is_distinct():
    assert EXIT_PREEMPTED not in (0, 1, 2, 124, 125, 126, 127) and EXIT_PREEMPTED < 128


def test_guard_sets_a_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionGuard(("USR1", "TERM")) as guard:
        assert not guard.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.received == signal.SIGUSR1 and guard.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.received == signal.SIGUSR1, "the first signal is kept"
    assert signal.getsignal(signal.SIGUSR1) == before
    assert PreemptionGuard.from_config(LauncherConfig(signal="USR2")).signals == (signal.SIGUSR2, signal.SIGTERM,
                                                                                    signal.SIGINT)
