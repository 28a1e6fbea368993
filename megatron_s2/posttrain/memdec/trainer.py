"""The trainers of ``phase.kind: memdec`` and ``memdec_router`` (package docstring).

Both load the frozen backbone (``phase.memdec_backbone``) next to the model of ``model:`` — the
memory decoder. ``memdec`` builds or reads the datastore before the first step; ``memdec_router``
attaches a :class:`~megatron_s2.models.memory_decoder.MemoryRouter` to the memory decoder as
``memdec_router`` (its checkpoint then holds the whole plug-in: memory + router), freezes every
other tensor, and feeds the domain (``data:``) and general (``phase.memdec_general_data``)
corpora 1:1, each micro-batch flagged ``is_domain``.

Layouts: dp, tp (+ sequence parallelism), pp and ep, parity with one rank in
``tests/memory_decoder/test_layouts.py``. The memory decoder is a family model built by the family
code, so it takes the recipe's layout like any model (its stages, its tensor and expert shards). The
frozen backbone holds every layer on each rank with the recipe's tensor and expert groups (like an
OPD teacher, :func:`~megatron_s2.posttrain.frozen.load_frozen_model`): its routed experts are split
over ep — what makes a Qwen3.5-397B-A17B-shaped backbone fit a GPU (33 GiB per rank at tp=2, ep=32;
recipes/intern_s2/memdec_pretrain_397b_a17b.yaml) — and its MoE layers dispatch tokens over the ep
group like the training model's. Expert groups lie inside a pipeline stage (rank order
``etp-ep-edp-pp``), so every rank of a group calls the backbone together: all ranks for the
datastore, the last stage's ranks once per micro-batch for the objectives, which run there and read
the backbone whole (:mod:`.objectives`). The router is whole, outside any tensor-parallel plan, on
the last stage only (identical gradients over tp, summed over dp); the stages before it hold only
frozen tensors. Context and expert tensor parallelism are refused
(:func:`~megatron_s2.training.run_checks.check_memdec_layout`); a backbone whose experts or heads the
layout cannot split is refused naming ``parallel.ep`` / ``parallel.tp``
(:meth:`~megatron_s2.parallel.layout.ParallelLayout.check_frozen_model`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_s2.config.recipe import _resolve_model
from megatron_s2.config.schema import ConfigError
from megatron_s2.data import build_data_iterator
from megatron_s2.data.loader import load_document_stores
from megatron_s2.models.memory_decoder import MemoryRouter
from megatron_s2.parallel.sharding import name_seed
from megatron_s2.pipeline.losses import global_token_count
from megatron_s2.posttrain.frozen import load_frozen_model
from megatron_s2.posttrain.memdec.datastore import datastore_meta, layout_fingerprint, load_or_build_datastore
from megatron_s2.posttrain.memdec.forward import KeepsLastHidden
from megatron_s2.posttrain.memdec.fusion import ROUTER_PREFIX
from megatron_s2.posttrain.memdec.objectives import MemoryDecoderObjective, RouterObjective
from megatron_s2.training.trainer import Trainer

__all__ = ["MemoryDecoderTrainer", "RouterTrainer", "MixedCorpusIterator", "memdec_trainer", "ROUTER_PREFIX"]


class _MemdecTrainer(Trainer):
    """Start-up shared by both phases: layout checks and the frozen backbone."""

    def check_phase_inputs(self) -> None:
        phase = self.recipe.phase
        self.backbone = load_frozen_model(phase.memdec_backbone, self.groups, vocab_size=self.recipe.model.vocab_size,
                                          tokenizer=self.tokenizer, what="phase.memdec_backbone", device=self.device,
                                          layout=self.layout)
        self.log(f"memdec: frozen backbone '{self.backbone.config.name}' from {phase.memdec_backbone}")
        if phase.memdec_backbone_model:  # what `plan memory` counted must be what was loaded
            planned = _resolve_model(phase.memdec_backbone_model, Path.cwd()).get("name")
            if planned != self.backbone.config.name:
                raise ConfigError(f"phase.memdec_backbone_model: {phase.memdec_backbone_model} is '{planned}' but "
                                  f"{phase.memdec_backbone} holds '{self.backbone.config.name}'; name the "
                                  "backbone's model or leave the key empty")


class MemoryDecoderTrainer(_MemdecTrainer):
    """``phase.kind: memdec``: the memory decoder learns the datastore's kNN distributions (Eq. 2)."""

    def check_phase_inputs(self) -> None:
        super().check_phase_inputs()
        t, phase = self.recipe.training, self.recipe.phase
        seed = self.recipe.data.generation_seed(t.seed)
        stores = load_document_stores(self.recipe.data, seed=t.seed, tokenizer=self.tokenizer, log=self.log)
        meta = datastore_meta(layout_fingerprint(self.backbone), self.recipe.data, seed, t.seq_length)
        self.datastore = load_or_build_datastore(self.run_dir, self.backbone, stores, meta=meta,
                                                 seq_length=t.seq_length, pad_id=self.tokenizer.pad_id,
                                                 device=self.device, save=self.is_main, log=self.log)
        if phase.memdec_knn_k > len(self.datastore):
            raise ConfigError(f"phase.memdec_knn_k: {phase.memdec_knn_k} neighbours but the datastore holds "
                              f"{len(self.datastore)} keys; lower it or enlarge the domain corpus")

    def step_objective(self, micro_batches):
        phase = self.recipe.phase
        return MemoryDecoderObjective(self.backbone, self.datastore, k=phase.memdec_knn_k,
                                      temperature=phase.memdec_knn_temperature, beta=phase.memdec_beta,
                                      global_tokens=global_token_count(micro_batches, self.groups.dp_cp),
                                      num_micro_global=self.num_micro_global)


