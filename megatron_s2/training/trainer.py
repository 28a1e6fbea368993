"""The trainer: a recipe in, a trained checkpoint and metrics out.

One optimiser step is: set the learning rate (§4.2.2 schedule) -> the data-parallel rank's
micro-batches -> forward/backward through the schedule chosen for the layout -> gradient
reduction -> clipping -> the hybrid Muon / Sinkhorn / AdamW step (§2.5) -> the MoE
correction-bias update (once per step, after the optimiser, §2.1.1) -> metrics and, on
cadence or preemption, a checkpoint. Nothing here assumes a single process: ranks, groups
and stages come from the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_s2.checkpoint import CheckpointError, CheckpointManager
from megatron_s2.config.recipe import RecipeConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.data import batch_fingerprint, build_data_iterator
from megatron_s2.data.errors import DataError
from megatron_s2.data.tokenizer_checks import check_checkpoint_tokenizer, record_run_tokenizer
from megatron_s2.models.family import family_of
from megatron_s2.optim import build_optimizer, describe_param_groups
from megatron_s2.optim.lr_schedule import LRSchedule
from megatron_s2.parallel.context_parallel import split_micro_batch
from megatron_s2.pipeline.encoder_phase import EncoderPhase
from megatron_s2.optim.distributed_optimizer import DistributedOptimizer
from megatron_s2.parallel.layout import ParallelLayout
from megatron_s2.optim.optimizer_shards import optimizer_shard_groups
from megatron_s2.parallel.setup import build_groups
from megatron_s2.parallel.sharding import name_seed
from megatron_s2.pipeline.schedules import get_forward_backward_func
from megatron_s2.runtime.device import build_on, check_device_backend, process_device, to_device
from megatron_s2.runtime.finite import NonFiniteGuard
from megatron_s2.parallel.grad_finalize import clip_grads, finalize_model_grads
from megatron_s2.runtime.markers import (FINISHED_MARKER, clear_preempted, extension_hint, finished_step,
                                          write_finished, write_preempted)
from megatron_s2.training.metrics import MetricsLogger, device_peak_tflops
from megatron_s2.training.model_builder import build_stage_model
from megatron_s2.runtime.host_memory import HostMemory
from megatron_s2.training.run_checks import check_rank_memory, check_run_inputs
from megatron_s2.training.rng import rng_state, seed_everything, set_rng_state
from megatron_s2.pipeline.step import StepInputs

__all__ = ["Trainer", "TrainResult"]


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    final_loss: float | None
    preempted: bool
    losses: list[float]
    fingerprints: list[str]


class Trainer:
    fresh_on_load: tuple[str, ...] = ("dspark.", "timeseries.")
    """Name prefixes of model tensors a new phase may add to a loaded checkpoint (they keep their
    initialisation): the DSpark drafter (report §2.4.3) and the time-series encoder (a text
    checkpoint continued with series, Intern-S2 §2.2.1); a phase adds its own."""

    def __init__(self, recipe: RecipeConfig, run_dir: Path, *, rank: int = 0, world_size: int = 1, guard=None,
                 log=print, device=None):
        """``device``: where this rank computes; default :func:`~megatron_s2.runtime.device.process_device`
        (the process group's device, else ``parallel.backend`` and the GPUs this process sees)."""
        self.recipe, self.run_dir = recipe, Path(run_dir)
        self.device = torch.device(device) if device is not None else process_device(recipe.parallel.backend)
        check_device_backend(self.device)
        self.rank, self.world_size, self.guard = rank, world_size, guard
        self.is_main = rank == 0
        self.log = log if self.is_main else (lambda *a, **k: None)
        t = recipe.training
        seed_everything(t.seed, t.deterministic)
        self.layout = ParallelLayout.from_recipe(recipe, world_size)
        self.groups = build_groups(self.layout)
        # The checks `megatron-s2 launch` also runs (run dir, tokenizer, data files); memory is
        # planned on this rank's own model while it is still on the meta device (built once).
        self.tokenizer = check_run_inputs(recipe, world_size, None, self.run_dir)
        self.check_phase_inputs()
        host = HostMemory.for_this_rank()
        with build_on(self.device):  # parameters, buffers and what modules build at construction
            self.model, self.pipeline = self.build_model(host)
        self.attach_phase_modules()
        self._freeze(recipe.phase.freeze)
        if recipe.phase.kind == "dspark":  # §2.4.3: only the drafter trains; the backbone holds no optimiser state
            for name, p in self.model.named_parameters():
                if not name.startswith("dspark."):
                    p.requires_grad_(False)
        if recipe.phase.trains_drafter:
            self.model.capture_dspark = True
            if self.pipeline is not None:  # the last stage's replica of the embedding (models/v41/model.py)
                self.pipeline.refresh()
        else:  # a phase that does not train the drafter keeps it as it is (no gradient, no optimiser state)
            for name, p in self.model.named_parameters():
                if name.startswith("dspark."):
                    p.requires_grad_(False)
        row_groups, matrix_shards = optimizer_shard_groups(self.model, self.groups, recipe.optimizer)
        # the DSpark stage under pipeline parallelism: the stages before the last hold only frozen layers
        self.optimizer = build_optimizer(self.model, recipe.optimizer, row_groups=row_groups,
                                         matrix_shards=matrix_shards,
                                         allow_empty=self.optimizer_may_be_empty())
        if recipe.parallel.distributed_optimizer:
            self.optimizer = DistributedOptimizer(self.optimizer, self.model, self.groups,
                                                  bucket_mb=recipe.parallel.grad_bucket_mb)
        self.zero1 = self.optimizer if isinstance(self.optimizer, DistributedOptimizer) else None
        self.schedule = LRSchedule(recipe.schedule, tokens_per_step=t.global_batch_size * t.seq_length)
        coords = self.layout.coords(rank)
        self.dp_rank = coords["dp"]
        self.data = self.build_data()
        self.num_micro_global = t.global_batch_size // t.micro_batch_size
        self.forward_backward = get_forward_backward_func(self.layout, self.pipeline)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", rank, world_size,
                                             keep_last=recipe.checkpoint.keep_last,
                                             async_save=recipe.checkpoint.async_save,
                                             layout=self.layout.describe(), log=self.log)
        self.step = 0
        self.vision_frozen = self._freeze_vision() if t.freeze_vision_until_decay else []
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.non_finite = NonFiniteGuard(t.non_finite, t.non_finite_max_skips, self.log)

    # ---- setup helpers --------------------------------------------------------------------------
    def check_phase_inputs(self) -> None:
        """A phase's own start-up checks, after :func:`check_run_inputs` and before the model is
        built (post-training phases check their engine, frozen models and prompts); none here."""

    def build_model(self, host: HostMemory):
        """(this rank's model, its pipeline runtime or None); a phase with another model
        (``phase.kind: contrastive``) supplies its own."""
        recipe, rank = self.recipe, self.rank
        return build_stage_model(
            recipe, self.layout, self.groups, rank,
            self.tokenizer.compressed_token_map(num_ids=recipe.model.vocab_size), device=self.device,
            plan_memory=lambda skeleton: check_rank_memory(recipe, self.layout, rank, skeleton, host))

    def describe_model(self) -> list[str]:
        """Start-up log lines about the model (shard, precision, kernels)."""
        lines = []
        if self.world_size > 1:
            lines.append(f"rank 0 holds layers {self.model.layer_ids[0]}-{self.model.layer_ids[-1]} "
                         "(its shard of the model is listed below)")
        lines.append(describe_param_groups(self.model, self.recipe.optimizer))
        family = family_of(self.recipe.model).describe(self.model, self.recipe.model)
        return [*lines, f"device: {self.device}; " + family[0], *family[1:]]

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the metrics' throughput line."""
        return family_of(self.recipe.model).train_flops_per_token(self.recipe.model, self.recipe.training.seq_length)

    def optimizer_may_be_empty(self) -> bool:
        """Whether this rank may hold no trainable tensor: a phase whose trained module lives on the
        last pipeline stage only (the DSpark stage; the Memory Decoder's router)."""
        return self.recipe.phase.kind == "dspark" and self.layout.pp > 1

    def forward_model(self):
        """The model as the schedules call it (a phase whose objective reads more than the logits
        wraps it, megatron_s2/posttrain/memdec/forward.py); the model itself here."""
        return self.model

    def attach_phase_modules(self) -> None:
        """Modules a phase adds to the built model before the optimiser sees it (the Memory
        Decoder's router, megatron_s2/posttrain/memdec); none here."""

    def build_data(self):
        """The phase's data source; its ``state_dict`` is the checkpoint's ``data`` entry
        (post-training phases supply their rollout orchestrator instead, megatron_s2/posttrain)."""
        t = self.recipe.training
        return build_data_iterator(self.recipe.data, seq_length=t.seq_length, global_batch_size=t.global_batch_size,
                                   micro_batch_size=t.micro_batch_size, dp_rank=self.dp_rank,
                                   dp_size=self.layout.dp, seed=t.seed, phase=self.recipe.phase.kind,
                                   tokenizer=self.tokenizer, log=self.log,
                                   image_processor=family_of(self.recipe.model).image_processor(self.recipe.model),
                                   cp_rank=self.groups.cp.rank, cp_size=self.groups.cp.size, model=self.recipe.model)

    def _freeze(self, patterns: tuple[str, ...]) -> None:
        from fnmatch import fnmatch

        for name, p in self.model.named_parameters():
            if any(fnmatch(name, pat) for pat in patterns):
                p.requires_grad_(False)

    def _freeze_vision(self) -> list[torch.nn.Parameter]:
        """Freeze the vision encoder until the decay (``training.freeze_vision_until_decay``, §2.5).

        The optimiser is built first, so the encoder has its place (and, under ZeRO-1, its shard)
        from the start; frozen, it has no gradient, and every update rule skips a parameter without
        one (no momentum, no weight decay)."""
        from fnmatch import fnmatch

        patterns = family_of(self.recipe.model).vision_encoder_patterns(self.recipe.model)
        if not patterns:
            raise ConfigError("training.freeze_vision_until_decay: the model has no vision encoder "
                              "(model.vision_n_layers: 0); set it false")
        frozen = [p for name, p in self.model.named_parameters()
                  if p.requires_grad and any(fnmatch(name, pat) for pat in patterns)]
        for p in frozen:
            p.requires_grad_(False)
        return frozen

    def _unfreeze_vision_at_decay(self) -> None:
        """From the first step of the learning-rate decay on, the vision encoder trains (§2.5)."""
        if not self.vision_frozen or not self.schedule.decay_started(self.step):
            return
        for p in self.vision_frozen:
            p.requires_grad_(True)
        self.log(f"step {self.step + 1}: learning-rate decay starts; the vision encoder is unfrozen "
                 f"({len(self.vision_frozen)} tensors)")
        self.vision_frozen = []
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def write_run_files(self) -> None:
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A save killed mid-way leaves its directory, which may hold the space the files below need.
        self.checkpoints.store.remove_leftovers()
        tmp = self.run_dir / ".config.yaml.tmp"
        tmp.write_text(self.recipe.to_yaml())
        tmp.replace(self.run_dir / "config.yaml")
        record_run_tokenizer(self.tokenizer, self.run_dir)  # checkpoints carry their tokenizer

    # ---- checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint holds: the model and optimiser (sharded tensors), the data
        iterator's layout-independent state, this rank's RNG states and other rank-local
        tensors (:meth:`local_state`), and the step."""
        return {"model": self.model, "optimizer": self.optimizer, "data": self.data.state_dict(),
                "rng": rng_state(), "local": self.local_state(), "step": self.step}

    def local_state(self) -> dict | None:
        """Tensors of this rank only, restored on the same layout (:meth:`load_local_state`)."""
        return None

    def load_local_state(self, tensors: dict | None) -> None:
        """What :meth:`local_state` saved; None when the layout changed since."""

    def save(self) -> Path:
        if self.checkpoints.last_saved_step == self.step:  # preempted right after an interval save
            self.checkpoints.wait()
            return self.checkpoints.store.step_dir(self.step)
        t, ck = self.recipe.training, self.recipe.checkpoint
        # An asynchronous save must be committed before train() returns when no later save will
        # wait for it: end of run, preemption, or no further save scheduled. (should_stop() is
        # collective; every rank calls save() at the same point of the loop.)
        next_save = (self.step // ck.save_interval + 1) * ck.save_interval if ck.save_interval else t.train_steps
        blocking = (self.step >= t.train_steps or (self.guard is not None and self.guard.should_stop())
                    or (next_save >= t.train_steps and not ck.save_at_end))
        meta = {"layout": self.layout.describe(), "config": self.recipe.to_mapping(), "model": self.recipe.model.name}
        path = self.checkpoints.save(self.step, self.state(), meta, blocking=blocking)
        how = "saving in the background" if ck.async_save and not blocking else "saved"
        self.log(f"checkpoint: {how} step {self.step} to {path}")
        return path

    def restore(self) -> bool:
        ck = self.recipe.checkpoint
        try:
            path = self.checkpoints.resume_path() if ck.resume else None
        except CheckpointError as exc:
            raise ConfigError(f"checkpoint: {exc}") from None
        full, key = True, "checkpoint"
        if path is None and ck.load:
            try:
                path = self.checkpoints.resolve(Path(ck.load))
            except CheckpointError as exc:
                raise ConfigError(f"checkpoint.load: {exc}") from None
            full, key = ck.load_optimizer, "checkpoint.load"
            check_checkpoint_tokenizer(path, self.tokenizer, self.log)
        if path is None:
            if self.recipe.phase.kind == "dspark":  # legal (tests, parity), but rarely what a user wants
                self.log("warning: phase.kind: dspark without checkpoint.load trains the drafter against a randomly "
                         "initialised backbone; set checkpoint.load to the pre-trained backbone's checkpoints")
            return False
        try:  # a refusal leaves the run directory as it was: nothing has been written yet
            # a new phase may add the DSpark drafter (report §2.4.3) or the visual next-patch pieces
            # (walkthrough Ch. 3) to a backbone checkpoint
            loaded = self.checkpoints.load(path, self.model, self.optimizer if full else None,
                                           may_be_missing=() if full else self.fresh_on_load,
                                           load_only=() if full else self.load_only(path))
            if full:
                self.data.load_state_dict(loaded.data)
                self.load_local_state(loaded.local)
        except (CheckpointError, DataError) as exc:
            raise ConfigError(f"{key}: cannot {'resume' if full else 'initialise'} from {path}: {exc}; run it with "
                              "the recipe it was saved with (its config.yaml), or use a new --run-dir") from None
        if full:
            self.step = loaded.step
            if loaded.rng is not None:
                set_rng_state(loaded.rng)
            else:
                seed = name_seed(self.recipe.training.seed, f"rng:step={self.step}:rank={self.rank}")
                seed_everything(seed, self.recipe.training.deterministic)
                self.log(f"checkpoint: saved with layout '{loaded.manifest.layout}', running '{self.layout.describe()}': "
                         f"per-rank RNG states not restored; reseeded from (seed, step {self.step}, rank)")
            if loaded.fresh_optimizer_state:
                self.log(f"checkpoint: {len(loaded.fresh_optimizer_state)} parameters have no stored optimizer "
                         f"state and start from zero (e.g. {loaded.fresh_optimizer_state[0]})")
        if loaded.fresh_model:
            taken = f" (only {', '.join(only)} taken)" if not full and (only := self.load_only(path)) else ""
            self.log(f"checkpoint: {len(loaded.fresh_model)} tensors are not in {path}{taken} and start from their "
                     f"initialisation (e.g. {loaded.fresh_model[0]})")
        self.log(f"checkpoint: {'resumed' if full else 'initialised'} from {path} (step {loaded.step})")
        return True

    def load_only(self, path: Path) -> tuple[str, ...]:
        """Model name prefixes a ``checkpoint.load`` that starts a new phase takes from ``path``:
        ``checkpoint.load_only``, else everything; from a contrastive phase's checkpoint only the
        vision encoder carries over (report §4.2.2: the text tower is discarded)."""
        if self.recipe.checkpoint.load_only:
            return self.recipe.checkpoint.load_only
        if self.recipe.phase.kind == "contrastive":
            return ()
        from megatron_s2.checkpoint.format import Manifest

        try:
            saved = Manifest.from_json((path / "checkpoint.json").read_bytes(), path).config["phase"]["kind"]
        except (OSError, KeyError, TypeError, CheckpointError):
            return ()  # the load itself names what is wrong with the checkpoint
        return ("vision.",) if saved == "contrastive" else ()

    # ---- loop ---------------------------------------------------------------------------------
    def compute_gradients(self, micro_batches: list[dict]):
        """Forward/backward over this rank's micro-batches and reduce the gradients."""
        micro_batches = [split_micro_batch(to_device(mb, self.device), self.groups.cp) for mb in micro_batches]
        vision = EncoderPhase.forward(self.model, micro_batches)  # disaggregated encoder step (§3.1.1)
        inputs = StepInputs(micro_batches, self.groups, self.num_micro_global, loss_fn=self.step_objective(micro_batches))
        result = self.forward_backward(self.forward_model(), inputs)
        vision.backward()
        finalize_model_grads(self.params, self.groups, self.recipe.parallel.grad_bucket_mb, zero1=self.zero1)
        return result

    def step_objective(self, micro_batches: list[dict]):
        """The step's loss_fn: None (token cross-entropy), or the DSpark drafter's objective when the
        phase trains the drafter (:mod:`.draft_objective`)."""
        phase = self.recipe.phase
        if not phase.trains_drafter:
            return None
        from megatron_s2.pipeline.losses import global_token_count
        from megatron_s2.training.draft_objective import DraftObjective

        return DraftObjective(global_token_count(micro_batches, self.groups.dp_cp), self.num_micro_global,
                              language_model=phase.kind != "dspark", eta=phase.drafter_eta,
                              temperature=phase.drafter_temperature)

    def apply_gradients(self, loss: float | None = None) -> float:
        """Clip, optimiser step, then the model's once-per-step update (the MoE correction biases). A
        non-finite loss or gradient norm stops the run or skips the update
        (``training.non_finite``, :mod:`.finite`)."""
        grad_norm = clip_grads(self.params, self.recipe.optimizer.clip_grad, self.groups, zero1=self.zero1 is not None)
        if not self.non_finite.admit(self.step + 1, loss, float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.model.after_optimizer_step(skipped=True)  # this step's statistics (expert loads) are dropped
            self.step += 1
            return float(grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            self.pipeline.refresh()  # replicas follow their owners (§3.1.2)
        self.model.after_optimizer_step(skipped=False)  # e.g. the MoE correction-bias update (§2.1.1)
        self.step += 1
        return float(grad_norm)

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        self._unfreeze_vision_at_decay()
        lr = self.schedule.apply(self.optimizer, self.step)
        micro_batches = self.data.next_step()
        fingerprint = batch_fingerprint(micro_batches)
        result = self.compute_gradients(micro_batches)
        grad_norm = self.apply_gradients(result.loss)
        return {"loss": result.loss, "lr": lr, "grad_norm": grad_norm, "tokens": result.tokens,
                "step_time": time.perf_counter() - t0, "extra": result.metrics, "fingerprint": fingerprint}

    def train(self) -> TrainResult:
        t = self.recipe.training
        resumed = self.restore()  # a refused resume raises before anything is written
        if resumed and self.pipeline is not None:
            self.pipeline.refresh()  # replicas follow the loaded owners
        self.write_run_files()
        if self.is_main:
            clear_preempted(self.run_dir)  # this attempt decides afresh how it ends
            done = finished_step(self.run_dir)
            if done is not None and self.step < t.train_steps:
                (self.run_dir / FINISHED_MARKER).unlink()
                self.log(f"extending the finished run: step {self.step} -> {t.train_steps} (training.train_steps)")
        self.log(f"layout: {self.layout.describe()}")
        if self.is_main:
            for line in self.describe_model():
                self.log(line)
        flops = self.flops_per_token()
        metrics = MetricsLogger(self.run_dir, enabled=self.is_main, total_steps=t.train_steps,
                                log_interval=self.recipe.logging.log_interval,
                                tensorboard=self.recipe.logging.tensorboard,
                                progress_bar=self.recipe.logging.progress_bar, flops_per_token=flops,
                                world_size=self.world_size,
                                peak_tflops=device_peak_tflops(self.recipe.logging.device_peak_tflops)
                                if self.device.type == "cuda" else (self.recipe.logging.device_peak_tflops or None))
        metrics.set_start(self.step)
        start, losses, prints, preempted = self.step, [], [], False
        if resumed and self.step >= t.train_steps:
            self.log(f"run already complete at step {self.step}; {extension_hint(self.step)}")
        elif self.guard is not None and self.guard.should_stop():  # signalled during start-up
            self.log(f"preemption requested before the first step: exiting at step {self.step} "
                     "(the newest checkpoint is current)")
            preempted = True
        while self.step < t.train_steps and not preempted:
            out = self.train_step()
            losses.append(out["loss"])
            prints.append(out["fingerprint"])
            metrics.log(self.step, out["loss"], out["lr"], out["grad_norm"], out["tokens"], out["step_time"], out["extra"])
            interval = self.recipe.checkpoint.save_interval
            if interval and self.step % interval == 0 and self.step < t.train_steps:
                self.save()
            if self.guard is not None and self.guard.should_stop():
                self.log(f"preemption requested: saving step {self.step} and exiting")
                self.save()
                preempted = True
                break
        if not preempted and self.recipe.checkpoint.save_at_end and self.step > start:
            self.save()
        final_loss = losses[-1] if losses else None
        if self.is_main:
            self.log(metrics.summary())
            if preempted:  # after the save committed on every rank, before any rank exits
                received = self.guard.received if self.guard is not None else None
                write_preempted(self.run_dir, self.step, received.name if received else "unknown")
            elif self.step >= t.train_steps:
                write_finished(self.run_dir, self.step, final_loss)
        metrics.close()
        return TrainResult(self.step - start, self.step, final_loss, preempted, losses, prints)
