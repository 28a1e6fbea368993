"""`megatron-s2 launch` end to end: resolve, pre-flight, write the job directory, run or submit.

Everything that can be wrong with a request is found by :func:`prepare_runs` (recipes,
layouts, rank geometry, paths, environment) before any process starts or any job is
queued; :func:`launch_local` and :func:`launch_slurm` then only execute.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.config.recipe import RecipeConfig, load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.capacity import check_capacity
from megatron_s2.launcher.environment import check_passthrough
from megatron_s2.launcher.job import JobDir, JobSpec, rank_python, trainer_command
from megatron_s2.launcher.disaggregated import ServedRoles, ServerStartError, initial_weights, is_disaggregated, slurm_roles
from megatron_s2.launcher.local import LocalRun
from megatron_s2.launcher.pipeline import chain_from, is_pipeline_file, load_pipeline
from megatron_s2.launcher.summary import summarise
from megatron_s2.launcher.preflight import LaunchPlan, plan_launch
from megatron_s2.launcher.sbatch_script import render_sbatch_script, srun_line
from megatron_s2.launcher.slurm import SlurmError, cancel, sbatch_argv, submit
from megatron_s2.runtime.markers import extension_hint, finished_step
from megatron_s2.runtime.run_lock import LOCK_TOKEN_ENV, RunLock

__all__ = ["PreparedRun", "prepare_runs", "launch_local", "launch_slurm", "apply_launcher_flags"]


@dataclass(frozen=True)
class PreparedRun:
    phase: str
    """Phase name ("" for a single recipe)."""
    recipe: RecipeConfig
    """Resolved recipe, run directory and launcher flags applied."""
    plan: LaunchPlan
    job: JobSpec

    @property
    def finished(self) -> bool:
        """Finished up to this recipe's ``training.train_steps`` (a larger target extends it)."""
        return self.job.finished

    def finished_message(self) -> str:
        step = finished_step(self.job.run_dir)
        return (f"{self.job.dir.finished} says the run finished at step {step} (training.train_steps="
                f"{self.recipe.training.train_steps}); {extension_hint(step)}")


def apply_launcher_flags(config: LauncherConfig, flags: dict) -> LauncherConfig:
    """Command-line values over the recipe's ``launcher:`` section. Scalars replace; list
    flags (``--mount``, ``--srun-arg``, ``--sbatch-arg``, ``--env``) add to the recipe's."""
    changes = {}
    for name, value in flags.items():
        current = getattr(config, name)
        if isinstance(current, tuple):
            value = current + tuple(v for v in value if v not in current)
        elif isinstance(current, dict):
            value = {**current, **value}
        changes[name] = value
    return dataclasses.replace(config, **changes)


def _prepare(recipe: RecipeConfig, phase: str, job_name: str, run_dir: Path, local: bool,
             pending: tuple[str, ...] = ()) -> PreparedRun:
    """``pending``: run directories of the pipeline's earlier phases (checkpoints there may not exist yet)."""
    training = dataclasses.replace(recipe.training, run_dir=str(run_dir))
    launcher = recipe.launcher
    if not launcher.job_name:
        launcher = dataclasses.replace(launcher, job_name=job_name)
    recipe = recipe.replace(training=training, launcher=launcher)
    plan = plan_launch(recipe, local=local, pending=pending)
    check_passthrough(launcher)
    roles = None
    if is_disaggregated(recipe):  # inference servers and an orchestrator beside the trainer ranks
        initial_weights(recipe)  # refused now, not when the servers start
        if not local:
            roles = slurm_roles(recipe, run_dir, JobDir(run_dir).config, rank_python(launcher), plan.gpus_per_node)
    job = JobSpec(name=launcher.job_name, run_dir=run_dir, command=trainer_command(launcher, run_dir),
                  nodes=plan.nodes, nproc_per_node=plan.nproc_per_node, gpus_per_node=plan.gpus_per_node,
                  launcher=launcher, train_steps=recipe.training.train_steps, roles=roles)
    if not local:
        render_sbatch_script(job)  # refuses run directories SLURM cannot name
        check_capacity(job)
    return PreparedRun(phase, recipe, plan, job)


