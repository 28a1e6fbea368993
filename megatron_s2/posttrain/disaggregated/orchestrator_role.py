"""The orchestrator process of disaggregated RL: environments against the servers, batches to the trainer.

``megatron-s2 orchestrate <recipe> --servers URL,URL ...`` runs :func:`run_orchestrator`. It uses
the co-located run's :class:`~megatron_s2.posttrain.orchestrator.Orchestrator` unchanged in its
decisions (sample-level dispatch under ``max_in_flight``, per-dataset limits, counter-based seeds,
dynamic sampling, the staleness rule) over a :class:`.served_backend.ServedRolloutBackend`; what
differs is who waits for whom. For step ``s`` (the batch trained at policy version ``s``):

1. wait until the trainer has published version ``>= s - k`` (``k = max_async_level``): the
   orchestrator runs at most k steps ahead of the trainer (seed 004's "async level");
2. the servers load the newest published version (``POST /update_weights``) whenever one
   appears — before and while rollouts run;
3. pump until ``batch_groups`` groups are complete; a sample whose oldest token is older than
   ``s - k`` is dropped and resampled (``staleness_action: discard``; counted) or kept for the
   trainer to mask (``mask``);
4. write batch ``s`` (:class:`.exchange.BatchQueue`) with the rollout metrics and this
   orchestrator's state, so a restarted orchestrator continues after its last batch.

Nothing is dispatched for step ``s + 1`` before the gate of step ``s + 1`` opens (a sample started
earlier would be too old for it); with ``k >= 1`` the gate is usually open already, since batch
``s + 1`` is generated while the trainer trains on batch ``s``. With ``k = 0`` samples are also
released in submission order: the run is synchronous on-policy RL, deterministic
whichever server answers first.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_s2.config.posttrain.recipe_checks import environment_key, posttrain_section
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.posttrain.disaggregated.exchange import (ORCHESTRATOR_FAILED, WAIT_POLL_S, BatchQueue, exchange_dir,
                                                        published_versions, weights_path, write_servers)
from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
from megatron_s2.posttrain.envs import build_environment
from megatron_s2.posttrain.metrics import rollout_metrics
from megatron_s2.posttrain.orchestrator import Orchestrator, RolloutSample

__all__ = ["ServedOrchestrator", "run_orchestrator"]


class ServedOrchestrator(Orchestrator):
    """The orchestrator with the staleness rule measured against the version the next batch will
    be trained at (``target``), which may be ahead of the version the servers run."""

    target = 0
    async_level = 0

    def _may_open_group(self) -> bool:
        """A group dispatched now runs under the served version v, so its samples fit batches
        ``target .. v + k`` only: open no more groups than those batches take (the rest would be
        dropped as too old). Replacements of dropped or warm-up samples are always sent."""
        batches = self.version + self.async_level - self.target + 1
        return len(self.groups) < self.config.batch_groups * max(batches, 0)

    def _stale(self, sample: RolloutSample) -> bool:
        bound = self.config.max_staleness
        return (self.config.staleness_action == "discard" and bound >= 0
                and sample.staleness(max(self.version, self.target)) > bound)

    def serve_version(self, version: int) -> None:
        """The servers load ``version``; in-flight samples go on, the staleness rule is applied."""
        running = not self.paused
        self.backend.pause()
        self.paused = True
        self.finish_update(version)
        if running:
            self.resume()


def _latest(run_dir: Path) -> int:
    versions = published_versions(run_dir)
    return versions[-1] if versions else 0


def run_orchestrator(recipe, servers: list[str], *, log=print) -> int:
    """Produce batch files for every step of the phase (module docstring); returns 0."""
    from megatron_s2.config.posttrain.engines import engine_max_model_len
    from megatron_s2.training.run_checks import check_tokenizer

    section = posttrain_section(recipe)
    rollout, cfg, t = section.rollout, section.disaggregated, recipe.training
    run_dir = Path(t.run_dir)
    k = cfg.max_async_level
    tokenizer = check_tokenizer(recipe)
    envs = {n: build_environment(n, rollout.environment_of(n), tokenizer, what=environment_key("rl", rollout, n))
            for n in rollout.dataset_names()}
    write_servers(run_dir, servers)  # the trainer evaluates through the same servers (served_eval.py)
    queue = BatchQueue(run_dir)
    done = queue.steps()
    state = queue.get(done[-1])["orchestrator"] if done else None
    version = _latest(run_dir) if state is not None else 0
    verifiers = None
    if rollout.uses_verifiers:  # their episodes run here against the servers (served_verifiers.py)
        from megatron_s2.posttrain.disaggregated.served_verifiers import ServedVerifiers

        verifiers = ServedVerifiers({n: e for n, e in envs.items() if rollout.environment_of(n).kind == "verifiers"},
                                    tokenizer)
    agentic = None
    if rollout.uses_agentic:  # harness episodes here, through a gateway over the servers (served_agentic.py)
        from megatron_s2.posttrain.disaggregated.served_agentic import ServedAgentic

        agentic = ServedAgentic({n: e for n, e in envs.items() if rollout.environment_of(n).kind == "agentic"},
                                tokenizer, vocab_size=recipe.model.vocab_size)
    backend = ServedRolloutBackend(servers, envs, weights_path=lambda v: str(weights_path(run_dir, v)),
                                   record_routing=rollout.engine.routing_replay,
                                   max_model_len=engine_max_model_len(recipe, rollout),
                                   max_concurrent=rollout.max_in_flight, request_timeout_s=cfg.request_timeout_s,
                                   server_wait_s=cfg.server_wait_s, ordered=k == 0, log=log, verifiers=verifiers,
                                   agentic=agentic)
    advantages = AdvantagePipeline(section.advantage, section.effort)
    group_filter = None
    if section.advantage.dynamic_sampling:
        group_filter = lambda ss: advantages.informative(GroupRollouts.from_samples(ss))  # noqa: E731
    effort = section.effort
    orch = ServedOrchestrator(rollout, envs, backend, seed=t.seed, effort_levels=effort.levels,
                              samples_per_level=effort.samples_per_level, group_filter=group_filter)
    orch.async_level = k
    start = 0
    if state is not None:  # after the last batch this orchestrator wrote; in-flight attempts start again
        backend.update_weights(version)
        state = {**state, "policy_version": version}
        orch.load_state_dict(state)
        start = done[-1] + 1
        log(f"orchestrator: continuing after batch {done[-1]} at policy version {version} ({orch.in_flight} samples "
            "restarted)")
    else:
        orch.paused = True  # nothing is dispatched before the first gate below
    log(f"orchestrator: {len(servers)} inference server(s), max_async_level {k}, steps {start}..{t.train_steps - 1}")
    try:
        for step in range(start, t.train_steps):
            queue.put(step, _produce(orch, step, k, run_dir, log))
    except Exception as exc:  # the trainer waits for batches: tell it why none will come
        exchange_dir(run_dir).mkdir(parents=True, exist_ok=True)
        (exchange_dir(run_dir) / ORCHESTRATOR_FAILED).write_text(f"the orchestrator failed: {type(exc).__name__}: "
                                                                f"{exc}\n")
        raise
    finally:
        backend.close()
    log(f"orchestrator: wrote batches {start}..{t.train_steps - 1}; ledger {orch.ledger}")
    return 0


def _produce(orch: ServedOrchestrator, step: int, k: int, run_dir: Path, log) -> dict:
    """Batch ``step``: wait for the off-policyness gate, then pump until it is complete."""
    t0 = time.perf_counter()
    dropped_before = orch.ledger["discarded_stale"]
    orch.target = step
    # Nothing is dispatched for this step before the trainer is at most k versions behind: a
    # sample started earlier would be too old for it. Calls in flight complete meanwhile.
    while _latest(run_dir) < step - k:
        if not orch.pump():
            time.sleep(WAIT_POLL_S)
    t_gate = time.perf_counter() - t0
    orch.serve_version(max(orch.version, _latest(run_dir)))
    if orch.paused:
        orch.resume()
    filtered = orch.ledger["filtered"]
    while not orch.batch_ready():
        if orch.ledger["filtered"] - filtered > 50 * orch.config.batch_groups:  # as the co-located trainer
            raise RuntimeError(f"rollout: {orch.ledger['filtered'] - filtered} groups in a row were uninformative "
                               "(every response got the same reward) and dynamic sampling dropped them; the policy "
                               "cannot solve (or always solves) these prompts — start from an SFT checkpoint "
                               "(checkpoint.load) or change the task difficulty")
        orch.pump()
        newest = _latest(run_dir)
        if newest > orch.version:  # a fresher policy is out: the servers take it at once
            orch.serve_version(newest)
    groups = orch.begin_training()
    stats = orch.backend.take_stats()
    metrics = rollout_metrics(groups, orch.take_outcomes(), current_version=step,
                              max_staleness=orch.config.max_staleness)
    lags = [s.staleness(step) for g in groups for s in g.accepted]
    metrics.update({
        "async_gate_wait_s": t_gate, "async_rollout_s": time.perf_counter() - t0 - t_gate,
        "async_served_version": float(orch.version), "async_lag_mean": sum(lags) / max(len(lags), 1),
        "async_lag_max": float(max(lags, default=0)),
        "async_dropped_samples": float(orch.ledger["discarded_stale"] - dropped_before),
        "rollout_tokens": float(stats.generated_tokens), "rollout_calls": float(stats.calls),
        "rollout_rerouted": float(stats.rerouted), "rollout_replayed": float(stats.replayed),
        **{f"ledger_{name}": float(v) for name, v in orch.ledger.items()},
    })
    log(f"orchestrator: batch {step} ({len(groups)} groups, served version {orch.version}, lag mean "
        f"{metrics['async_lag_mean']:.2f}, {metrics['async_dropped_samples']:.0f} dropped)")
    state = orch.state_dict()  # paused: in-flight attempts start again after a restart (no partial state)
    return {"step": step, "groups": [g.state_dict() for g in groups], "metrics": metrics, "orchestrator": state}
