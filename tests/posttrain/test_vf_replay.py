"""A co-located verifiers episode whose connection to the in-process server drops is played again
with the same seed (at most ``MAX_REPLAYS`` times, counted and logged); after that its error stops
the run as before. The failure is real: a hook in front of the server's app answers the chosen
requests' headers and then breaks the connection (uvicorn closes it in the middle of the answer), so
verifiers' TrainClient sees the OpenAI SDK's "Connection error." exactly as a dropped connection
gives it; nothing of verifiers is replaced.

(A long run stopped at step 27 on such an error: issue 25's note; ``rollout_replayed`` counts them.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_s2.config.posttrain import AdvantageConfig, RolloutConfig
from megatron_s2.config.posttrain.environment import EnvironmentConfig
from megatron_s2.posttrain.advantages import AdvantagePipeline, GroupRollouts
from megatron_s2.posttrain.orchestrator import Orchestrator
from megatron_s2.posttrain.rollout import vf_backend
from megatron_s2.posttrain.rollout.episode_backend import MAX_REPLAYS
from megatron_s2.serve import app as serve_app
from tests.posttrain.rollout_steps import rollout_steps

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).parent / "vf_plugins"

pytestmark = pytest.mark.usefixtures("one_thread")


class DropConnections:
    """ASGI hook in front of the server's app: the first ``drops`` ``/inference/v1/generate``
    requests whose body satisfies ``which`` get their response headers and then a broken connection
    (the app raises after ``http.response.start``: uvicorn closes the socket mid-answer). Every
    generate body is recorded, dropped or not."""

    def __init__(self, app, drops: int, which=lambda body: True):
        self.app, self.drops, self.which = app, drops, which
        self.bodies: list[bytes] = []
        self.dropped: list[bytes] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/inference/v1/generate":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        if len(self.dropped) < self.drops and self.which(body):
            self.dropped.append(body)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]})
            raise ConnectionResetError("test hook: the connection drops in the middle of the answer")
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _rollout(monkeypatch, drop_first_episode_calls: int, steps: int = 1):
    """Rollout steps of the parity environment through the in-process server, the first model call
    of one episode (the first generate request, and the same request again when replayed) dropped
    ``drop_first_episode_calls`` times. Returns (steps, hook, backend stats, log lines)."""
    from megatron_s2.data.tokenizer import load_tokenizer
    from megatron_s2.inference import EngineConfig, InferenceEngine
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment
    from megatron_s2.posttrain.rollout.replicas import ReplicaTopology
    from tests.posttrain.tiny import tiny_config

    hooks: list[DropConnections] = []
    first: list[bytes] = []

    def same_as_first(body: bytes) -> bool:  # the first request seen, and its replays (same seed, same prompt)
        first.extend([] if first else [body])
        return body == first[0]

    build = serve_app.build_app

    def hooked(state):
        hooks.append(DropConnections(build(state), drop_first_episode_calls, same_as_first))
        return hooks[-1]

    monkeypatch.setattr(serve_app, "build_app", hooked)
    tok = load_tokenizer(ROOT / "recipes" / "tokenizers" / "tiny-bpe")
    model = build_model(dataclasses.replace(tiny_config(), vocab_size=512, engram_pad_id=2), seed=2)
    model.set_token_map(tok.compressed_token_map(num_ids=512))
    engine = InferenceEngine(model.eval(), EngineConfig(max_num_seqs=4, max_model_len=96, page_tokens=8),
                             eos_token_ids=[tok.eos_id])
    env = VerifiersEnvironment("default", EnvironmentConfig(kind="verifiers", taskset={"id": "megatron_s2_parity"},
                                                            plugin_path=str(PLUGINS)), tok)
    lines: list[str] = []
    backend = vf_backend.VerifiersBackend(engine, {"default": env}, tokenizer=tok, topology=ReplicaTopology.single(),
                                          layer_ids=model.layer_ids, record_routing=False, max_concurrent=4,
                                          log=lines.append)
    cfg = RolloutConfig(group_size=2, max_in_flight=4, batch_groups=2, max_new_tokens=3, max_staleness=-1)
    dapo = AdvantagePipeline(AdvantageConfig(dynamic_sampling=False))
    orch = Orchestrator(cfg, {"default": env}, backend, seed=3,
                        group_filter=lambda ss: dapo.informative(GroupRollouts.from_samples(ss)))
    try:
        out = rollout_steps(orch, backend, steps)
        stats = backend.take_stats()
    finally:
        backend.close()
    (hook,) = hooks
    return out, hook, stats, lines


def test_an_episode_whose_connection_drops_is_played_again_with_the_same_seed(monkeypatch):
    (step,), hook, stats, lines = _rollout(monkeypatch, drop_first_episode_calls=1)
    groups, metrics, returned = step
    assert len(hook.dropped) == 1 and stats.replayed == 1
    # the replay sent the very request that was dropped (same prompt ids, same seed) and it was answered
    assert hook.bodies.count(hook.dropped[0]) == 2
    assert json.loads(hook.dropped[0])["sampling_params"]["seed"] is not None
    assert len(returned) == 4 and sorted(s.sample_id for s in returned) == list(range(4))  # none lost or doubled
    assert sum(len(g.accepted) for g in groups) == 4
    assert len(lines) == 1 and "ProviderError: Connection error." in lines[0] and "replay 1 of 2" in lines[0]


def test_an_episode_that_keeps_failing_stops_the_run_with_its_error_after_the_bound(monkeypatch):
    failed = r"verifiers episode of sample \d+ .* failed: ProviderError: Connection error"
    with pytest.raises(RuntimeError, match=failed):
        _rollout(monkeypatch, drop_first_episode_calls=MAX_REPLAYS + 1)


def test_disaggregated_a_dropped_connection_on_a_healthy_server_is_played_again(monkeypatch):
    """The orchestrator of a disaggregated run plays verifiers episodes against the inference
    servers (:mod:`megatron_s2.posttrain.disaggregated.served_verifiers`): an episode whose
    connection dropped while its server stayed healthy is played again on it with the same seed
    (counted ``replayed``, not ``rerouted``: the server is not marked down)."""
    from megatron_s2.data.tokenizer import load_tokenizer
    from megatron_s2.inference import EngineConfig, InferenceEngine
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.posttrain.disaggregated.served_backend import ServedRolloutBackend
    from megatron_s2.posttrain.disaggregated.served_verifiers import ServedVerifiers
    from megatron_s2.posttrain.envs.vf_env import VerifiersEnvironment
    from megatron_s2.serve import ServeConfig, ServerThread
    from megatron_s2.serve.backend import AsyncEngine
    from megatron_s2.serve.state import ServerState
    from tests.posttrain.tiny import tiny_config

    hooks: list[DropConnections] = []
    build = serve_app.build_app
    monkeypatch.setattr(serve_app, "build_app",
                        lambda state: hooks.append(DropConnections(build(state), 1)) or hooks[-1])
    tok = load_tokenizer(ROOT / "recipes" / "tokenizers" / "tiny-bpe")
    model = build_model(dataclasses.replace(tiny_config(), vocab_size=512, engram_pad_id=2), seed=2)
    model.set_token_map(tok.compressed_token_map(num_ids=512))
    engine = InferenceEngine(model.eval(), EngineConfig(max_num_seqs=4, max_model_len=96, page_tokens=8),
                             eos_token_ids=[tok.eos_id])
    serve = ServeConfig(disconnect_poll_s=0.05, logprobs_mode="processed_logprobs")
    state = ServerState(AsyncEngine(engine), tok, serve, "policy", "the tiny model")
    server = ServerThread(state, keep_alive_s=60.0).start()
    env = VerifiersEnvironment("default", EnvironmentConfig(kind="verifiers", taskset={"id": "megatron_s2_parity"},
                                                            plugin_path=str(PLUGINS)), tok)
    lines: list[str] = []
    verifiers = ServedVerifiers({"default": env}, tok)
    backend = ServedRolloutBackend([server.url], {"default": env}, weights_path=str, record_routing=False,
                                   max_model_len=96, max_concurrent=2, request_timeout_s=60, server_wait_s=30,
                                   ordered=True, log=lines.append, verifiers=verifiers)
    try:
        sample = backend.play_verifiers("default", 0, "train", sample_id=3, temperature=1.0, top_p=1.0, max_tokens=3,
                                        seed=77, where="rollout: verifiers episode of sample 3")
        stats = backend.take_stats()
    finally:
        backend.close()
        verifiers.close()
        server.stop()
    (hook,) = hooks
    # the same request again, answered the second time
    assert len(hook.dropped) == 1 and hook.bodies.count(hook.dropped[0]) == 2
    assert (stats.replayed, stats.rerouted) == (1, 0) and sample.num_generated > 0
    assert [line for line in lines if "replay 1 of 2" in line and "Connection error." in line], lines
