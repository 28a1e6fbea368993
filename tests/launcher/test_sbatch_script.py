"""The generated batch script: structure (dry run parsed back) and behaviour (run with stub srun)."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys

import pytest
from launcher_helpers import RECIPES, RESUMABLE, payload_job, run_script_with_stubs, sbatch_options

from megatron_s2.cli import main
from megatron_s2.runtime.preemption import EXIT_PREEMPTED
from megatron_s2.launcher.sbatch_script import render_sbatch_script

pytestmark = pytest.mark.usefixtures("no_cluster")

RECIPE = str(RECIPES / "tiny_4rank.yaml")


def dry_run(capsys, tmp_path, *flags: str) -> tuple[str, str]:
    code = main(["launch", RECIPE, "--slurm", "--dry-run", "--run-dir", str(tmp_path / "run"), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def srun_argv(script: str) -> list[str]:
    lines = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])
    assert argv[-1] == "&"
    return argv[:-1]


def test_dry_run_script_structure(capsys, tmp_path):
    script, err = dry_run(capsys, tmp_path, "--nodes", "2", "--nproc-per-node", "2", "--partition", "batch",
                          "--time", "01:00:00", "--account", "proj")
    run_dir = tmp_path / "run"
    assert script.startswith("#!/bin/bash\n")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    options = sbatch_options(script)
    assert options == ["--job-name=tiny_4rank", "--nodes=2", "--ntasks-per-node=2", "--partition=batch",
                       "--account=proj", "--time=01:00:00", "--signal=B:USR1@120", "--requeue",
                       "--open-mode=append", f"--output={run_dir}/slurm/job-%j.out"]
    argv = srun_argv(script)
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
                        "--output=$LOG_DIR/rank%t.log"]
    assert not any(a.startswith(("--mpi", "--container")) for a in argv), "nothing forced on the site"
    assert argv[5:] == [sys.executable, "-m", "megatron_s2.cli", "train", f"{run_dir}/launch/config.yaml",
                        "--run-dir", str(run_dir)]
    assert "srun line: srun --nodes=2" in err and "would run: sbatch --parsable" in err
    assert not run_dir.exists(), "a dry run writes nothing"


def test_optional_site_flags_only_when_asked(capsys, tmp_path):
    script, _ = dry_run(capsys, tmp_path, "--mpi", "pmix", "--container-image", "nvcr.io/nvidia/pytorch:25.01",
                        "--mount", "/lustre:/lustre", "--mount", "/scratch:/scratch:ro", "--srun-arg=--cpu-bind=none",
                        "--sbatch-arg=--exclusive", "--gpus-per-node", "4")
    argv = srun_argv(script)
    assert "--mpi=pmix" in argv
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01" in argv
    assert "--container-mounts=/lustre:/lustre,/scratch:/scratch:ro" in argv
    assert "--cpu-bind=none" in argv
    assert argv[argv.index("--cpu-bind=none") + 1] == "python", "inside a container ranks use its python"
    options = sbatch_options(script)
    assert "--gpus-per-node=4" in options and "--exclusive" in options and "--ntasks-per-node=4" in options


def test_torchrun_mode_runs_one_agent_per_node(capsys, tmp_path):
    script, _ = dry_run(capsys, tmp_path, "--mode", "torchrun", "--nodes", "2", "--nproc-per-node", "2")
    assert "--ntasks-per-node=1" in sbatch_options(script)
    argv = srun_argv(script)
    assert "--output=$LOG_DIR/node%n.log" in argv
    bash = argv.index("bash")
    assert argv[bash + 1:bash + 3] == ["-c", "trap '' USR1; exec \"$@\""], "the agent must survive SIGUSR1"
    agent = argv[bash + 4:]
    assert agent[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--max-restarts=0", "--no-python",
            "--rdzv-endpoint=$HEAD_NODE:$RDZV_PORT"} <= set(agent)
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script


def test_preflight_rejects_impossible_layout_before_anything(capsys, tmp_path):
    code = main(["launch", RECIPE, "--slurm", "--nodes", "3", "--run-dir", str(tmp_path / "run")])
    _, err = capsys.readouterr()
    assert code == 2
    assert "launcher.nodes" in err and "--nodes" in err
    code = main(["launch", RECIPE, "parallel.dp=0", "--slurm", "--nproc-per-node", "3",
                 "--run-dir", str(tmp_path / "run")])
    _, err = capsys.readouterr()
    assert code == 2 and "parallel" in err and "tp*pp*cp" in err
    code = main(["launch", RECIPE, "--slurm", "--time", "00:01:00", "--signal-lead-time", "300"])
    _, err = capsys.readouterr()
    assert code == 2 and "launcher.signal_lead_time" in err
    assert not (tmp_path / "run").exists()


# ---- behaviour: the script run by bash with recording stand-ins for srun and scontrol ------
@pytest.fixture
def stub_job(tmp_path):
    def make(**launcher):
        job = payload_job(tmp_path / "run", RESUMABLE, **launcher)
        job.dir.slurm_dir.mkdir(parents=True, exist_ok=True)
        job.dir.script.write_text(render_sbatch_script(job))
        return job
    return make


def test_env_defaults_lose_to_the_shell_overrides_win_passthrough_unwritten(stub_job, tmp_path, monkeypatch):
    job = stub_job(env={"NCCL_DEBUG": "WARN", "NCCL_IB_TIMEOUT": "22"}, env_override={"FORCED": "from-flag"},
                   env_passthrough=("SECRET_TOKEN",))
    shell = {"NCCL_DEBUG": "INFO", "FORCED": "from-shell", "SECRET_TOKEN": "s3cr3t-value"}
    result = run_script_with_stubs(job.dir.script, tmp_path / "stubs", env=shell)
    env = result.srun["env"]
    assert env["NCCL_DEBUG"] == "INFO", "the submitting shell overrides a recipe default"
    assert env["NCCL_IB_TIMEOUT"] == "22", "a recipe default applies when the shell has none"
    assert env["FORCED"] == "from-flag", "--env NAME=VALUE is set whatever the shell says"
    assert env["SECRET_TOKEN"] == "s3cr3t-value", "--env NAME reaches the ranks"
    assert "s3cr3t-value" not in job.dir.script.read_text(), "--env NAME is never written into the script"


@pytest.mark.parametrize("restart, srun_rc, marker, requeued, code", [
    (0, EXIT_PREEMPTED, "", True, EXIT_PREEMPTED),   # preempted ranks: requeue
    (2, EXIT_PREEMPTED, "", True, EXIT_PREEMPTED),
    (3, EXIT_PREEMPTED, "", False, EXIT_PREEMPTED),  # restart limit (max_restarts=3) reached
    (0, 1, "", False, 1),                            # a crash is a failure, not a preemption
    # srun --kill-on-bad-exit killed the slower ranks (143) / torchrun reported 1 after a saved preemption
    (0, 143, "PREEMPTED", True, EXIT_PREEMPTED),
    (1, 1, "PREEMPTED", True, EXIT_PREEMPTED),
    (3, 143, "PREEMPTED", False, EXIT_PREEMPTED),
    (0, 0, "FINISHED", False, 0),                    # the run completed
    (0, 0, "", True, EXIT_PREEMPTED),                # exit 0 but nothing says how: try again ...
    (3, 0, "", False, 1),                            # ... within the limit, then a failure
])
def test_requeue_decision(stub_job, tmp_path, restart, srun_rc, marker, requeued, code):
    job = stub_job(max_restarts=3)
    writes = None
    if marker:
        writes = (job.run_dir / marker, '{"step": 6, "loss": 1.0}' if marker == "FINISHED" else '{"step": 3}')
    result = run_script_with_stubs(job.dir.script, tmp_path / "stubs", srun_rc=srun_rc, restart=restart,
                                   srun_writes=writes)
    assert result.srun is not None
    assert result.returncode == code, result.output
    assert (["requeue 4242"] if requeued else []) == [c for c in result.scontrol if c.startswith("requeue")]
    assert (job.dir.logs / f"restart{restart}").is_dir()


def test_stale_preempted_marker_is_cleared_before_the_step(stub_job, tmp_path):
    job = stub_job(max_restarts=3)
    (job.run_dir / "PREEMPTED").write_text('{"step": 1}')  # from the previous attempt
    result = run_script_with_stubs(job.dir.script, tmp_path / "stubs", srun_rc=1, restart=1)
    assert result.returncode == 1 and not [c for c in result.scontrol if c.startswith("requeue")], result.output
    assert not (job.run_dir / "PREEMPTED").exists()


def test_finished_marker_stops_start_and_requeue(stub_job, tmp_path):
    job = stub_job()
    job.dir.finished.write_text('{"step": 6, "loss": 1.0}')
    result = run_script_with_stubs(job.dir.script, tmp_path / "stubs", srun_rc=EXIT_PREEMPTED, restart=1)
    assert result.returncode == 0 and result.srun is None and result.scontrol == []
    assert "FINISHED exists" in result.output and "raise training.train_steps" in result.output


def test_finished_at_a_lower_target_is_extended(tmp_path):
    """FINISHED at step 6 of a job now targeting 10 steps: the script starts the step."""
    job = dataclasses.replace(payload_job(tmp_path / "run", RESUMABLE), train_steps=10)
    job.dir.slurm_dir.mkdir(parents=True, exist_ok=True)
    job.dir.script.write_text(render_sbatch_script(job))
    job.dir.finished.write_text('{"step": 6, "loss": 1.0}')
    result = run_script_with_stubs(job.dir.script, tmp_path / "stubs", srun_rc=0, restart=0,
                                   srun_writes=(job.dir.finished, '{"step": 10, "loss": 0.5}'))
    assert result.srun is not None and result.returncode == 0, result.output
    assert "run complete" in result.output


def test_disaggregated_rl_is_one_heterogeneous_job(capsys, tmp_path):
    """recipes/rl_tiny_async.yaml's rl phase (rl.mode: disaggregated, issue 25): the trainer ranks,
    the inference servers (one node each) and the orchestrator are the three components of one
    heterogeneous job; the servers start from the SFT phase's checkpoint, the orchestrator gets
    their URLs, the trainer step runs on component 0."""
    code = main(["launch", str(RECIPES.parents[2] / "recipes" / "rl_tiny_async.yaml"), "--slurm", "--dry-run",
                 "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    script = out[out.rindex("#!/bin/bash"):]  # the rl phase's (the sft phase's comes first)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    options = sbatch_options(script)
    first, second = options.index("hetjob"), options.index("hetjob", options.index("hetjob") + 1)
    assert options[first:second] == ["hetjob", "--nodes=2", "--ntasks-per-node=1"]  # the servers
    assert options[second:] == ["hetjob", "--nodes=1", "--ntasks=1"]  # the orchestrator
    lines = {line.split()[1]: line for line in script.splitlines() if line.startswith("srun ")}
    # server i is its own step on its own node (restarted alone when it dies): SERVER_INDEX=i srun ...
    lines["--het-group=1"] = next(line.strip() for line in script.splitlines() if " srun --het-group=1 " in line)
    assert set(lines) == {"--het-group=0", "--het-group=1", "--het-group=2"}
    # server i on port 8100 + i of its node; the orchestrator gets each node's address (its NodeAddr
    # where the name does not resolve) — run for real in test_disaggregated_slurm.py
    assert f"serve {tmp_path / 'run' / 'sft' / 'checkpoints'} --host 0.0.0.0 --served" in lines["--het-group=1"]
    assert lines["--het-group=1"].startswith("SERVER_INDEX=$1 srun --het-group=1 --nodes=1 --ntasks=1 "
                                             '--nodelist="${SERVER_NODES[$1]}"')
    assert """bash -c 'exec "$@" --port "$((SERVER_PORT + SERVER_INDEX))"' server""" in lines["--het-group=1"]
    assert "export SERVER_PORT=8100" in script.splitlines()
    assert lines["--het-group=2"].endswith('orchestrate ' + f"{tmp_path / 'run' / 'rl'}/launch/config.yaml --run-dir "
                                           f'{tmp_path / "run" / "rl"} --servers "$SERVERS" &')
    assert " train " in lines["--het-group=0"] and "heterogeneous job: trainer ranks (component 0), 2" in err


DRAFTER = ["rl:model.dspark_layers=2", "rl:model.dspark_block_size=4", "rl:model.dspark_noise_token_id=127",
           "rl:model.dspark_target_layer_ids=[5,6,7]", "rl:model.dspark_markov_rank=8",
           "rl:model.dspark_num_routed_experts=4", "rl:model.dspark_moe_topk=2"]


@pytest.mark.parametrize("speculative", [True, False])
def test_disaggregated_servers_speculate_when_the_rollout_engine_does(speculative, capsys, tmp_path):
    """``rl.rollout.engine.speculative: true`` in disaggregated mode was accepted and dropped: the
    servers decoded plainly. It now reaches them as ``--speculative``, which `serve` parses."""
    from megatron_s2.cli import build_parser

    code = main(["launch", str(RECIPES.parents[2] / "recipes" / "rl_tiny_async.yaml"), *DRAFTER,
                 f"rl:rl.rollout.engine.speculative={str(speculative).lower()}", "--slurm", "--dry-run",
                 "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    script = out[out.rindex("#!/bin/bash"):]
    server = next(line for line in script.splitlines() if " srun --het-group=1 " in line)
    argv = shlex.split(server.rstrip(" &"))
    argv = argv[argv.index("megatron_s2.cli") + 1:]
    assert argv[0] == "serve" and ("--speculative" in argv) == speculative, server
    assert build_parser().parse_args(argv).speculative == speculative
