"""The trainer of ``phase.kind: visual_next_patch`` (Intern-S2 walkthrough Ch. 3, Eq. 5–9).

Continued pre-training on text and rendered pages in the same step: the recipe's text data as in
pre-training, each micro-batch joined by the visual rows of a few rendered documents
(:mod:`megatron_s2.data.pages`), and the step's objective Eq. (9), ``lambda_text L_text +
lambda_vis L_VP`` (:mod:`.next_patch_objective`). The visual pieces — the frozen encoder, the
projection ``W_in`` and the prediction head ``psi`` (:mod:`megatron_s2.models.next_patch`) —
live beside the family model as its ``next_patch`` submodule, so they are optimised (``W_in``,
``psi``) and checkpointed with it; the encoder holds no optimiser state.

Layouts: data parallelism. The visual forward runs inside the last stage's loss function over
whole sequences, so pipeline, context, tensor and expert parallelism are refused at start-up
(:func:`~megatron_s2.training.run_checks.check_phase_layout`).
"""

from __future__ import annotations

from megatron_s2.config.schema import ConfigError
from megatron_s2.models.next_patch import NextPatchPredictor
from megatron_s2.training.trainer import Trainer

__all__ = ["VisualNextPatchTrainer"]


class VisualNextPatchTrainer(Trainer):
    fresh_on_load = Trainer.fresh_on_load + ("next_patch.",)  # W_in / psi start fresh on a text checkpoint

    def build_model(self, host):
        """The family model, given the visual pieces as its ``next_patch`` submodule before the
        optimiser is built (they train and checkpoint with it)."""
        model, pipeline = super().build_model(host)
        cfg = self.recipe.phase.next_patch
        if not (hasattr(model, "embed_vectors") and hasattr(model, "final_hidden")):
            raise ConfigError(f"phase.kind: visual_next_patch: model family '{self.recipe.model.family}' cannot take "
                              "visual latents in place of token embeddings (no embed_vectors / final_hidden); use "
                              "an Intern-S2 model (e.g. model: intern_s2_tiny)")
        model.next_patch = NextPatchPredictor(patch=cfg.patch_size, channels=3, latent_dim=cfg.latent_dim,
                                              hidden_size=self.recipe.model.hidden_size)
        model.next_patch.init_weights(self.recipe.training.seed)
        return model, pipeline

    def build_data(self):
        from megatron_s2.data.pages import PageDocuments, TextWithPages

        t = self.recipe.training
        pages = PageDocuments(self.recipe.phase.next_patch, seed=t.seed, dp_rank=self.dp_rank, dp_size=self.layout.dp,
                              micro_batches_per_rank=t.global_batch_size // (self.layout.dp * t.micro_batch_size))
        return TextWithPages(super().build_data(), pages)

    def step_objective(self, micro_batches: list[dict]):
        from megatron_s2.pipeline.losses import global_token_count
        from megatron_s2.training.next_patch_objective import VisualNextPatchObjective

        cfg = self.recipe.phase.next_patch
        return VisualNextPatchObjective(global_token_count(micro_batches, self.groups.dp_cp), self.num_micro_global,
                                        lambda_text=cfg.lambda_text, lambda_vis=cfg.lambda_vis,
                                        temperature=cfg.temperature, paper=1.0, threshold=cfg.foreground_threshold)
