"""The inference engine as the rollout backend, with the real tiny model (no simulated engine):

* partial rollout across a weight update: a sample paused mid-generation, the weights swapped,
  resumed — its tokens carry both versions, and its concatenated routing record (R3) is exactly
  what a training forward under each segment's weights selects, and replaying it makes the
  training forward reproduce the behaviour log-probabilities of the newest segment;
* crash-safe partial state: a snapshot of paused samples continued by a fresh engine (re-prefill)
  keeps its prefix (tokens, log-probs, versions, routing) and completes;
* multi-turn sessions: environment tokens are loss-masked, the turns form one sample whose
  routing covers every fed position;
* train-aware Decoder SWA Bounded Replay (report §3.2.2): with the engine's decoder replay the
  training forward reproduces the sampled log-probabilities only when it truncates the decoder
  windows at the replay start;
* the unfiltered rollout metrics of single- and multi-turn task environments cover every episode
  the engine completed, the groups dynamic sampling dropped included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_s2.data.tokenizer import CharTokenizer
from megatron_s2.inference import EngineConfig, InferenceEngine
from megatron_s2.models.v41.context import ForwardContext
from megatron_s2.models.v41.model import build_model
from megatron_s2.models.family.routing_replay import RoutingMode, RoutingReplay
from megatron_s2.config.posttrain import AdvantageConfig, RolloutConfig
from megatron_s2.config.posttrain.environment import EnvironmentConfig
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.posttrain.envs import Environment, Episode, EpisodeStep, RetryTaskEnvironment, TaskEnvironment
from megatron_s2.posttrain.orchestrator import Orchestrator, SampleRequest
from megatron_s2.posttrain.rollout.engine_backend import EngineRolloutBackend
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
from megatron_s2.posttrain.vocab_parallel import token_log_probs
from megatron_s2.parallel.groups import Group
from tests.posttrain.rollout_steps import check_unfiltered_metrics, rollout_steps
from tests.posttrain.tiny import tiny_config

TOK = CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


def make_backend(model, envs, *, decoder_replay=False, max_model_len=40):
    engine = InferenceEngine(model.eval(), EngineConfig(max_num_seqs=8, max_model_len=max_model_len, page_tokens=8,
                                                       decoder_bounded_replay=decoder_replay),
                             eos_token_ids=[TOK.eos_id])
    return EngineRolloutBackend(engine, envs, topology=ReplicaTopology.single(), layer_ids=model.layer_ids,
                         record_routing=True, max_model_len=max_model_len)


def request(sid, index, max_new=10, dataset="add", resume_from=None):
    return SampleRequest(sample_id=sid, group_id=sid, prompt_uid=f"{dataset}:0:{index}", dataset=dataset,
                         index=index, prompt_tokens=(), seed=100 + sid, max_new_tokens=max_new, temperature=1.0,
                         resume_from=resume_from)


def task_env(**kw):
    cfg = EnvironmentConfig(kind="task", task="addition", num_prompts=16, eval_prompts=4, **kw)
    return TaskEnvironment("add", cfg, TOK)


def forward_logprobs(model, sample, routing_mode=RoutingMode.REPLAY, swa_from=None):
    ids = torch.tensor(sample.tokens)
    x, labels = ids[:-1].unsqueeze(0), ids[1:].unsqueeze(0)
    replay = sample.routing.to_replay() if routing_mode is RoutingMode.REPLAY else RoutingReplay(routing_mode)
    ctx = ForwardContext.create(x, model.plan, routing=replay)
    if swa_from is not None:
        ctx.swa_from = torch.tensor([swa_from])
    with torch.no_grad():
        logits = model.eval()(x, ctx)
    return token_log_probs(logits, labels, Group.single())[0], replay


def drain(backend, limit=200):
    done = []
    for _ in range(limit):
        done += backend.poll()
        if not backend.sessions:
            return done
    raise AssertionError("rollouts did not finish")


def test_partial_rollout_across_versions_replays_bit_for_bit():
    model = build_model(tiny_config(), seed=3)
    new_weights = build_model(tiny_config(), seed=4).state_dict()
    backend = make_backend(model, {"add": task_env()})
    backend.submit([request(0, 0, max_new=12), request(1, 1, max_new=12)])
    for _ in range(4):  # prefill + a few decode steps under version 0
        assert backend.poll() == []
    backend.pause()
    partial = backend.snapshot()
    assert all(p.num_generated > 0 for p in partial)
    with torch.no_grad():
        model.load_state_dict(new_weights)  # the learner's update, in place (shared weights)
    backend.update_weights(1)
    backend.resume()
    samples = [s for s in drain(backend) if s.num_generated > len(partial[0].policy_versions)]
    assert samples, "no sample continued after the update"
    v0, v1 = build_model(tiny_config(), seed=3), build_model(tiny_config(), seed=4)
    recomputed_differs = False
    for s in samples:
        assert set(s.policy_versions) == {0, 1}
        routed_by = s.routing.versions
        assert set(routed_by.tolist()) == {0, 1} and len(s.routing) == len(s.tokens) - 1
        # Before the swap the record is what version 0 selects ...
        _, rec = forward_logprobs(v0, s, RoutingMode.RECORD)
        for layer, ids in s.routing.layers.items():
            assert torch.equal(rec.records()[layer][0][0][routed_by == 0], ids[routed_by == 0]), layer
        # ... after it, the engine decoded with the KV cached under version 0, which a recomputation
        # under version 1 does not see: only the concatenated record gives the sampled sub-network.
        _, rec = forward_logprobs(v1, s, RoutingMode.RECORD)
        recomputed_differs |= any(not torch.equal(rec.records()[layer][0][0], ids)
                                  for layer, ids in s.routing.layers.items())
        chosen = {}
        def keep(layer):
            def hook(module, args, out):
                chosen[layer] = out.indices
            return hook

        hooks = [router.register_forward_hook(keep(i)) for i, router in zip(v1.layer_ids, v1.routers())]
        lp, _ = forward_logprobs(v1, s)  # the training forward replays the record
        for h in hooks:
            h.remove()
        for layer, ids in s.routing.layers.items():  # bit for bit, every layer and position
            assert torch.equal(chosen[layer].to(torch.int32), ids), layer
        lp0, _ = forward_logprobs(v0, s)
        first = torch.tensor(s.versions[1:]) == 0
        assert (lp0 - torch.tensor(s.logprobs[1:]))[first].abs().max() <= 1e-5
    assert recomputed_differs


def test_snapshot_resumes_from_its_prefix_on_a_fresh_engine():
    model = build_model(tiny_config(), seed=5)
    envs = {"add": task_env()}
    first = make_backend(model, envs)
    first.submit([request(7, 2, max_new=12)])
    for _ in range(4):
        first.poll()
    first.pause()
    (partial,) = first.snapshot()
    assert 0 < partial.num_generated < 12 and partial.spans[-1][1] == len(partial.tokens)
    second = make_backend(model, envs)  # "after a restart": nothing cached
    second.submit([request(7, 2, max_new=12, resume_from=partial)])
    (done,) = drain(second)
    n = len(partial.tokens)
    assert done.tokens[:n] == partial.tokens and done.logprobs[:n] == partial.logprobs
    assert done.versions[:n] == partial.versions and done.num_generated <= 12
    fed = len(partial.routing)
    for layer in done.routing.layers:
        assert torch.equal(done.routing.layers[layer][:fed], partial.routing.layers[layer])
    lp, _ = forward_logprobs(model, done)
    mask = torch.tensor(done.policy_mask[1:])
    assert (lp - torch.tensor(done.logprobs[1:]))[mask].abs().max() <= 1e-5


def test_a_restarted_backend_continues_paused_samples_bit_for_bit_from_their_saved_caches():
    """Crash-safe partial rollout (report §5.2.3): samples paused mid-generation, the weights
    swapped (version 1) and the state saved — the snapshot (tokens) and the engine's caches — are
    continued by a fresh backend exactly as the running one continues them, whatever order they
    are submitted in. From the tokens alone they would be re-prefilled under version 1, whose KV
    differs from the version-0 KV the running engine decodes with."""
    model = build_model(tiny_config(), seed=3)
    new_weights = build_model(tiny_config(), seed=4).state_dict()
    envs = {"add": task_env()}
    running = make_backend(model, envs)
    running.submit([request(sid, sid, max_new=12) for sid in range(3)])
    for _ in range(4):  # prefill + a few decode steps under version 0
        assert running.poll() == []
    running.pause()
    with torch.no_grad():
        model.load_state_dict(new_weights)  # the learner's update, in place
    running.update_weights(1)
    partial, caches = running.snapshot(), running.cache_states()
    assert len(partial) == 3 and all(p.num_generated > 0 for p in partial)
    running.resume()
    reference = sorted(drain(running), key=lambda s: s.sample_id)

    def restart(saved):
        backend = make_backend(model, envs)  # "after a restart": nothing cached
        backend.update_weights(1)
        if saved is not None:
            backend.load_cache_states(saved)
        backend.submit([request(p.sample_id, p.sample_id, max_new=12, resume_from=p) for p in reversed(partial)])
        assert backend.restored == ({"exact": 3, "prefilled": 0} if saved else {"exact": 0, "prefilled": 3})
        return sorted(drain(backend), key=lambda s: s.sample_id)

    assert [s.state_dict() for s in restart(caches)] == [s.state_dict() for s in reference]
    prefilled = restart(None)
    assert [s.logprobs for s in prefilled] != [s.logprobs for s in reference]


def test_behaviour_log_probs_are_those_of_the_sampling_distribution():
    """The loss needs the log-prob of each token under the distribution it was drawn from
    (temperature applied): the rollout pins ``logprobs_mode="processed_logprobs"``, whatever the
    engine's or a server's default (vLLM's, and ``megatron-s2 serve``'s, is the raw distribution)."""
    model = build_model(tiny_config(), seed=5)
    backend = make_backend(model, {"add": task_env()})
    backend.submit([dataclasses.replace(request(4, 1, max_new=8), temperature=0.6)])
    (s,) = drain(backend)
    ids = torch.tensor(s.tokens)
    with torch.no_grad():
        ctx = ForwardContext.create(ids[:-1].unsqueeze(0), model.plan, routing=s.routing.to_replay())
        logits = model.eval()(ids[:-1].unsqueeze(0), ctx)[0].double()
    sampled = torch.log_softmax(logits / 0.6, -1).gather(1, ids[1:, None])[:, 0]
    raw = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    mask = torch.tensor(s.policy_mask[1:])
    behaviour = torch.tensor(s.logprobs[1:], dtype=torch.float64)
    assert (behaviour - sampled)[mask].abs().max() <= 1e-4
    assert (behaviour - raw)[mask].abs().max() > 1e-2  # the raw distribution is another number


class _EchoEpisode(Episode):
    """A deterministic three-turn environment: replies '?' + sep after each of the first two calls."""

    def __init__(self, prompt):
        self.prompt, self.turn = prompt, 0

    def prompt_tokens(self):
        return list(self.prompt)

    def step(self, completion, finish_reason):
        self.turn += 1
        if self.turn == 3:
            return EpisodeStep(done=True, delta=[], reward=1.0, correct=True)
        return EpisodeStep(done=False, delta=[*TOK.encode("?"), TOK.sep_id])


class _EchoEnv(Environment):
    name, max_turns = "echo", 3

    def size(self, split):
        return 4

    def episode(self, index, split="train", effort=None):
        return _EchoEpisode([TOK.bos_id, *TOK.encode(f"q{index}"), TOK.sep_id])

    def reference_answer(self, index, split):
        return [TOK.eos_id]


def test_multi_turn_session_is_one_sample_with_masked_environment_tokens():
    model = build_model(tiny_config(), seed=6)
    backend = make_backend(model, {"echo": _EchoEnv()}, max_model_len=48)
    backend.submit([request(3, 1, max_new=4, dataset="echo")])
    (s,) = drain(backend)
    assert len(s.spans) == 3 and s.reward == 1.0
    env_tokens = [TOK.encode("?")[0], TOK.sep_id]
    for (a, b), (c, _) in zip(s.spans, s.spans[1:]):  # between turns: exactly the environment's tokens
        assert s.tokens[b:c] == env_tokens and not any(s.policy_mask[b:c])
    assert sum(s.policy_mask) == sum(b - a for a, b in s.spans)
    assert len(s.routing) == len(s.tokens) - 1
    lp, _ = forward_logprobs(model, s)  # token-in/token-out: the trainer sees exactly what was sampled
    mask = torch.tensor(s.policy_mask[1:])
    assert (lp - torch.tensor(s.logprobs[1:]))[mask].abs().max() <= 1e-5


def test_train_aware_bounded_replay_matches_the_engine():
    """Engine with Decoder SWA Bounded Replay vs the training forward: equal with the train-aware
    simulation, measurably different without it (the with/without report of issue 14)."""
    model = build_model(tiny_config(), seed=8)
    from megatron_s2.config.data import TaskDifficulty
    from megatron_s2.posttrain.rollout.replay_mismatch import measure_replay_mismatch
    env = task_env(difficulty=TaskDifficulty(addition_max_digits=6))  # prompts longer than the window (8)
    report = measure_replay_mismatch(model, env, "add", 4, max_new_tokens=8, max_model_len=40, eos_ids=[TOK.eos_id])
    assert report.samples > 0 and report.tokens > 0
    assert report.with_max <= 1e-5
    assert report.without_max > 1e-3, "decoder replay changed nothing: the test prompts do not exercise it"


def _first_token_even(completion) -> bool:
    return bool(completion) and completion[0] % 2 == 0


class _EvenTask(TaskEnvironment):
    """Correct when the first generated token id is even: a random model's groups are sometimes
    uniform (dynamic sampling drops them), sometimes mixed; the reward is recomputable from tokens."""

    class episode_type(TaskEnvironment.episode_type):
        def verify(self, completion, finish_reason) -> bool:
            return _first_token_even(completion)


class _EvenRetryTask(RetryTaskEnvironment):
    """Multi-turn: a wrong first answer gets the feedback and a second attempt (reward 1 / turn)."""

    class episode_type(RetryTaskEnvironment.episode_type):
        def verify(self, completion, finish_reason) -> bool:
            return _first_token_even(completion)


def _single_turn_reward(s) -> float:
    return float(_first_token_even(s.tokens[s.prompt_length:]))


def _retry_reward(s) -> float:
    """1 / turn of the answer that verified (the session ends there), else 0."""
    start = s.spans[-1][0]
    return 1.0 / len(s.spans) if _first_token_even(s.tokens[start:]) else 0.0


@pytest.mark.parametrize("kind", ["task", "task_retry"])
def test_unfiltered_rollout_metrics_count_every_episode_of_task_environments(kind):
    """rollout_* over every episode the engine completed, the groups DAPO dropped included;
    trained_* over the trained groups (issue 26: the trained mean of a binary reward under
    dynamic sampling says nothing about the policy)."""
    env_cls, reward_of, turns = (_EvenTask, _single_turn_reward, 1) if kind == "task" else \
        (_EvenRetryTask, _retry_reward, 2)
    env = env_cls("add", EnvironmentConfig(kind=kind, task="addition", num_prompts=32, eval_prompts=0,
                                           max_turns=turns), TOK)
    model = build_model(tiny_config(), seed=9).eval()
    # every odd id ends a reply, so that a wrong first answer often ends with 'stop' and is retried
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=8, max_model_len=40, page_tokens=8),
                             eos_token_ids=[i for i in range(1, tiny_config().vocab_size, 2)])
    backend = EngineRolloutBackend(engine, {"add": env}, topology=ReplicaTopology.single(), layer_ids=model.layer_ids,
                                   record_routing=True, max_model_len=40)
    cfg = RolloutConfig(group_size=2, max_in_flight=8, batch_groups=2, max_new_tokens=3, max_staleness=-1)
    dapo = AdvantagePipeline(AdvantageConfig(dynamic_sampling=True))
    orch = Orchestrator(cfg, {"add": env}, backend, seed=3,
                        group_filter=lambda ss: dapo.informative(GroupRollouts.from_samples(ss)))
    steps = rollout_steps(orch, backend, 3)
    check_unfiltered_metrics(orch, steps, reward_of)
    if kind == "task_retry":  # second attempts happened, and their 1/2 rewards are in the means
        assert any(reward_of(s) == 0.5 for _, _, returned in steps for s in returned)
