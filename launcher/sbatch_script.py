"""The generated sbatch script: directives, environment, the training step and its lifecycle.

Two quoting regimes, because two parsers read the script:

- ``#SBATCH`` lines are read by sbatch, not bash. Its directive parser splits on whitespace,
  groups quoted text, takes ``\\x`` as ``x`` and drops everything after an unquoted ``#``;
  an escaped space still ends a word (SLURM 22.05). So an option holding whitespace,
  quotes, backslashes or ``#`` is written inside double quotes with ``\\`` and ``"``
  backslash-escaped (:func:`directive_word`). A newline cannot be represented there at all;
  such values are refused in the config.
- everything else is bash: every user value goes through :func:`shlex.quote`.

The batch shell traps the preemption signal (``--signal=B:<sig>@<lead>``) and SIGTERM,
forwards them to the srun step (srun relays them to every task; under torchrun the agent
ignores the warning signal so only the workers act on it), waits for the step, then:
the run is complete when ``<run_dir>/FINISHED`` records ``training.train_steps`` (never
requeue); a preempted run requeues itself with ``scontrol requeue`` until
``SLURM_RESTART_COUNT`` reaches ``launcher.max_restarts``. Preempted means: rank 0 wrote
``<run_dir>/PREEMPTED`` after saving (the signal may have gone to the ranks only, e.g.
``scancel --signal=USR1`` without ``--batch``, and srun's exit code is then a kill signal),
or the batch shell received the signal, or srun exited :data:`EXIT_PREEMPTED`. A step that
exits 0 without either marker did not run to the end (e.g. it failed to launch): it is
requeued within the same limit, then a failure (exit 1). Anything else is a failure and its
exit code is the job's.
"""

from __future__ import annotations

import re
import shlex

from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.disaggregated import MAX_FAILED_RESTARTS
from megatron_s2.launcher.job import FINISHED_MARKER, PREEMPTED_MARKER, JobSpec, rank_python
from megatron_s2.posttrain.disaggregated.exchange import ORCHESTRATOR_FAILED, SERVERS
from megatron_s2.runtime.preemption import EXIT_PREEMPTED
from megatron_s2.runtime.rendezvous import SLURM_PORT_BASE, SLURM_PORT_SPAN

__all__ = ["render_sbatch_script", "sbatch_directives", "srun_line", "directive_word"]

ROLE_STOP_S = 30
"""How long the role steps of a disaggregated RL job get to exit after SIGTERM once the trainer has ended."""

_DIRECTIVE_SPECIAL = re.compile(r"""[\s\\"'#]""")
_UNSAFE_PATH = re.compile(r"[\x00-\x1f\x7f%\\]")