def prepare_runs(path: str, overrides: list[str], launcher_flags: dict, run_dir: str | None,
                 local: bool) -> list[PreparedRun]:
    """Resolve and pre-flight a recipe, or every phase of a pipeline file, in order."""
    if not is_pipeline_file(path):
        scoped = [o for o in overrides if _phase_of(o)]
        if scoped:
            raise ConfigError(f"{scoped[0]}: 'PHASE:section.key=value' scopes an override to one phase of a pipeline "
                              f"file; {path} is a single recipe, so drop the 'PHASE:' prefix")
        recipe = load_recipe(path, overrides)
        recipe = recipe.replace(launcher=apply_launcher_flags(recipe.launcher, launcher_flags))
        target = Path(os.path.abspath(run_dir or recipe.training.run_dir))
        return [_prepare(recipe, "", Path(path).stem, target, local)]
    pipeline = load_pipeline(path)
    base = run_dir or pipeline.run_dir
    if not base:
        raise ConfigError("run_dir: a pipeline needs a parent run directory; add run_dir: to "
                          f"{path} or pass --run-dir")
    # scoped or not (``sft:training.run_dir=...``): each phase's directory is <run_dir>/<phase name>
    moved = [o for o in overrides if o.split("=", 1)[0].split(":", 1)[-1].strip() == "training.run_dir"]
    if moved:
        raise ConfigError(f"training.run_dir: a pipeline puts each phase in <run_dir>/<phase name>; give the parent "
                          f"directory as --run-dir instead of the override {moved[0]!r}")
    scoped = phase_overrides(overrides, [entry.name for entry in pipeline.phases])
    runs: list[PreparedRun] = []
    phase_dirs: dict[str, str] = {}
    for index, entry in enumerate(pipeline.phases):
        try:
            recipe = load_recipe(entry.recipe, [*entry.overrides, *scoped[entry.name]], phase_dirs=phase_dirs)
        except ConfigError as exc:
            # unscoped command-line overrides reach every phase: say which phase refused them
            raise ConfigError(f"phase {entry.name}: {exc}") from None
        recipe = recipe.replace(launcher=apply_launcher_flags(recipe.launcher, launcher_flags))
        if pipeline.chained(index):
            recipe = chain_from(recipe, runs[-1].job.run_dir)
        target = Path(os.path.abspath(Path(base) / entry.name))
        # Checkpoints under an earlier phase's run directory are written before this phase starts;
        # every other path it loads must exist now (refused before the first phase starts).
        runs.append(_prepare(recipe, entry.name, f"{Path(path).stem}-{entry.name}", target, local,
                             pending=tuple(phase_dirs.values())))
        phase_dirs[entry.name] = str(target)
    return runs


def _phase_of(override: str) -> str | None:
    """``rl:rl.rollout.batch_size=8`` -> ``rl``; ``None`` for an override of every phase. Only the
    key side is looked at: values may hold colons (URLs, ``${phase:sft}`` references)."""
    key = override.split("=", 1)[0]
    return key.split(":", 1)[0].strip() if ":" in key else None


def phase_overrides(overrides: list[str], phases: list[str]) -> dict[str, list[str]]:
    """The command-line overrides each phase of a pipeline gets, in order: ``section.key=value``
    reaches every phase, ``PHASE:section.key=value`` only the phase named ``PHASE`` (an
    ``rl.*`` override would fail the SFT phase's check, and a batch shrunk for the RL phase must
    not shrink the SFT one)."""
    out: dict[str, list[str]] = {name: [] for name in phases}
    for override in overrides:
        phase = _phase_of(override)
        if phase is None:
            for name in phases:
                out[name].append(override)
        elif phase in out:
            out[phase].append(override.split(":", 1)[1].strip())
        else:
            raise ConfigError(f"{override}: no phase named '{phase}' in this pipeline (phases: {', '.join(phases)})")
    return out


def _write_job_dir(run: PreparedRun, mode: str) -> JobDir:
    jobdir = run.job.dir
    jobdir.config.parent.mkdir(parents=True, exist_ok=True)
    jobdir.config.write_text(run.recipe.to_yaml())
    jobdir.write_plan({"mode": mode, "phase": run.phase, "world_size": run.plan.world_size,
                       "nodes": run.plan.nodes, "nproc_per_node": run.plan.nproc_per_node,
                       "gpus_per_node": run.plan.gpus_per_node, "layout": run.plan.layout.describe(),
                       "command": list(run.job.command), "argv": sys.argv, "jobs": jobdir.read_plan().get("jobs", [])})
    return jobdir


