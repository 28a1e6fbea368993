"""Placing the roles of disaggregated RL (``rl.mode: disaggregated``; issue 25, seed 004).

Beside the trainer ranks a disaggregated RL phase needs ``rl.disaggregated.num_servers`` inference
servers (``megatron-s2 serve`` on the phase's initial weights, ``checkpoint.load``) and one
orchestrator (``megatron-s2 orchestrate`` on the same resolved recipe, :mod:`megatron_s2.cli.orchestrate`).

* Locally (:class:`ServedRoles`, used by ``launch --local``): the servers start first, each on its
  own port, and are waited for (``/health``); then the orchestrator; then the trainer ranks as
  for any phase. A server that dies is restarted (the orchestrator re-routes its calls meanwhile
  and loads the current weights into it once it is back); an orchestrator that fails leaves a
  marker (``ORCHESTRATOR_FAILED``), which the trainer, waiting for a batch, reports and stops on. Logs:
  ``<run>/logs/restart<N>/server<i>.log`` and ``orchestrator.log``.
* On SLURM (:func:`slurm_roles`, rendered by :mod:`megatron_s2.launcher.sbatch_script`): one
  heterogeneous job — component 0 the trainer's nodes, component 1 the servers (one node each,
  server ``i`` on port ``8100 + i``), component 2 the orchestrator — whose script starts the servers
  and the orchestrator as background steps (one step per server) and the trainer as the watched
  one. A server step that ends before the trainer is started again on its node, as locally (up to
  :data:`MAX_FAILED_RESTARTS` in a row that never answer ``/health``); a server given up, or an
  orchestrator that fails, writes the ``ORCHESTRATOR_FAILED`` marker, so the trainer stops with its
  reason and the job fails; the roles still running when the trainer ends get SIGTERM
  (``scancel --signal``) and exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.local import free_port
from megatron_s2.posttrain.disaggregated.exchange import ORCHESTRATOR_FAILED, SERVERS, exchange_dir

__all__ = ["ServerStartError", "is_disaggregated", "initial_weights", "server_command", "orchestrator_command", "slurm_roles",
           "ServedRoles"]


class ServerStartError(RuntimeError):
    """An inference server did not come up (one line: which, how it ended, its last log line)."""

    exit_code = 1


def is_disaggregated(recipe) -> bool:
    return recipe.phase.kind == "rl" and recipe.rl is not None and recipe.rl.mode == "disaggregated"


def initial_weights(recipe) -> str:
    """The servers' weights at start-up: the phase's ``checkpoint.load`` (the trainer's too)."""
    if not recipe.checkpoint.load:
        raise ConfigError("checkpoint.load: rl.mode: disaggregated starts its inference servers from the phase's initial "
                          "weights; set checkpoint.load to the SFT run's checkpoints")
    return recipe.checkpoint.load


def server_command(python: str, recipe, port: str | int | None, host: str = "127.0.0.1") -> tuple[str, ...]:
    """argv of one inference server (``port`` None: no ``--port``, the SLURM script adds each
    server's own; the orchestrator asks each call's log-probs under the
    distribution it sampled from: ``processed_logprobs``). ``rl.rollout.engine.speculative``
    becomes ``--speculative``: the servers decode with the checkpoint's DSpark drafter (a
    checkpoint without one stops the server at start-up with one line naming the flag).
    ``routing_replay`` with verifiers environments adds ``--enable-return-routed-experts`` (their
    client asks for none; R3 needs them in the trace)."""
    from megatron_s2.config.posttrain.engines import engine_max_model_len

    rl = recipe.rl
    speculative = ("--speculative",) if rl.rollout.engine.speculative else ()
    # R3 for verifiers episodes: their client asks for no routed experts, so the servers return them always
    routing = ("--enable-return-routed-experts",) if rl.rollout.engine.routing_replay and rl.rollout.uses_verifiers else ()
    where = ("--host", host) if port is None else ("--host", host, "--port", str(port))
    return (python, "-m", "megatron_s2.cli", "serve", initial_weights(recipe), *where,
            "--served-model-name", "policy", "--logprobs-mode", "processed_logprobs",
            "--max-num-seqs", str(rl.disaggregated.max_num_seqs),
            "--max-waiting", str(max(256, rl.rollout.max_in_flight)),
            "--max-model-len", str(engine_max_model_len(recipe, rl.rollout)), "--seed", str(recipe.training.seed),
            *speculative, *routing, "--log-level", "warning")


def orchestrator_command(python: str, config: Path, run_dir: Path, servers: list[str] | None) -> tuple[str, ...]:
    """argv of the orchestrator; ``servers`` None: ``--servers`` is appended where they are known."""
    argv = (python, "-m", "megatron_s2.cli", "orchestrate", str(config), "--run-dir", str(run_dir))
    return argv if servers is None else (*argv, "--servers", ",".join(servers))


SLURM_SERVER_PORT = 8100
"""Server ``i``'s port on its node is this + ``i`` when ``rl.disaggregated.server_port`` is 0
(distinct ports: nodes that share one host, as the test cluster's emulated ones, do not collide)."""

MAX_FAILED_RESTARTS = 3
"""A server restarted this many times in a row without ever serving is given up (the run fails with its log)."""


def slurm_roles(recipe, run_dir: Path, config: Path, python: str, gpus_per_node: int):
    """The :class:`~megatron_s2.launcher.job.RoleSpec` of a heterogeneous SLURM job."""
    from megatron_s2.launcher.job import RoleSpec

    cfg = recipe.rl.disaggregated
    port = cfg.server_port or SLURM_SERVER_PORT
    return RoleSpec(servers=cfg.num_servers, server_command=server_command(python, recipe, None, host="0.0.0.0"),
                    orchestrator_command=orchestrator_command(python, config, run_dir, None), port=port,
                    server_gpus=1 if gpus_per_node else 0, exchange=exchange_dir(run_dir))


def _role_preexec() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):  # the role dies with its launcher, as the ranks do
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:  # noqa: S310 - our own server
            return r.status == 200
    except OSError:
        return False


