"""The inference engines a post-training rank builds (report §5.2.1): the rollout engine and the
held-out evaluation engine (none for verifiers environments), both over the rollout model (the
training model when shared).

:func:`engine_configs` is the one place their :class:`~megatron_s2.inference.EngineConfig` is
derived from the recipe, so the trainer and ``megatron-s2 plan memory``
(:mod:`megatron_s2.planning.posttrain`) size the same KV page pools and SWA rings. Each engine
owns its own per-request state (the model family's executor: for V4.1 its KV page pools and SWA
rings), allocated when it is built.
"""

from __future__ import annotations

from megatron_s2.config.engine import EngineConfig

__all__ = ["engine_max_model_len", "engine_configs"]


def engine_max_model_len(recipe, rollout) -> int:
    """Prompt + generated tokens of one request: ``rollout.engine.max_model_len``, or one training
    row plus the next-token target (``training.seq_length + 1``)."""
    return rollout.engine.max_model_len or recipe.training.seq_length + 1


def engine_configs(recipe, rollout) -> dict[str, EngineConfig]:
    """``{"rollout": ..., "eval": ...}``: the engine configurations of a post-training rank for the
    ``rollout`` section (:class:`~megatron_s2.config.posttrain.rollout` of ``rl`` / ``opd``); no
    ``eval`` engine with verifiers or agentic environments (their held-out tasks are played through the
    rollout engine's server, :class:`~megatron_s2.posttrain.rollout.evaluation.VerifiersEvaluator`)."""
    engine = rollout.engine
    common = dict(max_model_len=engine_max_model_len(recipe, rollout), prefill_chunk=engine.prefill_chunk,
                  max_prefill_tokens=max(engine.prefill_chunk, 1024), page_tokens=engine.page_tokens,
                  prefix_caching=False, seed=recipe.training.seed, max_num_seqs=engine.max_num_seqs,
                  decoder_bounded_replay=engine.decoder_bounded_replay)
    configs = {"rollout": EngineConfig(max_waiting=max(4 * rollout.max_in_flight, 256),
                                       speculative=engine.speculative, **common)}
    if not rollout.served:  # verifiers / agentic environments evaluate through the rollout engine's server
        configs["eval"] = EngineConfig(max_waiting=100_000, **common)
    return configs