def _say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def launch_local(runs: list[PreparedRun], dry_run: bool = False) -> int:
    """Run the phases one after the other on this machine; stop at the first that fails."""
    for run in runs:
        label = f"phase {run.phase}: " if run.phase else ""
        if run.finished:
            _say(f"{label}skipping: {run.finished_message()}")
            continue
        if dry_run:
            _say(f"{label}{run.plan.describe()}")
            print(shlex.join(run.job.command))
            if is_disaggregated(run.recipe):
                _say(f"{label}beside the ranks: {run.recipe.rl.disaggregated.num_servers} inference server(s) "
                     "(megatron-s2 serve) and the orchestrator (megatron-s2 orchestrate), started first")
            continue
        # The launcher holds the run directory for its ranks (they inherit it by token), so a
        # second launch is refused before it rewrites anything here — in one line: the plan is
        # described only once the directory is ours.
        with RunLock(run.job.run_dir, log=_say).acquire("megatron-s2 launch --local") as lock:
            _say(f"{label}{run.plan.describe()}")
            _write_job_dir(run, "local")
            local = LocalRun(run.job, env={LOCK_TOKEN_ENV: lock.token})
            roles = None
            if is_disaggregated(run.recipe):  # inference servers and the orchestrator beside the trainer
                try:
                    roles = ServedRoles(run.recipe, run.job.run_dir, run.job.dir.config, local.log_dir,
                                        python=rank_python(run.recipe.launcher), say=_say).start()
                except ServerStartError as exc:
                    print(f"megatron-s2 launch: {exc}", file=sys.stderr)
                    return exc.exit_code
            try:
                code = local.run()
            finally:
                if roles is not None:
                    roles.stop()
        if code != 0:
            return code
    if len(runs) > 1 and not dry_run:
        print(summarise([(run.phase, run.job.run_dir) for run in runs]), flush=True)
    return 0


def launch_slurm(runs: list[PreparedRun], dry_run: bool = False) -> int:
    """Write and submit one batch job per phase, each depending on the previous one."""
    submitted: list[str] = []
    previous: str | None = None
    for run in runs:
        label = f"phase {run.phase}: " if run.phase else ""
        if run.finished:
            _say(f"{label}not submitting: {run.finished_message()}")
            continue
        script = render_sbatch_script(run.job)
        if not dry_run:
            RunLock.refuse_if_held(run.job.run_dir)  # a run going on there now (the job would fail)
        if dry_run:
            print(script, end="")
            _say(f"{label}{run.plan.describe()}")
            _say(f"srun line: {srun_line(run.job)}")
            if run.job.roles is not None:
                _say(f"heterogeneous job: trainer ranks (component 0), {run.job.roles.servers} inference server(s) "
                     f"on ports {run.job.roles.port}..{run.job.roles.port + run.job.roles.servers - 1} (server i on "
                     f"{run.job.roles.port} + i; component 1), the orchestrator (component 2)")
            _say(f"would run: {shlex.join(sbatch_argv(run.job.dir.script, previous))}")
            previous = f"<job id of phase {run.phase}>"
            continue
        jobdir = _write_job_dir(run, "slurm")
        jobdir.slurm_dir.mkdir(parents=True, exist_ok=True)
        jobdir.script.write_text(script)
        try:
            job_id = submit(jobdir.script, previous)
        except SlurmError as exc:
            if submitted:
                cancel(submitted)
                _say(f"cancelled the phases already submitted ({', '.join(submitted)})")
            print(f"megatron-s2 launch: {exc}", file=sys.stderr)
            return 1
        plan = jobdir.read_plan()
        jobdir.write_plan({**plan, "jobs": plan.get("jobs", []) + [job_id]})
        submitted.append(job_id)
        previous = job_id
        after = f" after job {submitted[-2]}" if len(submitted) > 1 else ""
        _say(f"{label}submitted job {job_id}{after}: {run.plan.describe()}")
        _say(f"{label}batch log {jobdir.slurm_dir}/job-{job_id}.out, rank logs {jobdir.logs}/restart<N>/")
        print(job_id)
    return 0

