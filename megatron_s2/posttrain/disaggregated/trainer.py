"""The trainer of disaggregated RL: consumes batch files, publishes weights (issue 25, seed 004).

:class:`DisaggregatedTrainer` is the co-located :class:`~megatron_s2.posttrain.trainer.PosttrainTrainer`
without a rollout engine: the same layouts (any tp / pp / dp / ep / cp the co-located RL trains),
the same advantage x loss step (:meth:`PosttrainTrainer._train_on`), checkpoints and metrics. One
step ``s`` (policy version ``s`` -> ``s + 1``):

1. wait for batch ``s`` (:class:`.exchange.BatchQueue`; every rank reads the same file);
2. check the off-policyness bound: every policy token of the batch is at most ``k`` versions
   old (``max_async_level``). With ``staleness_action: discard`` the orchestrator already dropped
   older samples (``async_dropped_samples``) and one reaching the trainer is an error; with
   ``mask`` the loss masks them (the ``staleness`` token mask, counted ``async_masked_tokens``);
3. the optimiser step, then publish version ``s + 1``: a model-only checkpoint in
   ``<run>/disaggregated/weights/step_<s+1>`` (collective, any layout; the servers read it whole);
   with ``weight_sync: broadcast`` the ranks have assembled the global tensors and the first rank
   has sent them to the servers over a process group just before (:mod:`.weight_sync`), so the
   checkpoint is their fallback;
4. ``rollouts.jsonl``: the prompts and sample ids trained at this step — the audit trail that a
   trainer killed -9 and resumed from its checkpoint trains every batch once: it re-reads the
   same batch files from its checkpoint's step (truncated records of the dead attempt removed);
5. held-out evaluation when due (``rl.eval``: before the first step, every ``interval`` steps,
   after the last — as co-located), of version ``s + 1`` through the inference servers
   (:mod:`.served_eval`): the same ``eval_*`` metrics in ``eval.jsonl`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time

from megatron_s2.checkpoint import CheckpointManager
from megatron_s2.config.schema import ConfigError
from megatron_s2.config.posttrain.recipe_checks import posttrain_section
from megatron_s2.posttrain.advantages import AdvantagePipeline
from megatron_s2.posttrain.disaggregated.exchange import BatchQueue, read_servers, weights_path, weights_root
from megatron_s2.posttrain.losses import PosttrainObjective
from megatron_s2.posttrain.orchestrator import PromptGroup
from megatron_s2.posttrain.trainer import PosttrainTrainer
from megatron_s2.training.trainer import Trainer

__all__ = ["DisaggregatedTrainer"]


class _QueueCursor:
    """The checkpoint's ``data`` entry: the next batch is the step itself (the files are the queue)."""

    def __init__(self, trainer: "DisaggregatedTrainer"):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"kind": "posttrain-disaggregated", "next_batch": self.trainer.step}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "posttrain-disaggregated":
            raise ConfigError("checkpoint: it was not saved by a disaggregated RL trainer (rl.mode: disaggregated); "
                              "start this phase with checkpoint.load=<that run> instead of resuming")