def directive_word(text: str) -> str:
    """Quote ``text`` so sbatch's ``#SBATCH`` parser reads it back as exactly one argument."""
    if not _DIRECTIVE_SPECIAL.search(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_run_dir(job: JobSpec) -> None:
    if _UNSAFE_PATH.search(str(job.run_dir)):
        raise ConfigError(f"training.run_dir: {str(job.run_dir)!r} contains a control character, '%' or a "
                          "backslash, which SLURM file names cannot carry; choose another run directory")


def _role_directives(job: JobSpec) -> list[str]:
    """The further components of a heterogeneous job: the servers, then the orchestrator."""
    roles, cfg = job.roles, job.launcher
    servers = ["hetjob", f"--nodes={roles.servers}", "--ntasks-per-node=1"]
    if roles.server_gpus:
        servers.append(f"--gpus-per-node={roles.server_gpus}")
    orchestrator = ["hetjob", "--nodes=1", "--ntasks=1"]
    for component in (servers, orchestrator):
        component += [f"--{name}={getattr(cfg, name)}" for name in ("partition", "account") if getattr(cfg, name)]
    return servers + orchestrator


def _roles_block(job: JobSpec) -> list[str]:
    """Start the servers and the orchestrator as background steps (disaggregated RL)."""
    roles = job.roles
    if roles is None:
        return []
    q = shlex.quote
    server = " ".join(q(w) for w in roles.server_command)
    orchestrator = " ".join(q(w) for w in roles.orchestrator_command)
    exchange = q(str(roles.exchange))
    return [
        "# Disaggregated RL (rl.mode: disaggregated): inference servers on heterogeneous component 1, one per",
        "# node (server i on port SERVER_PORT + i, its own step), the orchestrator on component 2; the trainer",
        "# (component 0) and they only share the run directory. A server step that ends before the trainer is",
        "# started again on its node (the orchestrator re-routes its calls meanwhile and loads the current",
        f"# weights into it once it answers /health), up to {MAX_FAILED_RESTARTS} times in a row without serving; a",
        f"# server given up, or an orchestrator that fails, writes {ORCHESTRATOR_FAILED}, on which the trainer,",
        "# waiting for a batch, stops with its reason.",
        f"EXCHANGE={exchange}",
        f'FAILED_MARKER="$EXCHANGE/{ORCHESTRATOR_FAILED}"',
        f'rm -f "$FAILED_MARKER" "$EXCHANGE/{SERVERS}"  # a previous attempt\'s',
        f"export SERVER_PORT={roles.port}",
        f"MAX_SERVER_RESTARTS={MAX_FAILED_RESTARTS}",
        "node_addr() {  # a node's name when it resolves, else its NodeAddr (emulated nodes)",
        '    if getent hosts "$1" >/dev/null; then echo "$1"; else',
        '        scontrol show node "$1" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\'; fi',
        "}",
        "SERVERS=",
        "SERVER_NODES=()   # server i runs on SERVER_NODES[i] and answers on SERVER_ADDRS[i]:SERVER_PORT+i",
        "SERVER_ADDRS=()",
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1"); do',
        '    SERVER_NODES+=("$node"); SERVER_ADDRS+=("$(node_addr "$node")")',
        '    SERVERS="$SERVERS${SERVERS:+,}http://${SERVER_ADDRS[-1]}:$((SERVER_PORT + ${#SERVER_NODES[@]} - 1))"',
        "done",
        'log "inference servers (component 1): $SERVERS"',
        "declare -A SERVER_OF=()   # a running server step's pid -> the server's index",
        "SERVER_FAILS=()           # per server: restarts in a row that have not served yet",
        "ROLE_STEPS=",
        "start_server() {  # $1: the server's index; its log is appended to across restarts",
        "    SERVER_INDEX=$1 srun --het-group=1 --nodes=1 --ntasks=1 --nodelist=\"${SERVER_NODES[$1]}\" "
        '--output="$LOG_DIR/server$1.log" --open-mode=append '
        "bash -c 'exec \"$@\" --port \"$((SERVER_PORT + SERVER_INDEX))\"' server " + server + " &",
        '    SERVER_OF[$!]=$1',
        '    ROLE_STEPS="$ROLE_STEPS $!"',
        "}",
        "server_serves() {  # $1: the server's index; true when its /health answers 200",
        "    timeout 2 bash -c 'exec 3<>\"/dev/tcp/$1/$2\" && printf \"GET /health HTTP/1.0\\r\\n\\r\\n\" >&3 "
        '&& head -n 1 <&3 | grep -q " 200 "\' health "${SERVER_ADDRS[$1]}" "$((SERVER_PORT + $1))" 2>/dev/null',
        "}",
        'for i in "${!SERVER_NODES[@]}"; do SERVER_FAILS[$i]=0; start_server "$i"; done',
        'srun --het-group=2 --ntasks=1 --output="$LOG_DIR"/orchestrator.log '
        f'{orchestrator} --servers "$SERVERS" &',
        "ORCHESTRATOR_STEP=$!",
        'ROLE_STEPS="$ROLE_STEPS $ORCHESTRATOR_STEP"',
        "fail_run() {  # $1: why the run cannot go on (a reason already there, e.g. the orchestrator's, is kept)",
        '    log "$1"',
        '    [ -e "$FAILED_MARKER" ] || echo "$1" > "$FAILED_MARKER"',
        "}",
        "role_ended() {  # $1: the step's pid, $2: its exit code",
        '    if [ -n "${SERVER_OF[$1]:-}" ]; then',
        '        local i=${SERVER_OF[$1]}',
        '        unset "SERVER_OF[$1]"',
        '        if [ "${SERVER_FAILS[$i]}" -ge "$MAX_SERVER_RESTARTS" ]; then',
        '            fail_run "inference server $i (component 1) exited with code $2 after ${SERVER_FAILS[$i]} restarts that '
        'never served; giving it up; its log: $LOG_DIR/server$i.log"',
        "            return",
        "        fi",
        "        SERVER_FAILS[$i]=$((SERVER_FAILS[$i] + 1))",
        '        log "inference server $i (component 1) exited with code $2 before the trainer finished; '
        'restarting it on ${SERVER_NODES[$i]} (restart ${SERVER_FAILS[$i]} in a row; log: $LOG_DIR/server$i.log)"',
        '        start_server "$i"',
        "    elif [ \"$2\" = 0 ]; then",
        '        log "the orchestrator exited 0 (every batch written)"',
        "    else",
        '        fail_run "the orchestrator step (component 2) exited with code $2; its log: $LOG_DIR/orchestrator.log"',
        "    fi",
        "}",
        "servers_back() {  # a restarted server that answers /health has served: its restart count starts again",
        '    local i',
        '    for i in "${!SERVER_FAILS[@]}"; do',
        '        if [ "${SERVER_FAILS[$i]}" -gt 0 ] && server_serves "$i"; then',
        '            log "inference server $i is serving again"; SERVER_FAILS[$i]=0',
        "        fi",
        "    done",
        "}",
        "# The role steps still running once the trainer has ended get SIGTERM through scancel (srun itself",
        "# would answer SIGTERM with SIGKILL to its tasks); a server then stops serving and exits 0. srun is",
        "# killed after ROLE_STOP_S seconds if a task has not ended by then.",
        f"ROLE_STOP_S={ROLE_STOP_S}",
        "stop_roles() {",
        '    [ -n "${ROLE_STEPS// /}" ] || return 0',
        '    log "stopping the role steps still running (components 1 and 2)"',
        '    scancel --signal=TERM "$SLURM_JOB_ID+1" "$SLURM_JOB_ID+2" 2>/dev/null',
        "    local waited=0 pid",
        "    for pid in $ROLE_STEPS; do",
        '        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((ROLE_STOP_S * 5)) ]; do',
        "            sleep 0.2; waited=$((waited + 1))",
        "        done",
        '        kill -0 "$pid" 2>/dev/null && { log "role step $pid still running after ${ROLE_STOP_S} s: killing it"; '
        'kill -TERM "$pid"; }',
        '        wait "$pid"; log "role step $pid ended with code $? (143: stopped by that SIGTERM)"',
        "    done",
        '    ROLE_STEPS=""',
        "}",
        "trap stop_roles EXIT",
        "",
    ]


def _wait_block(job: JobSpec) -> list[str]:
    """Wait for the training step (a trapped signal interrupts ``wait``; the step goes on); with
    roles, also note each role step that ends first (:func:`_roles_block`)."""
    if job.roles is None:
        return [
            "while :; do",
            '    wait "$STEP_PID"',
            "    rc=$?",
            '    kill -0 "$STEP_PID" 2>/dev/null || break  # wait was interrupted by a trapped signal',
            "done",
        ]
    # Polling rather than ``wait -n -p`` (bash >= 5.1; RHEL 8's bash 4.4 lacks it): a finished step
    # is reaped by bash at once, so ``kill -0`` fails for it and ``wait PID`` returns its code; the
    # one-second ``wait`` on a sleep is what a trapped signal interrupts, never a step.
    return [
        "while :; do",
        '    if ! kill -0 "$STEP_PID" 2>/dev/null; then wait "$STEP_PID"; rc=$?; break; fi',
        "    for pid in $ROLE_STEPS; do",
        '        kill -0 "$pid" 2>/dev/null && continue',
        '        wait "$pid"; code=$?',
        '        ROLE_STEPS=$(echo " $ROLE_STEPS " | sed "s/ $pid / /")',
        '        role_ended "$pid" "$code"   # may start a server step again (ROLE_STEPS grows)',
        "    done",
        "    servers_back",
        "    sleep 1 & wait $!",
        "done",
        "stop_roles",
    ]


def sbatch_directives(job: JobSpec) -> list[str]:
    """sbatch options written as ``#SBATCH`` lines, unescaped (one option per item); for a job
    with :class:`~megatron_s2.launcher.job.RoleSpec` roles, ``hetjob`` separates the components."""
    cfg = job.launcher
    per_node = 1 if cfg.mode == "torchrun" else job.nproc_per_node
    options = [f"--job-name={job.name}", f"--nodes={job.nodes}", f"--ntasks-per-node={per_node}"]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    for name in ("partition", "account", "time"):
        if getattr(cfg, name):
            options.append(f"--{name}={getattr(cfg, name)}")
    options += [f"--signal=B:{cfg.signal}@{cfg.signal_lead_time}", "--requeue", "--open-mode=append",
                f"--output={job.dir.slurm_dir}/job-%j.out"]
    options += list(cfg.sbatch_args)
    if job.roles is not None:
        options += _role_directives(job)
    return options


def _step_options(job: JobSpec, per_node: int, log_name: str) -> list[str]:
    cfg = job.launcher
    words = ["--het-group=0"] if job.roles is not None else []
    words += [f"--nodes={job.nodes}", f"--ntasks-per-node={per_node}", "--kill-on-bad-exit=1",
             f'--output="$LOG_DIR"/{log_name}']
    if cfg.mpi:
        words.append(shlex.quote(f"--mpi={cfg.mpi}"))
    if cfg.container_image:
        words.append(shlex.quote(f"--container-image={cfg.container_image}"))
    if cfg.container_mounts:
        words.append(shlex.quote(f"--container-mounts={','.join(cfg.container_mounts)}"))
    words += [shlex.quote(arg) for arg in cfg.srun_args]
    return words


def srun_line(job: JobSpec) -> str:
    """The training step as written in the script (shell syntax, ``$LOG_DIR`` unexpanded)."""
    cfg = job.launcher
    command = " ".join(shlex.quote(word) for word in job.command)
    if cfg.mode == "srun":
        return " ".join(["srun", *_step_options(job, job.nproc_per_node, "rank%t.log"), command])
    # One torchrun agent per node. The agent must survive the warning signal that srun relays to
    # every process of the step (SIGUSR1's default action would kill it); the workers catch it.
    ignore = f"trap '' {cfg.signal}; " if cfg.signal != "TERM" else ""
    agent = [shlex.quote(rank_python(cfg)), "-m", "torch.distributed.run", f"--nnodes={job.nodes}",
             f"--nproc-per-node={job.nproc_per_node}", "--rdzv-backend=c10d",
             '--rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=0",
             "--no-python", command]
    return " ".join(["srun", *_step_options(job, 1, "node%n.log"), "bash", "-c",
                     shlex.quote(ignore + 'exec "$@"'), "torchrun-agent", *agent])


def _environment_block(job: JobSpec) -> list[str]:
    cfg = job.launcher
    lines = []
    if cfg.env:
        lines.append("# Defaults from the recipe (launcher.env); a value set in the submitting shell wins.")
        lines += [f'[ -n "${{{name}+set}}" ] || export {name}={shlex.quote(value)}' for name, value in cfg.env.items()]
    if cfg.env_override:
        lines.append("# Set on the command line (--env NAME=VALUE).")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in cfg.env_override.items()]
    if cfg.env_passthrough:
        lines.append(f"# Taken from the submitting shell (--env NAME): {' '.join(cfg.env_passthrough)}")
    lines.append('export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"')
    lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"')
    return lines


