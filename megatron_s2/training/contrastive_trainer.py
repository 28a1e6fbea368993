"""The contrastive phase (``phase.kind: contrastive``): SigLIP pre-training of the vision encoder
(V4.1 report §4.2.2, "Vision Encoder Training"; schedule §3.1.1).

The generic :class:`~.trainer.Trainer` loop (learning-rate schedule, gradient reduction,
clipping, the hybrid optimiser, checkpoints, preemption, metrics) with three phase pieces:

* the model: the family's two-tower model (:meth:`ModelFamily.build_contrastive_model`; for V4.1
  :mod:`megatron_s2.models.v41.vision.contrastive`), whose vision encoder is stored under the
  ``vision.*`` names of ``V41Model.vision`` (a later phase loads it from this checkpoint);
* the data: (image, caption) pairs (:mod:`megatron_s2.data.image_text_pairs`), images at the
  phase's resolution cap (``contrastive.max_image_size``, 224 px in the report), captions through
  the recipe's tokenizer;
* the step: one micro-batch per data-parallel rank through the overlapped schedule
  (:mod:`.contrastive_schedule`); the reduction SUMs the ranks' partial gradients.

With ``contrastive.eval_items`` the run ends with zero-shot image->caption top-1 retrieval over
held-out pairs, logged beside chance and written to ``retrieval.json`` in the run directory.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.distributed as dist

from megatron_s2.config.contrastive import ContrastiveConfig
from megatron_s2.data.errors import DataError
from megatron_s2.data.image_text_pairs import build_pair_source, heldout_pairs
from megatron_s2.models.family import family_of
from megatron_s2.models.init import initialize_parameters
from megatron_s2.optim import describe_param_groups
from megatron_s2.parallel.grad_finalize import finalize_model_grads
from megatron_s2.runtime.host_memory import HostMemory
from megatron_s2.training.contrastive_schedule import contrastive_forward_backward
from megatron_s2.training.trainer import Trainer

__all__ = ["ContrastiveTrainer", "retrieval_accuracy"]


class ContrastiveTrainer(Trainer):
    def __init__(self, recipe, run_dir, **kwargs):
        self.contrastive = recipe.contrastive or ContrastiveConfig()
        super().__init__(recipe, run_dir, **kwargs)

    # ---- phase pieces ---------------------------------------------------------------------------
    def build_model(self, host: HostMemory):
        from fnmatch import fnmatch

        recipe = self.recipe
        model = family_of(recipe.model).build_contrastive_model(recipe.model, self.contrastive,
                                                                self.tokenizer.vocab_size, self.groups)
        initialize_parameters(model, recipe.training.seed, recipe.model.init_std)  # (seed, name): layout-free
        for name, p in model.named_parameters():
            if any(fnmatch(name, pattern) for pattern in model.FROZEN):
                p.requires_grad_(False)
        return model, None

    def build_data(self):
        t = self.recipe.training
        if t.micro_batch_size * self.layout.dp != t.global_batch_size:
            from megatron_s2.config.schema import ConfigError

            raise ConfigError(f"training.micro_batch_size: a contrastive step is one micro-batch per rank (the loss "
                              f"spans the batch); set it to global_batch_size / dp = "
                              f"{t.global_batch_size // self.layout.dp}")
        return build_pair_source(self.contrastive, seed=t.seed, global_batch_size=t.global_batch_size,
                                 dp_rank=self.dp_rank, dp_size=self.layout.dp, data=self.recipe.data)

    def describe_model(self) -> list[str]:
        count = lambda prefix: sum(p.numel() for n, p in self.model.named_parameters() if n.startswith(prefix))  # noqa: E731
        c = self.contrastive
        return [describe_param_groups(self.model, self.recipe.optimizer),
                f"device: {self.device}; contrastive (SigLIP): vision tower {count('vision.tower.'):,} parameters, "
                f"text tower {count('text.'):,}, shared embedding {c.embed_dim}, images capped at {c.max_image_size} "
                f"px, all-gathers {'overlapped' if c.overlap else 'blocking'} over dp={self.layout.dp}"]

    def flops_per_token(self) -> float:
        return 0.0  # no per-token FLOP model for the towers: the throughput line shows pairs/s only

    # ---- inputs ---------------------------------------------------------------------------------
    def prepare_images(self, images: list) -> list:
        return self.model.prepare_images(images, self.contrastive.max_image_size)

    def prepare_captions(self, captions: list[str]) -> list[torch.Tensor]:
        out = []
        for caption in captions:
            ids = self.tokenizer.encode(caption)[: self.contrastive.text_max_tokens]
            if not ids:
                raise DataError(f"caption {caption!r} has no tokens; every image needs a non-empty caption")
            out.append(torch.tensor(ids, dtype=torch.int64))
        return out

    # ---- step -----------------------------------------------------------------------------------
    def compute_gradients(self, pairs: list) -> float:
        images = self.prepare_images([image for image, _ in pairs])
        captions = self.prepare_captions([caption for _, caption in pairs])
        m = self.model
        loss = contrastive_forward_backward(lambda: m.encode_images(images), lambda: m.encode_texts(captions),
                                            m.log_temperature, m.logit_bias, self.groups.dp,
                                            overlap=self.contrastive.overlap)
        finalize_model_grads(self.params, self.groups, self.recipe.parallel.grad_bucket_mb, zero1=None)
        if self.groups.dp.active:  # the ranks' text blocks add up to the global loss
            dist.all_reduce(loss, group=self.groups.dp.pg)
        return float(loss)

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, self.step)
        pairs = self.data.next_step()
        fingerprint = hashlib.sha256("\n".join(caption for _, caption in pairs).encode()).hexdigest()
        loss = self.compute_gradients(pairs)
        grad_norm = self.apply_gradients(loss)
        extra = {"t": float(self.model.log_temperature.detach().exp()), "b": float(self.model.logit_bias.detach())}
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.recipe.training.global_batch_size,
                "step_time": time.perf_counter() - t0, "extra": extra, "fingerprint": fingerprint}

    def train(self):
        result = super().train()
        n = self.contrastive.eval_items
        if n and self.is_main:
            pairs = heldout_pairs(n, seed=self.recipe.training.seed, image_size=self.contrastive.image_size,
                                  data=self.recipe.data)
            top1, chance = retrieval_accuracy(self, pairs)
            self.log(f"zero-shot retrieval (image -> caption top-1, {n} held-out pairs): {top1:.3f} "
                     f"(chance {chance:.3f})")
            (self.run_dir / "retrieval.json").write_text(json.dumps({"top1": top1, "chance": chance, "items": n}))
        return result


@torch.no_grad()
def retrieval_accuracy(trainer: ContrastiveTrainer, pairs: list) -> tuple[float, float]:
    """(top-1, chance): each image ranks the distinct captions of ``pairs``; a hit is its own."""
    captions = sorted({caption for _, caption in pairs})
    images = trainer.model.encode_images(trainer.prepare_images([image for image, _ in pairs]))
    texts = trainer.model.encode_texts(trainer.prepare_captions(captions))
    best = (images @ texts.t()).argmax(dim=1).tolist()
    hits = sum(captions[b] == caption for b, (_, caption) in zip(best, pairs))
    return hits / len(pairs), 1.0 / len(captions)