class ServedRoles:
    """The servers and the orchestrator of one local run (module docstring)."""

    def __init__(self, recipe, run_dir: Path, config: Path, log_dir: Path, *, python: str = sys.executable,
                 env: dict[str, str] | None = None, say=print):
        self.recipe, self.run_dir, self.config, self.log_dir = recipe, Path(run_dir), Path(config), Path(log_dir)
        self.python, self.say = python, say
        # CPU servers unless the machine has GPUs for them (the trainer keeps its own)
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        cfg = recipe.rl.disaggregated
        self.ports = [cfg.server_port + i if cfg.server_port else free_port() for i in range(cfg.num_servers)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers: list[subprocess.Popen | None] = [None] * cfg.num_servers
        self.orchestrator: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="megatron-s2-roles", daemon=True)

    # ---- processes --------------------------------------------------------------------------------
    def _spawn(self, argv, log_name: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / log_name, "ab") as sink:
            return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_role_preexec)

    def _start_server(self, i: int) -> None:
        self.servers[i] = self._spawn(server_command(self.python, self.recipe, self.ports[i]), f"server{i}.log")

    def start(self, timeout_s: float = 300.0) -> "ServedRoles":
        marker = exchange_dir(self.run_dir) / ORCHESTRATOR_FAILED
        marker.unlink(missing_ok=True)
        # a previous launch's URLs (other ports): the trainer waits for this launch's orchestrator to write them
        (exchange_dir(self.run_dir) / SERVERS).unlink(missing_ok=True)
        for i in range(len(self.servers)):
            self._start_server(i)
        deadline = time.monotonic() + timeout_s
        while not all(_healthy(u) for u in self.urls):
            dead = [i for i, p in enumerate(self.servers) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise self._start_failure(dead[0] if dead else None, timeout_s)
            time.sleep(0.2)
        self.say(f"disaggregated RL: {len(self.urls)} inference server(s) up at {', '.join(self.urls)}")
        self.orchestrator = self._spawn(orchestrator_command(self.python, self.config, self.run_dir, self.urls),
                                        "orchestrator.log")
        self._watcher.start()
        return self

    def _start_failure(self, dead: int | None, timeout_s: float) -> Exception:
        """One line for a server that did not come up: its own last words (review57: a traceback
        that pointed at its log before). A configuration error of the server (exit 2) is one of the
        launch's own (exit 2)."""
        if dead is None:
            return ServerStartError(f"disaggregated RL: the inference servers were not up after {timeout_s:.0f} s "
                                    f"(logs: {self.log_dir}/server<i>.log)")
        log = self.log_dir / f"server{dead}.log"
        try:
            lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        code = self.servers[dead].returncode
        said = f": {lines[-1]}" if lines else ""
        message = f"disaggregated RL: inference server {dead} exited with code {code} at start-up{said} (log: {log})"
        return ConfigError(message) if code == ConfigError.exit_code else ServerStartError(message)

    def _watch(self) -> None:
        """Restart dead servers — up to :data:`MAX_FAILED_RESTARTS` times in a row without one of
        them coming up healthy, then give that server up and mark the run failed for the trainer
        (a checkpoint deleted mid-run would otherwise be restarted forever); mark a failed
        orchestrator for the trainer."""
        failed = [0] * len(self.servers)
        while not self._stop.wait(0.25):
            for i, p in enumerate(self.servers):
                if p is None or self._stop.is_set():
                    continue
                if p.poll() is None:
                    if failed[i] and _healthy(self.urls[i]):
                        failed[i] = 0   # the restart took
                    continue
                if failed[i] >= MAX_FAILED_RESTARTS:
                    log = self.log_dir / f"server{i}.log"
                    self.say(f"disaggregated RL: inference server {i} exited ({p.returncode}) after {failed[i]} "
                             f"restarts that never served; giving it up (log: {log})")
                    self._mark_failed(f"inference server {i} exited (code {p.returncode}) after {failed[i]} "
                                      f"restarts that never served; its log: {log}")
                    self.servers[i] = None
                    continue
                self.say(f"disaggregated RL: inference server {i} exited ({p.returncode}); restarting it")
                self.restarts += 1
                failed[i] += 1
                self._start_server(i)
            o = self.orchestrator
            if o is not None and o.poll() is not None:
                if o.returncode != 0:
                    self._mark_failed(f"the orchestrator exited with code {o.returncode}; its log: "
                                      f"{self.log_dir / 'orchestrator.log'}")
                self.orchestrator = None

    def _mark_failed(self, reason: str) -> None:
        """Tell the trainer, waiting for a batch, why the run cannot go on (a reason already there,
        e.g. the orchestrator's own, is kept: it is the better one)."""
        marker = exchange_dir(self.run_dir) / ORCHESTRATOR_FAILED
        marker.parent.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            marker.write_text(reason + "\n")

    def kill_server(self, i: int, sig: int) -> None:
        """Signal server ``i`` (tests: a server dying mid-run)."""
        self.servers[i].send_signal(sig)

    def stop(self) -> None:
        self._stop.set()
        procs = [p for p in [*self.servers, self.orchestrator] if p is not None and p.poll() is None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "ServedRoles":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
