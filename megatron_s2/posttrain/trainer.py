"""RL and on-policy distillation phases (``phase.kind: rl | opd``) on the trainer's layouts, with
rollouts co-located on the same ranks and time-shared (report §5.2.1).

:class:`PosttrainTrainer` is the :class:`~megatron_s2.training.trainer.Trainer` — same layout,
process groups, model (or pipeline stages), optimiser, LR schedule, checkpoint manager,
preemption guard, markers and metrics — with a different step. One step (= one policy version):

1. **rollout** — the engine on these ranks runs until the orchestrator holds ``batch_groups``
   complete groups (sample-level dispatch under the in-flight bound, §5.2.1-5.2.2);
2. **preempt** — the orchestrator pauses every in-flight sample at a token boundary (KV and
   routing kept: partial rollout);
3. **train** — advantages (RL: the ``rl.advantage`` composition; OPD: Eq. 33 per token or the
   full-vocabulary KL of §5.2.4 against in-process teachers), micro-batches with the rows'
   concatenated routing records replayed in the training forward (R3), optionally the engine's
   decoder bounded replay simulated (§3.2.2), forward/backward through the layout's schedule,
   then the optimiser step (version v -> v + 1);
4. **update** — the new weights reach the engine (in place when it runs the training model;
   an in-memory transfer into a rollout model otherwise, :mod:`.rollout.weights`), the
   staleness rule drops or keeps the samples in flight; a checkpoint, when due, stores the
   orchestrator's state in the checkpoint's ``data`` entry while the engine is paused, so its
   in-flight samples are exact;
5. the next step resumes every in-flight sample where it stopped.

Evaluation on held-out prompts (greedy by default) runs before the first step, every
``eval.interval`` steps and after the last, with a second engine over the same weights — or, for
verifiers and agentic environments, as episodes of their held-out tasks through the run's own
server and engine, between steps (:class:`~megatron_s2.posttrain.rollout.evaluation.VerifiersEvaluator`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megatron_s2.config.schema import ConfigError
from megatron_s2.inference import InferenceEngine
from megatron_s2.parallel.context_parallel import split_micro_batch
from megatron_s2.parallel.setup import build_groups
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.config.posttrain.recipe_checks import environment_key, posttrain_section
from megatron_s2.models.family import family_of
from megatron_s2.posttrain.checks import check_posttrain_inputs
from megatron_s2.posttrain.envs import build_environment
from megatron_s2.posttrain.frozen import TeacherPool, full_logits, load_frozen_model
from megatron_s2.posttrain.losses import PosttrainObjective
from megatron_s2.posttrain.metrics import rollout_metrics
from megatron_s2.posttrain.opd.warmup import SftWarmup
from megatron_s2.posttrain.orchestrator import Orchestrator
from megatron_s2.posttrain.rollout.engine_backend import EngineRolloutBackend
from megatron_s2.config.posttrain.engines import engine_configs, engine_max_model_len
from megatron_s2.posttrain.opd.payload import step_payload_metrics
from megatron_s2.posttrain.rollout.evaluation import Evaluator, VerifiersEvaluator
from megatron_s2.posttrain.rollout.replicas import replica_topology
from megatron_s2.parallel.rollout_layout import rollout_placement
from megatron_s2.posttrain.rollout.weights import WeightTransfer
from megatron_s2.posttrain.train_batch import PosttrainLoss, build_micro_batches, g_device, split_routing_for_cp
from megatron_s2.posttrain.vocab_parallel import token_log_probs
from megatron_s2.runtime.device import build_on, to_device
from megatron_s2.parallel.grad_finalize import finalize_model_grads
from megatron_s2.training.metrics import truncate_jsonl
from megatron_s2.pipeline.step import StepInputs
from megatron_s2.training.trainer import Trainer

__all__ = ["PosttrainTrainer"]


class _OrchestratorState:
    """The checkpoint's ``data`` entry of a post-training run: the orchestrator's JSON-safe state
    (prompt cursors, dispatch counters, policy version, groups, in-flight partial samples)."""

    def __init__(self, trainer: "PosttrainTrainer"):
        self.trainer, self.pending = trainer, None

    def state_dict(self) -> dict:
        return {"kind": "posttrain", "orchestrator": self.trainer.orchestrator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "posttrain":
            raise ConfigError("checkpoint: it holds no rollout orchestrator state (was it saved by a pretrain or "
                              "sft phase?); start this phase with checkpoint.load=<that run> instead of resuming")
        self.pending = state["orchestrator"]


class PosttrainTrainer(Trainer):
    def __init__(self, recipe, run_dir, *, rank: int = 0, world_size: int = 1, guard=None, log=print, device=None):
        super().__init__(recipe, run_dir, rank=rank, world_size=world_size, guard=guard, log=log, device=device)
        self.kind = recipe.phase.kind
        self.section = section = posttrain_section(recipe)
        self.rollout_cfg = rollout = section.rollout
        self._setup_rollout()
        self.objective = PosttrainObjective(section.loss, rollout.max_staleness)
        self.advantages = AdvantagePipeline(section.advantage, section.effort) if self.kind == "rl" else None
        self.teachers = self._setup_teachers() if self.kind == "opd" else None
        self.reference = self._setup_reference()
        group_filter = None
        if self.advantages is not None and section.advantage.dynamic_sampling:
            group_filter = lambda ss: self.advantages.informative(GroupRollouts.from_samples(ss))  # noqa: E731
        effort = section.effort if self.kind == "rl" else None
        self.orchestrator = Orchestrator(rollout, self.environments, self.backend, seed=recipe.training.seed,
                                         effort_levels=effort.levels if effort else (),
                                         samples_per_level=effort.samples_per_level if effort else 0,
                                         group_filter=group_filter)
        self.data = _OrchestratorState(self)
        self.pending_caches: dict | None = None
        self.started = False
        self.eval_file = self.run_dir / "eval.jsonl"
        self.rollout_file = self.run_dir / "rollouts.jsonl"
        self.warmup = SftWarmup(self) if self.kind == "opd" and section.sft_warmup.steps else None

    def train(self):
        try:
            return super().train()
        finally:
            close = getattr(self.backend, "close", None)
            if close is not None:  # the verifiers / agentic backend's server, threads, sandboxes
                close()

    def build_data(self):
        return None  # replaced by the orchestrator's state once it exists

    def check_phase_inputs(self) -> None:
        """Before the model is built: the rollout environments (kept), then every check
        ``megatron-s2 launch`` also runs, and those that need the drawn prompt sets
        (:func:`~megatron_s2.posttrain.checks.check_posttrain_inputs`)."""
        kind, rollout = self.recipe.phase.kind, posttrain_section(self.recipe).rollout
        self.environments = {name: build_environment(name, rollout.environment_of(name), self.tokenizer,
                                                     what=environment_key(kind, rollout, name))
                             for name in rollout.dataset_names()}
        check_posttrain_inputs(self.recipe, self.tokenizer, environments=self.environments)

    def local_state(self) -> dict | None:
        """The rollout engine's caches of this rank's in-flight samples (saved while it is paused),
        so that a resumed run continues them bit for bit instead of re-prefilling their prefixes
        under newer weights than the ones that computed their KV (report §5.2.3)."""
        if not isinstance(self.backend, EngineRolloutBackend):
            return None
        return {f"rollout.{k}": v for k, v in self.backend.cache_states().items()}

    def load_local_state(self, tensors: dict | None) -> None:
        self.pending_caches = None if tensors is None else \
            {k[len("rollout."):]: v for k, v in tensors.items() if k.startswith("rollout.")}

    # ---- set-up ---------------------------------------------------------------------------------------
    def _setup_rollout(self) -> None:
        recipe, engine_cfg = self.recipe, self.rollout_cfg.engine
        self.placement = rollout_placement(recipe, self.layout, self.world_size)
        if self.placement.shared:
            self.rollout_model, self.rollout_groups, self.transfer = self.model, self.groups, None
        else:
            self.rollout_groups = build_groups(self.placement.layout)
            with build_on(self.device):
                self.rollout_model = family_of(recipe.model).build_model(recipe.model, self.rollout_groups)
            self.rollout_model.to(self.device)
            self.rollout_model.apply_precision_map()
            self.rollout_model.set_token_map(self.tokenizer.compressed_token_map(num_ids=recipe.model.vocab_size))
            self.rollout_model.eval().requires_grad_(False)
            self.transfer = WeightTransfer(self.model, self.rollout_model, rank=self.rank, world_size=self.world_size)
        self.log(f"rollout: {self.placement.reason}")
        self.topology = replica_topology(self.placement.layout, self.rank, g_device(self.groups))
        self.max_model_len = engine_max_model_len(recipe, self.rollout_cfg)
        configs, eos = engine_configs(recipe, self.rollout_cfg), [self.tokenizer.eos_id]
        self.engine = InferenceEngine(self.rollout_model, configs["rollout"], eos_token_ids=eos)
        loader = self._load_rollout_weights if self.transfer else None
        if self.rollout_cfg.served:  # episodes over our server on this engine (rollout/vf_backend.py, agentic_backend.py)
            if self.rollout_cfg.uses_verifiers:
                from megatron_s2.posttrain.rollout.vf_backend import VerifiersBackend as backend_class
            else:
                from megatron_s2.posttrain.rollout.agentic_backend import AgenticBackend as backend_class

            concurrent = max(e.max_concurrent for e in map(self.rollout_cfg.environment_of,
                                                           self.rollout_cfg.dataset_names()))
            self.backend = backend_class(self.engine, self.environments, tokenizer=self.tokenizer,
                                         topology=self.topology, layer_ids=self.rollout_model.layer_ids,
                                         record_routing=engine_cfg.routing_replay, weight_loader=loader,
                                         max_concurrent=concurrent or self.rollout_cfg.max_in_flight, log=self.log)
            # held-out tasks are played through the same server and engine, between steps
            self.eval_engine = None
            self.evaluator = VerifiersEvaluator(self.backend, self.environments, self.topology, self.section.eval,
                                                self.rollout_cfg.max_new_tokens)
        else:
            self.backend = EngineRolloutBackend(self.engine, self.environments, topology=self.topology,
                                         layer_ids=self.rollout_model.layer_ids,
                                         record_routing=engine_cfg.routing_replay, max_model_len=self.max_model_len,
                                         weight_loader=loader)
            self.eval_engine = InferenceEngine(self.rollout_model, configs["eval"], eos_token_ids=eos)
            self.evaluator = Evaluator(self.eval_engine, self.environments, self.topology, self.section.eval,
                                       self.rollout_cfg.max_new_tokens, self.max_model_len)
        self.model.train()

    def _setup_teachers(self) -> TeacherPool:
        from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacher

        cfg, models, owner, temps, remote = self.section, {}, {}, {}, {}
        evaluates = bool(cfg.eval.interval or cfg.eval.at_start)  # its KL reads a served teacher's full distribution
        for i, t in enumerate(cfg.teachers):
            if t.endpoint:  # sampled_token only (config); checked once here: exit 2 naming the field
                remote[t.name] = RemoteTeacher(t.name, t.endpoint, temperature=t.temperature,
                                               timeout_s=t.request_timeout_s,
                                               max_concurrent_requests=t.max_concurrent_requests,
                                               rows_per_request=t.rows_per_request
                                               ).connect(vocab_size=self.recipe.model.vocab_size,
                                                         full_distribution=evaluates)
                self.log(f"opd: teacher '{t.name}' at {t.endpoint} (model {remote[t.name].model})")
            if t.checkpoint:
                models[t.name] = load_frozen_model(t.checkpoint, self.rollout_groups, vocab_size=self.recipe.model.vocab_size,
                                                   tokenizer=self.tokenizer, what=f"opd.teachers[{i}].checkpoint",
                                                   device=self.device)
            temps[t.name] = t.temperature
            for d in t.domains:
                owner[d] = t.name
        # every domain has its teacher (OPDConfig refuses a recipe where one has none)
        self.domain_of = {n: cfg.dataset_domain(n) for n in self.rollout_cfg.dataset_names()}
        return TeacherPool(models, owner, temps, remote)

    def _setup_reference(self):
        if not self.section.loss.has_term("reference_kl"):
            return None
        own = getattr(self.section, "reference_checkpoint", "")  # else the initial weights (checked at start-up)
        return load_frozen_model(own or self.recipe.checkpoint.load, self.rollout_groups,
                                 vocab_size=self.recipe.model.vocab_size, tokenizer=self.tokenizer,
                                 what=f"{self.kind}.reference_checkpoint" if own else "checkpoint.load",
                                 device=self.device)

    # ---- weights -------------------------------------------------------------------------------------
    def _load_rollout_weights(self, version: int) -> None:
        t0 = time.perf_counter()
        self.transfer()
        self._timing["weight_sync_s"] = self._timing.get("weight_sync_s", 0.0) + time.perf_counter() - t0

    def _start(self) -> None:
        """After restore: the engine gets the learner's weights and version, the orchestrator its
        state (in-flight samples restored or discarded by the staleness rule) or a fresh start."""
        self._timing = {}
        if self.transfer is not None:
            self.transfer()
        self.engine.set_policy_version(self.step)
        if self.eval_engine is not None:
            self.eval_engine.set_policy_version(self.step)
        if self.data.pending is not None:
            state = self.data.pending
            if state["policy_version"] != self.step:
                raise ConfigError(f"checkpoint: its orchestrator is at policy version {state['policy_version']}, "
                                  f"the model at step {self.step}; the checkpoint is inconsistent")
            if self.pending_caches is not None and isinstance(self.backend, EngineRolloutBackend):
                self.backend.load_cache_states(self.pending_caches)
            self.orchestrator.load_state_dict(state)
            self.data.pending = self.pending_caches = None
            ledger, restored = self.orchestrator.ledger, getattr(self.backend, "restored", None)
            exact = f" ({restored['exact']} on this rank from their engine state)" if restored else ""
            self.log(f"rollout: orchestrator restored at version {self.step} ({len(self.orchestrator.groups)} open "
                     f"groups, {self.orchestrator.in_flight} samples in flight{exact}, ledger {ledger})")
            if restored and restored["prefilled"]:
                self.log(f"rollout: {restored['prefilled']} in-flight samples of this rank are re-prefilled from their "
                         "tokens (no saved engine state fits them: the layout or the engine settings changed, or "
                         "the model family cannot save it), so they continue close to, not exactly as, the "
                         "interrupted run")
        self.started = True

    # ---- one step --------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        if not self.started:
            self._start()
            if self.step == 0 and self.section.eval.at_start:
                self._evaluate()
        if self.warmup is not None and self.warmup.active(self.step):  # OPD's SFT warm-up steps come first
            return self.warmup.train_step()
        t0 = time.perf_counter()
        self._timing = {}
        orch = self.orchestrator
        if orch.paused:
            orch.resume()
        self.rollout_model.eval()
        idle, filtered = 0, orch.ledger["filtered"]
        while not orch.batch_ready():
            if orch.ledger["filtered"] - filtered > 50 * self.rollout_cfg.batch_groups:
                raise RuntimeError(f"rollout: {orch.ledger['filtered'] - filtered} groups in a row were uninformative "
                                   "(every response got the same reward) and dynamic sampling dropped them; the "
                                   "policy cannot solve (or always solves) these prompts — start from an SFT checkpoint "
                                   "(checkpoint.load) or change the task difficulty")
            got = orch.pump()
            if got == 0 and not self.backend.any_busy:
                idle += 1
                if idle > 3:
                    raise RuntimeError(f"rollout: no sample in flight and {len(orch.ready)} of "
                                       f"{self.rollout_cfg.batch_groups} groups ready; ledger {orch.ledger}")
            else:
                idle = 0
        groups = orch.begin_training()
        t_rollout = time.perf_counter() - t0
        stats = self.backend.take_stats()
        samples = [s for g in groups for s in g.accepted]
        extra = rollout_metrics(groups, orch.take_outcomes(), current_version=self.step,
                                max_staleness=self.rollout_cfg.max_staleness)
        t1 = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, self.step)
        http_before = self._teacher_http_bytes()
        result, loss_stats, tokens = self._train_on(samples, groups)
        if self.kind == "opd":  # worked example 24: what the teacher's signal of this step weighs
            extra.update(step_payload_metrics(self.section.mode, tokens=tokens,
                                              vocab_size=self.recipe.model.vocab_size,
                                              value_bytes=self._signal_value_bytes,
                                              http_bytes=self._teacher_http_bytes() - http_before,
                                              served=bool(self.teachers.remote), groups=self.groups))
        grad_norm = self.apply_gradients(result.loss)
        t_train = time.perf_counter() - t1
        orch.finish_update(self.step)  # weights into the engine (version + 1), staleness rule
        extra.update(result.metrics)  # the forward's own: draft_lk / draft_accept_k (online draft update), indexer_kl
        extra.update(loss_stats)
        extra.update(self._rollout_rates(stats, t_rollout, tokens, t_train))
        extra.update({f"ledger_{k}": float(v) for k, v in orch.ledger.items()})
        extra["in_flight"] = float(orch.in_flight)
        if self._eval_due():
            extra.update(self._evaluate())
        step_time = time.perf_counter() - t0
        extra["rollout_time_s"], extra["train_time_s"] = t_rollout, t_train
        extra.update(self._timing)
        self._record_prompts(groups)
        return {"loss": result.loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "step_time": step_time,
                "extra": extra, "fingerprint": ",".join(g.prompt_uid for g in groups)}

    def _train_on(self, samples, groups):
        t, cfg = self.recipe.training, self.section
        if self.kind == "rl":
            adv = self.advantages.compute([GroupRollouts.from_samples(g.accepted) for g in groups])
            if cfg.advantage.credit == "turn":  # one advantage per assistant turn
                advantages = [list(t) for res in adv for t in res.turn_advantages]
            else:
                advantages = [float(a) for res in adv for a in res.advantages]
        else:
            advantages = [0.0] * len(samples)
        weights = None
        if self.kind == "opd" and cfg.domain_weights:
            weights = {n: cfg.weight_of(d) for n, d in self.domain_of.items()}
        mbs = build_micro_batches(samples, advantages, seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                                  dp_rank=self.dp_rank, dp_size=self.layout.dp, pad_id=self.tokenizer.pad_id,
                                  loss_config=cfg.loss, dataset_weights=weights,
                                  train_aware_replay=self.rollout_cfg.engine.train_aware_replay,
                                  micro_batch_multiple=self.layout.pp if self.layout.vpp > 1 else 1)
        for mb in mbs:
            self._add_frozen_outputs(mb)
        global_tokens = float(sum(sum(row.policy_mask[1:]) for s in samples for row in s.rows))
        num_micro = len(mbs) * self.layout.dp  # more than the recipe's when episodes left several branches
        mode = "rl" if self.kind == "rl" else ("opd_sampled" if cfg.mode == "sampled_token" else "opd_full")
        loss = PosttrainLoss(self.objective, self.groups, current_version=self.step, global_tokens=global_tokens,
                             mode=mode, proximal=getattr(cfg, "proximal", "snapshot"))
        step_loss = loss
        if self.recipe.phase.train_drafter:  # online draft update at the rollout temperature (walkthrough Ch. 4)
            from megatron_s2.training.draft_objective import DraftObjective

            step_loss = DraftObjective(torch.tensor([global_tokens]), num_micro, language_model=False,
                                       eta=self.recipe.phase.drafter_eta, temperature=self.rollout_cfg.temperature,
                                       primary=loss)
        cp = self.groups.cp
        split = []
        for mb in mbs:
            routing = split_routing_for_cp(mb.pop("routing"), t.seq_length, cp)
            part = split_micro_batch(to_device(mb, self.device), cp)
            part["routing"] = routing
            split.append(part)
        self.model.train()
        inputs = StepInputs(split, self.groups, num_micro, loss_fn=step_loss)
        result = self.forward_backward(self.model, inputs)
        finalize_model_grads(self.params, self.groups, self.recipe.parallel.grad_bucket_mb, zero1=self.zero1)
        return result, loss.reduce(), int(global_tokens)

    def _add_frozen_outputs(self, mb: dict) -> None:
        """Teacher / reference outputs of the micro-batch's rows (whole sequences, before any
        context-parallel split), on the policy's vocabulary shard."""
        tp, temp = self.rollout_groups.tp, self.section.loss.temperature
        if self.reference is not None:
            mb["reference_logprobs"] = token_log_probs(full_logits(self.reference, mb["tokens"]), mb["labels"], tp, temp)
        if self.teachers is None:
            return
        domains = [self.domain_of[d] for d in mb.pop("domains")]
        if self.section.mode == "full_vocab":
            mb["teacher_logits"] = self.teachers.logits(mb["tokens"], domains)
        else:  # in-process or remote teachers, row by row
            mb["teacher_logprobs"] = self.teachers.token_logprobs(mb["tokens"], mb["labels"], domains, tp,
                                                                  loss_mask=mb["loss_mask"], replica=self.groups)
        signal = mb.get("teacher_logits", mb.get("teacher_logprobs"))
        self._signal_value_bytes = signal.element_size()  # the precision the signal is held in

    def _teacher_http_bytes(self) -> int:
        """Bytes the served teachers have sent this rank so far (0 without any)."""
        teachers = self.teachers.remote.values() if self.kind == "opd" else ()
        return sum(t.response_bytes for t in teachers)

    def _rollout_rates(self, stats, t_rollout: float, tokens: int, t_train: float) -> dict[str, float]:
        local = torch.tensor([stats.generated_tokens if self.topology.leader else 0, stats.engine_time_s
                              if self.topology.leader else 0.0, stats.replayed if self.topology.leader else 0],
                             dtype=torch.float64)
        if self.world_size > 1:
            import torch.distributed as dist

            local = local.to(g_device(self.groups))
            dist.all_reduce(local)
            local = local.cpu()
        generated = float(local[0])
        rates = {"rollout_tokens": generated, "rollout_tokens_per_s": generated / max(t_rollout, 1e-9),
                 "train_tokens_per_s": tokens / max(t_train, 1e-9)}
        if self.rollout_cfg.served:  # episodes played again after a transport error (episode_backend.MAX_REPLAYS)
            rates["rollout_replayed"] = float(local[2])
        spec = getattr(self.engine, "speculator", None)
        if spec is not None:  # this step's speculation on this rank (report §2.4.3)
            now = (spec.stats.rounds, spec.stats.drafted, spec.stats.accepted, spec.stats.emitted,
                   spec.speculative_steps, spec.gate.plain_steps)
            before = getattr(self, "_spec_seen", (0,) * len(now))
            rounds, drafted, accepted, emitted, drafting, plain = (a - b for a, b in zip(now, before))
            self._spec_seen = now
            rates["rollout_draft_acceptance"] = accepted / drafted if drafted else 0.0
            rates["rollout_tokens_per_verification"] = emitted / rounds if rounds else 0.0
            # decode steps that drafted (the rest decoded plainly: drafting did not pay at that batch)
            rates["rollout_drafting_steps"] = drafting / (drafting + plain) if drafting + plain else 0.0
        return rates

    # ---- evaluation ------------------------------------------------------------------------------------
    def _eval_due(self) -> bool:
        e = self.section.eval
        if not e.interval:
            return False
        return self.step % e.interval == 0 or self.step >= self.recipe.training.train_steps

    def _evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.rollout_model.eval()
        if getattr(self, "eval_engine", None) is not None:  # it runs the rollout model's weights: version self.step
            self.eval_engine.set_policy_version(self.step)
        teacher = None
        if self.kind == "opd":
            teacher = (self.teachers, self.domain_of)
        result = self.evaluator.run(self.step, teacher=teacher, scorer_groups=self.rollout_groups)
        result["eval_time_s"] = time.perf_counter() - t0
        if self.is_main:
            self.eval_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.eval_file, "a") as f:
                f.write(json.dumps({"step": self.step, **result}) + "\n")
            acc = result.get("eval_accuracy")
            self.log(f"eval at step {self.step}: " + " ".join(f"{k}={v:.4g}" for k, v in result.items()
                                                                if isinstance(v, float)) +
                     ("" if acc is None else f"  (held-out accuracy {acc:.3f})"))
        return result

    def _record_prompts(self, groups) -> None:
        """rollouts.jsonl: the prompts this step trained on, the prompts dispatched so far and
        those still open (in flight or complete, untrained) — the audit trail that a resumed run
        trains no prompt twice and skips none (every dispatched prompt is trained, filtered by
        dynamic sampling, or still open)."""
        if not self.is_main:
            return
        orch = self.orchestrator
        record = {"step": self.step, "version": orch.version, "trained": [g.prompt_uid for g in groups],
                  "dispatched": orch.dispatched, "filtered": orch.ledger["filtered"],
                  "open": sorted(g.prompt_uid for g in orch.groups.values())}
        with open(self.rollout_file, "a") as f:
            f.write(json.dumps(record) + "\n")

    def write_run_files(self) -> None:
        super().write_run_files()
        if not self.is_main:
            return
        # Records of an attempt that died after its last checkpoint. An evaluation at step s >= 1
        # is written before step s's checkpoint, so it stays; the one at step 0 runs again whenever
        # the run starts from step 0 (no checkpoint yet), so the dead attempt's copy goes.
        for path, keep in ((self.rollout_file, self.step), (self.eval_file, self.step if self.step else -1)):
            if path.exists():
                truncate_jsonl(path, keep)
