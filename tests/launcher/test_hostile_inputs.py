"""Hostile strings through every flag: nothing is executed, the script parses, values survive.

Each value either is refused as a configuration error (exit 2, naming the field, nothing
written) or arrives byte for byte where it belongs: in the ``#SBATCH`` options as sbatch
parses them, in srun's argv, or in the ranks' environment, with the script run by bash
(stub srun/scontrol) and, for the directives, by a real sbatch (job held, then cancelled).
"""

from __future__ import annotations

import shlex
import subprocess

import pytest
import yaml
from launcher_helpers import RECIPES, run_script_with_stubs, sbatch_options

from megatron_s2.cli import main

pytestmark = pytest.mark.usefixtures("no_cluster")

RECIPE = str(RECIPES / "tiny_4rank.yaml")


def hostile_values(pwned) -> list[str]:
    return [
        "two words", "it's", 'say "hi"', f"$(touch {pwned})", f"`touch {pwned}`", f"x; touch {pwned}",
        f"x && touch {pwned} #", f"line\ntouch {pwned}", "back\\slash\\", "#not-a-comment", "${HOME}", "*", "a|b>c",
    ]


# flag -> where the value must arrive: ("sbatch", option prefix) | ("srun", argv prefix) | ("env", NAME)
FLAGS = {
    "--partition": ("sbatch", "--partition="),
    "--account": ("sbatch", "--account="),
    "--job-name": ("sbatch", "--job-name="),
    "--sbatch-arg": ("sbatch", ""),
    "--srun-arg": ("srun", ""),
    "--mpi": ("srun", "--mpi="),
    "--container-image": ("srun", "--container-image="),
    "--python": ("srun", ""),
    "--env": ("env", "HOSTILE"),
}


def launch_dry_run(capsys, tmp_path, *args: str, overrides: tuple[str, ...] = ()) -> tuple[int, str, str]:
    code = main(["launch", RECIPE, *overrides, "--slurm", "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def srun_words(script: str) -> list[str]:
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return shlex.split(line)[:-1]


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_hostile_value_through_flag(flag, capsys, tmp_path):
    pwned = tmp_path / "pwned"
    where, key = FLAGS[flag]
    for value in hostile_values(pwned):
        arg = f"HOSTILE={value}" if flag == "--env" else value
        code, script, err = launch_dry_run(capsys, tmp_path, "--run-dir", str(tmp_path / "run"), f"{flag}={arg}")
        if code == 2:
            assert "\n" in value, f"{flag} refused a value it should quote: {value!r}: {err}"
            assert "launcher." in err and "newline" in err
            continue
        assert code == 0, err
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0, (flag, value)
        if where == "sbatch":
            assert f"{key}{value}" in sbatch_options(script), (flag, value)
        script_path = tmp_path / "job.sbatch"
        script_path.write_text(script)
        result = run_script_with_stubs(script_path, tmp_path / "stubs")
        assert not pwned.exists(), f"{flag}={value!r} executed code"
        assert result.srun is not None, result.output
        if where == "srun":
            assert f"{key}{value}" in result.srun["argv"], (flag, value, result.srun["argv"])
        if where == "env":
            assert result.srun["env"]["HOSTILE"] == value


def test_hostile_run_dir_and_mounts(capsys, tmp_path):
    pwned = tmp_path / "pwned"
    for value in hostile_values(pwned):
        run_dir = tmp_path / f"run {value}"
        mount = f"/src {value}:/dst"
        code, script, err = launch_dry_run(capsys, tmp_path, "--run-dir", str(run_dir), "--mount", mount)
        if code == 2:
            assert "\n" in value or "\\" in value, f"refused {value!r}: {err}"
            continue
        assert code == 0, err
        assert f"--output={run_dir}/slurm/job-%j.out" in sbatch_options(script)
        script_path = tmp_path / "job.sbatch"
        script_path.write_text(script)
        result = run_script_with_stubs(script_path, tmp_path / "stubs")
        assert not pwned.exists(), f"run dir {value!r} executed code"
        argv = result.srun["argv"]
        assert argv[-1] == str(run_dir) and argv[-3] == f"{run_dir}/launch/config.yaml"
        assert f"--container-mounts={mount}" in argv
        assert f"--output={run_dir}/logs/restart0/rank%t.log" in argv
        assert (run_dir / "logs" / "restart0").is_dir()


def test_hostile_recipe_env_default_and_bad_names(capsys, tmp_path):
    pwned = tmp_path / "pwned"
    recipe = tmp_path / "recipe.yaml"
    value = f"$(touch {pwned}) `touch {pwned}`; it's \"q\"\nsecond line"
    recipe.write_text(yaml.safe_dump({"base": RECIPE, "launcher": {"env": {"NASTY": value}}}))
    code = main(["launch", str(recipe), "--slurm", "--dry-run", "--run-dir", str(tmp_path / "run")])
    script, err = capsys.readouterr()
    assert code == 0, err
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = run_script_with_stubs(path, tmp_path / "stubs")
    assert not pwned.exists()
    assert result.srun["env"]["NASTY"] == value
    for bad in ("A B=1", "$(touch x)=1", "1X=2", "X;Y"):
        code, _, err = launch_dry_run(capsys, tmp_path, "--env", bad)
        assert code == 2 and "not a valid environment variable name" in err


def test_sbatch_reads_hostile_directives_back(slurm, capsys, tmp_path):
    """The real sbatch parser: a held job shows the exact job name and output path."""
    pwned = tmp_path / "pwned"
    name = f"it's \"$(touch {pwned})\" `id` #x"
    run_dir = tmp_path / f"run 'a' \"b\" $(touch {pwned}) #c"
    code, script, err = launch_dry_run(capsys, tmp_path, "--run-dir", str(run_dir), "--job-name", name,
                                       "--nproc-per-node", "1", overrides=("parallel.tp=1", "parallel.dp=1"))
    assert code == 0, err
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    job_id = slurm.sbatch("--hold", str(path))
    try:
        out = slurm.run(["scontrol", "show", "job", job_id]).stdout
        assert f"JobName={name}\n" in out.replace("   ", "\n").replace(" UserId", "\nUserId")
        assert f"StdOut={run_dir}/slurm/job-{job_id}.out" in out
    finally:
        slurm.run(["scancel", job_id])
    assert not pwned.exists()


@pytest.mark.parametrize("flag", ["--time", "--signal", "--signal-lead-time", "--nodes"])
def test_validated_flags_refuse_hostile_values(flag, capsys, tmp_path):
    field = "launcher." + flag.lstrip("-").replace("-", "_")
    for value in hostile_values(tmp_path / "pwned"):
        try:
            code, _, err = launch_dry_run(capsys, tmp_path, f"{flag}={value}")
        except SystemExit as exc:  # argparse refuses a non-integer
            code, err = exc.code, capsys.readouterr().err
        assert code == 2, (flag, value)
        assert field in err or "invalid int value" in err, err
    assert not (tmp_path / "pwned").exists()
