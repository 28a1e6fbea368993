"""How far the trainer's log-probabilities are from the engine's when rollouts use Decoder SWA
Bounded Replay (report §3.2.2), with and without the train-aware simulation.

With ``rl.rollout.engine.decoder_bounded_replay`` the engine answers a prompt longer than the
SWA window from a decoder that attends only to the last ``window`` prompt tokens (the prefill is
replayed, not the exact state), so the behaviour policy is not exactly the model the trainer
differentiates. ``train_aware_replay`` makes the training forward simulate the same truncation
(the decoder's SWA starts at each sample's ``replay_start``). :func:`measure_replay_mismatch`
samples rollouts through the real :class:`~.engine_backend.EngineRolloutBackend` and reports, over
the sampled tokens, the absolute log-probability difference between the engine and the
training forward both ways (R3 routing replay in both, so only the attention differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_s2.inference import EngineConfig, InferenceEngine
from megatron_s2.parallel.groups import Group
from megatron_s2.posttrain.envs.base import Environment
from megatron_s2.posttrain.orchestrator import RolloutSample, SampleRequest
from megatron_s2.posttrain.rollout.engine_backend import EngineRolloutBackend
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
from megatron_s2.posttrain.vocab_parallel import token_log_probs

__all__ = ["ReplayMismatch", "sample_with_decoder_replay", "trainer_logprobs", "measure_replay_mismatch"]


@dataclass(frozen=True)
class ReplayMismatch:
    samples: int
    """Rollouts whose prompt exceeded the window (the only ones the replay changes)."""
    tokens: int
    """Sampled tokens compared."""
    with_mean: float
    """Mean |engine - trainer| log-probability per token, train-aware simulation on."""
    with_max: float
    without_mean: float
    """The same with the trainer's exact forward (train_aware_replay off)."""
    without_max: float


def sample_with_decoder_replay(model, environment: Environment, dataset: str, count: int, *, max_new_tokens: int,
                               max_model_len: int, eos_ids: Sequence[int], seed: int = 0) -> list[RolloutSample]:
    """``count`` single-turn rollouts of ``environment``'s training prompts, sampled at
    temperature 1 by an engine with Decoder SWA Bounded Replay, with their routing recorded."""
    engine = InferenceEngine(model.eval(), EngineConfig(max_num_seqs=max(1, min(count, 16)),
                                                       max_model_len=max_model_len, page_tokens=8,
                                                       decoder_bounded_replay=True), eos_token_ids=list(eos_ids))
    backend = EngineRolloutBackend(engine, {dataset: environment}, topology=ReplicaTopology.single(),
                            layer_ids=model.layer_ids, record_routing=True, max_model_len=max_model_len)
    backend.submit([SampleRequest(sample_id=i, group_id=i, prompt_uid=f"{dataset}:0:{i}", dataset=dataset, index=i,
                                  prompt_tokens=(), seed=seed + i, max_new_tokens=max_new_tokens, temperature=1.0)
                    for i in range(count)])
    done: list[RolloutSample] = []
    for _ in range(100 * (max_new_tokens + 2)):
        done += backend.poll()
        if not backend.sessions:
            return sorted(done, key=lambda s: s.sample_id)
    raise RuntimeError("sample_with_decoder_replay: rollouts did not finish")


def trainer_logprobs(model, sample: RolloutSample, *, train_aware: bool) -> torch.Tensor:
    """The training forward's log-probability of every next token of ``sample`` (R3 replay of
    its recorded routing; the decoder's SWA truncated at ``replay_start`` when ``train_aware``)."""
    ids = torch.tensor(sample.tokens)
    x, labels = ids[:-1].unsqueeze(0), ids[1:].unsqueeze(0)
    ctx = model.make_context({"tokens": x}, routing=sample.routing.to_replay())
    if train_aware:
        ctx.swa_from = torch.tensor([sample.replay_start])
    with torch.no_grad():
        logits = model.eval()(x, ctx)
    return token_log_probs(logits, labels, Group.single())[0]


def measure_replay_mismatch(model, environment: Environment, dataset: str, count: int, *, max_new_tokens: int,
                            max_model_len: int, eos_ids: Sequence[int], seed: int = 0) -> ReplayMismatch:
    """Engine vs trainer log-probabilities on the sampled tokens, with and without the
    train-aware simulation (module docstring)."""
    samples = [s for s in sample_with_decoder_replay(model, environment, dataset, count, max_new_tokens=max_new_tokens,
                                                     max_model_len=max_model_len, eos_ids=eos_ids, seed=seed)
               if s.replay_start > 0]
    if not samples:
        raise ValueError("measure_replay_mismatch: no prompt was longer than the SWA window; the replay changes "
                         "nothing (use longer prompts)")
    diffs = {True: [], False: []}
    for s in samples:
        mask = torch.tensor(s.policy_mask[1:])
        behaviour = torch.tensor(s.logprobs[1:], dtype=torch.float32)
        for aware in (True, False):
            diffs[aware].append((trainer_logprobs(model, s, train_aware=aware).float() - behaviour)[mask].abs())
    on, off = torch.cat(diffs[True]), torch.cat(diffs[False])
    return ReplayMismatch(len(samples), int(on.numel()), float(on.mean()), float(on.max()), float(off.mean()),
                          float(off.max()))