class DisaggregatedTrainer(PosttrainTrainer):
    def __init__(self, recipe, run_dir, *, rank: int = 0, world_size: int = 1, guard=None, log=print, device=None):
        Trainer.__init__(self, recipe, run_dir, rank=rank, world_size=world_size, guard=guard, log=log,
                         device=device)
        self.kind = "rl"
        self.section = section = posttrain_section(recipe)
        self.rollout_cfg = rollout = section.rollout
        self.async_level = section.disaggregated.max_async_level
        self.rollout_groups = self.groups  # frozen models (none supported yet) would live on the training layout
        self.objective = PosttrainObjective(section.loss, rollout.max_staleness)
        self.advantages = AdvantagePipeline(section.advantage, section.effort)
        self.teachers = self.reference = self.warmup = self.backend = None
        self.data = _QueueCursor(self)
        self.queue = BatchQueue(self.run_dir)
        # versions the servers may still be loading stay on disk: the orchestrator is at most k ahead
        self.published = CheckpointManager(weights_root(self.run_dir), rank, world_size,
                                           keep_last=self.async_level + 3, layout=self.layout.describe(),
                                           log=lambda *a: None)
        self.eval_file = self.run_dir / "eval.jsonl"
        self.rollout_file = self.run_dir / "rollouts.jsonl"
        self.started = False
        self.weight_sync = None  # rl.disaggregated.weight_sync: broadcast (weight_sync.py; every rank takes part)
        if section.disaggregated.weight_sync == "broadcast":
            from megatron_s2.posttrain.disaggregated.weight_sync import BroadcastWeightSync

            self.weight_sync = BroadcastWeightSync(self.model, self.run_dir, section.disaggregated, rank=rank,
                                                   world_size=world_size, log=self.log)
        self._evaluator = None  # built when first needed: the servers' URLs come from the orchestrator
        self.rollout_model = self.model  # _evaluate puts it in eval mode; the servers hold the weights it plays

    def train(self):
        try:
            return Trainer.train(self)
        finally:
            if self.weight_sync is not None:
                self.weight_sync.close()
            if self._evaluator is not None:
                self._evaluator.engine.close()
                self._evaluator.engine.backend.close()

    @property
    def evaluator(self):
        """Held-out evaluation through the inference servers (:mod:`.served_eval`)."""
        if self._evaluator is None:
            from megatron_s2.config.posttrain.engines import engine_max_model_len
            from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
            from megatron_s2.posttrain.disaggregated.served_eval import ServedEvalEngine, ServedEvaluator
            from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
            from megatron_s2.posttrain.train_batch import g_device

            cfg, max_len = self.section.disaggregated, engine_max_model_len(self.recipe, self.rollout_cfg)
            servers = read_servers(self.run_dir, cfg.server_wait_s)
            # the first rank plays every held-out episode (the servers do the work): the episodes' seeds,
            # hence the figures, do not depend on the trainer's layout
            topology = ReplicaTopology(0, 1, self.is_main, self.world_size, g_device(self.groups))
            concurrent = max(1, cfg.max_num_seqs * len(servers))
            verifiers = None
            if self.rollout_cfg.uses_verifiers and self.is_main:  # held-out tasks as verifiers episodes
                from megatron_s2.posttrain.disaggregated.served_verifiers import ServedVerifiers

                verifiers = ServedVerifiers(self.environments, self.tokenizer)
            agentic = None
            if self.rollout_cfg.uses_agentic and self.is_main:  # held-out instances as harness episodes
                from megatron_s2.posttrain.disaggregated.served_agentic import ServedAgentic

                agentic = ServedAgentic(self.environments, self.tokenizer, vocab_size=self.recipe.model.vocab_size)
            backend = ServedRolloutBackend(servers, {}, weights_path=lambda v: str(weights_path(self.run_dir, v)),
                                           record_routing=False, max_model_len=max_len, max_concurrent=concurrent,
                                           request_timeout_s=cfg.request_timeout_s, server_wait_s=cfg.server_wait_s,
                                           ordered=True, log=self.log, verifiers=verifiers,
                                           agentic=agentic)
            self._evaluator = ServedEvaluator(ServedEvalEngine(backend, concurrent), self.environments, topology,
                                              self.section.eval, self.rollout_cfg.max_new_tokens, max_len,
                                              rank=self.rank)
        return self._evaluator

    def _publish(self) -> float:
        """Policy version ``self.step`` as a model-only checkpoint (collective); seconds taken."""
        t0 = time.perf_counter()
        if self.published.store.step_dir(self.step).is_dir():  # a resumed run re-derives the same weights
            return 0.0
        meta = {"layout": self.layout.describe(), "config": self.recipe.to_mapping(), "model": self.recipe.model.name}
        self.published.save(self.step, {"model": self.model, "optimizer": None, "rng": None, "local": None,
                                        "data": None}, meta)
        return time.perf_counter() - t0

    def train_step(self) -> dict:
        if not self.started:
            if self.step:  # resumed: the servers may be behind this checkpoint's version
                self._publish()
            self.started = True
            if self.step == 0 and self.section.eval.at_start:  # version 0: the servers' initial weights
                self._evaluate()
        t0 = time.perf_counter()
        cfg = self.section.disaggregated
        batch = self.queue.wait(self.step, cfg.batch_wait_s,
                                interrupted=lambda: self.guard is not None and self.guard.received is not None)
        if batch is None:  # preempted while waiting (every rank is): nothing trained since the last step
            from megatron_s2.runtime.preemption import EXIT_PREEMPTED

            self.log(f"preemption requested while waiting for batch {self.step}: saving step {self.step} and exiting")
            self.save()
            raise SystemExit(EXIT_PREEMPTED)
        t_wait = time.perf_counter() - t0
        groups = [PromptGroup.from_state_dict(g) for g in batch["groups"]]
        samples = [s for g in groups for s in g.accepted]
        extra = {k: float(v) for k, v in batch["metrics"].items()}
        extra.update(self._check_bound(samples))
        t1 = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, self.step)
        result, loss_stats, tokens = self._train_on(samples, groups)
        grad_norm = self.apply_gradients(result.loss)
        t_train = time.perf_counter() - t1
        if self.weight_sync is not None:  # the servers get version self.step before its checkpoint appears
            extra.update(self.weight_sync.push(self.step))
        extra["async_publish_s"] = self._publish()  # version self.step (just incremented)
        extra.update(result.metrics)
        extra.update(loss_stats)
        extra.update({"async_batch_wait_s": t_wait, "train_time_s": t_train,
                      "train_tokens_per_s": tokens / max(t_train, 1e-9)})
        self._record(groups)
        if self._eval_due():  # version self.step, just published: no server can be past it
            extra.update(self._evaluate())
        return {"loss": result.loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "step_time": time.perf_counter() - t0, "extra": extra,
                "fingerprint": ",".join(g.prompt_uid for g in groups)}

    def _check_bound(self, samples) -> dict[str, float]:
        """The off-policyness bound at this step (module docstring, 2)."""
        k, masked = self.async_level, 0
        for s in samples:
            old = sum(1 for v in s.policy_versions if self.step - v > k)  # every row of the episode
            if old and self.rollout_cfg.staleness_action == "discard":
                raise RuntimeError(f"disaggregated RL: batch {self.step} holds sample {s.sample_id} with tokens "
                                   f"{s.staleness(self.step)} versions old (max_async_level {k}); the orchestrator "
                                   "should have dropped it — is it running another recipe?")
            masked += old
        return {"async_masked_tokens": float(masked)}

    def _record(self, groups) -> None:
        """rollouts.jsonl (module docstring, 4)."""
        if not self.is_main:
            return
        record = {"step": self.step, "version": self.step, "trained": [g.prompt_uid for g in groups],
                  "sample_ids": sorted(s.sample_id for g in groups for s in g.accepted)}
        with open(self.rollout_file, "a") as f:
            f.write(json.dumps(record) + "\n")