def _rendezvous_block(job: JobSpec) -> list[str]:
    if job.launcher.mode != "torchrun":
        return ["# Ranks find rank 0 themselves (megatron_s2.runtime.bootstrap: SLURM variables).", ""]
    return [
        "# torchrun rendezvous on the first node (its NodeAddr when the name does not resolve).",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'getent hosts "$HEAD_NODE" >/dev/null || '
        'HEAD_NODE=$(scontrol show node "$HEAD_NODE" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        f"RDZV_PORT=$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))", "",
    ]


def render_sbatch_script(job: JobSpec) -> str:
    """The complete batch script for ``job`` (submit with ``sbatch``; re-submittable as is)."""
    _check_run_dir(job)
    cfg = job.launcher
    q = shlex.quote
    head = ["#!/bin/bash"] + [f"#SBATCH {directive_word(option)}" for option in sbatch_directives(job)]
    body = f"""\
#
# Generated by `megatron-s2 launch`: {job.world_size} ranks ({job.nodes} nodes x {job.nproc_per_node}), {cfg.mode} mode.
# Resubmit as is with: sbatch {q(str(job.dir.script))}
# SIG{cfg.signal} arrives {cfg.signal_lead_time} s before the time limit and is forwarded to every rank, which
# saves a checkpoint and exits {EXIT_PREEMPTED}; the job then requeues itself (at most {cfg.max_restarts} times)
# and resumes from the newest checkpoint. $RUN_DIR/{FINISHED_MARKER} stops any further requeue.
set -uo pipefail

RUN_DIR={q(str(job.run_dir))}
TRAIN_STEPS={job.train_steps or ""}
MAX_RESTARTS={cfg.max_restarts}
EXIT_PREEMPTED={EXIT_PREEMPTED}
RESTART=${{SLURM_RESTART_COUNT:-0}}
LOG_DIR="$RUN_DIR/logs/restart$RESTART"
mkdir -p "$LOG_DIR" || exit 1
log() {{ echo "[launch $(date +%H:%M:%S)] $*"; }}
log "job $SLURM_JOB_ID restart $RESTART on $SLURM_JOB_NODELIST; rank logs in $LOG_DIR"

# The run is complete when FINISHED records a step >= TRAIN_STEPS (a raised target extends it).
finished() {{
    [ -e "$RUN_DIR/{FINISHED_MARKER}" ] || return 1
    [ -n "$TRAIN_STEPS" ] || return 0
    done_step=$(grep -o '"step": *[0-9]*' "$RUN_DIR/{FINISHED_MARKER}" | grep -o '[0-9]*$' | head -n 1)
    [ -z "$done_step" ] || [ "$done_step" -ge "$TRAIN_STEPS" ]
}}
requeue() {{  # $1: why; returns 1 at the restart limit
    if [ "$RESTART" -ge "$MAX_RESTARTS" ]; then
        log "$1, but the restart limit ($MAX_RESTARTS) is reached: not requeueing"
        return 1
    fi
    log "$1: requeueing: restart $((RESTART + 1)) of at most $MAX_RESTARTS"
    scontrol requeue "$SLURM_JOB_ID" && exit "$EXIT_PREEMPTED"
    log "scontrol requeue failed"
    exit 1
}}

if finished; then
    log "$RUN_DIR/{FINISHED_MARKER} exists: the run is complete, not starting it again (raise training.train_steps to extend it)"
    exit 0
fi
rm -f "$RUN_DIR/{PREEMPTED_MARKER}"  # rank 0 writes it when this attempt saves on preemption

{chr(10).join(_environment_block(job))}

{chr(10).join(_rendezvous_block(job))}
STEP_PID=
PREEMPTED=
forward() {{
    PREEMPTED=$1
    log "received SIG$1: forwarding it to the training step"
    [ -z "$STEP_PID" ] || kill -s "$1" "$STEP_PID" 2>/dev/null || true
}}
trap 'forward {cfg.signal}' {cfg.signal}
{"" if cfg.signal == "TERM" else "trap 'forward TERM' TERM"}
{chr(10).join(_roles_block(job))}
{srun_line(job)} &
STEP_PID=$!
[ -z "$PREEMPTED" ] || kill -s "$PREEMPTED" "$STEP_PID" 2>/dev/null
{chr(10).join(_wait_block(job))}
log "training step exited with code $rc"

if finished; then
    log "run complete"
    exit 0
fi
# A saved preemption requeues whatever srun reports: with --kill-on-bad-exit (or torchrun) the
# ranks' exit 75 may reach us as a signal or 1; rank 0's PREEMPTED marker is the authority.
if [ -e "$RUN_DIR/{PREEMPTED_MARKER}" ]; then
    requeue "preempted: rank 0 saved and wrote $RUN_DIR/{PREEMPTED_MARKER} $(cat "$RUN_DIR/{PREEMPTED_MARKER}")" || exit "$EXIT_PREEMPTED"
fi
if [ -n "$PREEMPTED" ] || [ "$rc" = "$EXIT_PREEMPTED" ]; then
    requeue "preempted (SIG${{PREEMPTED:-?}}, step exit $rc)" || exit "$EXIT_PREEMPTED"
fi
if [ "$rc" = 0 ]; then
    # Seen when a requeued step failed to start inside SLURM: nothing was trained.
    requeue "the training step exited 0 without FINISHED or PREEMPTED in $RUN_DIR" || exit 1
fi
exit "$rc"
"""
    return "\n".join(head) + "\n" + body