class MixedCorpusIterator:
    """Half of each step's micro-batches from the domain corpus, half from the general one,
    flagged ``is_domain`` (the sign of Eq. 4's prior); checkpointable like the data iterator."""

    def __init__(self, domain, general):
        self.domain, self.general = domain, general

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for flag, micro_batches in ((True, self.domain.next_step()), (False, self.general.next_step())):
            for mb in micro_batches:
                mb["is_domain"] = torch.full_like(mb["tokens"], flag, dtype=torch.bool)
                out.append(mb)
        return out

    def state_dict(self) -> dict:
        return {"domain": self.domain.state_dict(), "general": self.general.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.domain.load_state_dict(state["domain"])
        self.general.load_state_dict(state["general"])


class RouterTrainer(_MemdecTrainer):
    """``phase.kind: memdec_router``: both models frozen, the router learns lambda_t (Eq. 3-4)."""

    fresh_on_load = Trainer.fresh_on_load + (ROUTER_PREFIX,)

    def check_phase_inputs(self) -> None:
        super().check_phase_inputs()
        general = self.recipe.phase.memdec_general_data
        if general.tokenizer != self.recipe.data.tokenizer:
            raise ConfigError(f"phase.memdec_general_data.tokenizer: '{general.tokenizer}' differs from data.tokenizer "
                              f"'{self.recipe.data.tokenizer}'; both corpora must use the models' tokenizer")
        t = self.recipe.training
        if t.global_batch_size % (2 * self.layout.dp * t.micro_batch_size):
            raise ConfigError(f"training.global_batch_size: router training splits it 1:1 between the domain and "
                              f"general corpora, so it must be a multiple of 2 x dp x micro_batch_size = "
                              f"{2 * self.layout.dp * t.micro_batch_size}, got {t.global_batch_size}")

    def attach_phase_modules(self) -> None:
        """The router on the last pipeline stage, where the objective runs; initialised from its
        own seed, so every layout starts from the same router."""
        for p in self.model.parameters():  # the memory decoder is frozen with the backbone
            p.requires_grad_(False)
        if not getattr(self.model, "post_process", True):
            return
        phase = self.recipe.phase
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(self.recipe.training.seed, ROUTER_PREFIX))
            router = MemoryRouter(self.backbone.config.hidden_size, self.recipe.model.hidden_size,
                                  phase.memdec_router_init_lambda, phase.memdec_router_hidden)
        self.model.memdec_router = router.to(self.device)

    def optimizer_may_be_empty(self) -> bool:
        return self.layout.pp > 1  # the stages before the router's hold only the frozen memory

    def forward_model(self):
        return KeepsLastHidden(self.model)  # the objective reads the memory's last hidden state

    def build_data(self):
        t = self.recipe.training
        half = t.global_batch_size // 2

        def stream(cfg):
            return build_data_iterator(cfg, seq_length=t.seq_length, global_batch_size=half,
                                       micro_batch_size=t.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.layout.dp,
                                       seed=t.seed, phase=self.recipe.phase.kind, tokenizer=self.tokenizer, log=self.log)

        return MixedCorpusIterator(stream(self.recipe.data), stream(self.recipe.phase.memdec_general_data))

    def step_objective(self, micro_batches):
        return RouterObjective(self.backbone, alpha=self.recipe.phase.memdec_router_alpha,
                               global_tokens=global_token_count(micro_batches, self.groups.dp_cp),
                               num_micro_global=self.num_micro_global)


def memdec_trainer(kind: str) -> type[Trainer]:
    """The trainer class of a Memory Decoder phase kind."""
    return {"memdec": MemoryDecoderTrainer, "memdec_router": RouterTrainer}[kind]
