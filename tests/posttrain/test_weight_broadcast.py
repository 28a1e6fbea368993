"""``rl.disaggregated.weight_sync: broadcast`` (issue 25, seed 004): the trainer's first rank sends
each policy version to the inference servers over a process group formed for the update
(``megatron_s2/inference/weight_broadcast.py``, ``posttrain/disaggregated/weight_sync.py``, the
``broadcast`` form of ``POST /update_weights``).

Two real servers in process (gloo, CPU): after a broadcast every tensor of each server's model
equals the trainer's bit for bit and the servers serve the new version; a server killed before
an update misses it (the others get it) and, restarted on its port from the initial weights, gets
the next one whole; a manifest that does not fit the server's model is a 400 naming the tensor,
before the server joins any group.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from megatron_s2.cli import main
from megatron_s2.config.engine import EngineConfig
from megatron_s2.config.posttrain.disaggregated import DisaggregatedConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.disaggregated.exchange import write_servers
from megatron_s2.posttrain.disaggregated.weight_sync import BroadcastWeightSync
from megatron_s2.serve import ServeConfig, ServerThread, build_state

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "tiny_pretrain.yaml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("broadcast") / "run"
    assert main(["train", str(RECIPE), "training.train_steps=1", "training.seq_length=32",
                 "training.global_batch_size=2", "training.micro_batch_size=2", "data.num_documents=50",
                 "checkpoint.save_interval=1", "logging.progress_bar=false", "logging.tensorboard=false",
                 "--run-dir", str(run)]) == 0
    return run


def _load(run_dir: Path):
    from megatron_s2.inference.weights import load_model

    return load_model(str(run_dir), "cpu")


def _server(run_dir: Path, port: int = 0) -> ServerThread:
    model, tokenizer, description = _load(run_dir)
    state = build_state(model, tokenizer, description, ServeConfig(disconnect_poll_s=0.05),
                        EngineConfig(max_num_seqs=4, max_model_len=64, seed=0), model_name="policy")
    return ServerThread(state, port=port).start()


def _served(server: ServerThread) -> dict[str, torch.Tensor]:
    return server.state.backend.engine.model.state_dict()


def _assert_same(server: ServerThread, trainer: torch.nn.Module, version: int) -> None:
    ours, theirs = trainer.state_dict(), _served(server)
    assert sorted(ours) == sorted(theirs)
    differ = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    assert httpx.get(f"{server.url}/stats").json()["policy_version"] == version


@torch.no_grad()
def _step(model: torch.nn.Module) -> None:
    """An 'optimiser step': every parameter moves."""
    for p in model.parameters():
        p.add_(1e-3 * torch.randn_like(p))


def test_broadcast_equals_the_trainer_bit_for_bit_and_a_restarted_server_rejoins(run_dir, tmp_path):
    trainer = _load(run_dir)[0]
    servers = [_server(run_dir), _server(run_dir)]
    exchange = tmp_path / "run"
    write_servers(exchange, [s.url for s in servers])
    logs: list[str] = []
    sync = BroadcastWeightSync(trainer, exchange, DisaggregatedConfig(weight_sync="broadcast", request_timeout_s=60),
                               log=logs.append)
    try:
        _step(trainer)
        metrics = sync.push(1)
        assert metrics["weight_sync_servers"] == 2 and metrics["weight_sync_failed"] == 0, (metrics, logs)
        param_bytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
        assert metrics["weight_sync_bytes"] == param_bytes
        for s in servers:
            _assert_same(s, trainer, 1)

        # server 0 killed: the update reaches the live one, the run goes on
        port = servers[0].port
        servers[0].stop()
        _step(trainer)
        metrics = sync.push(2)
        assert metrics["weight_sync_servers"] == 1 and metrics["weight_sync_failed"] == 0, (metrics, logs)
        _assert_same(servers[1], trainer, 2)

        # restarted on its port from the initial weights (version 0): a member of the next update
        servers[0] = _server(run_dir, port)
        assert httpx.get(f"{servers[0].url}/stats").json()["policy_version"] == 0
        _step(trainer)
        metrics = sync.push(3)
        assert metrics["weight_sync_servers"] == 2 and metrics["weight_sync_failed"] == 0, (metrics, logs)
        for s in servers:
            _assert_same(s, trainer, 3)
    finally:
        sync.close()
        for s in servers:
            s.stop()


def test_a_manifest_that_does_not_fit_is_a_400_before_joining(run_dir):
    server = _server(run_dir)
    try:
        name, t = next(iter(_served(server).items()))
        group = {"host": "127.0.0.1", "port": 1, "prefix": "v1", "rank": 1, "world_size": 2}
        own = [[n, list(v.shape), str(v.dtype).replace("torch.", "")] for n, v in _served(server).items()]
        bad = [[name, [7, 7], "float32"], *own[1:]]
        r = httpx.post(f"{server.url}/update_weights", json={"version": 1, "broadcast": {"group": group, "tensors": bad}})
        assert r.status_code == 400 and "broadcast.tensors" in r.text and name in r.text, r.text
        r = httpx.post(f"{server.url}/update_weights", json={"version": 1, "broadcast": {"group": group,
                                                                                      "tensors": own[1:]}})
        assert r.status_code == 400 and "lacks" in r.text, r.text
        r = httpx.post(f"{server.url}/update_weights",
                       json={"version": 1, "broadcast": {"group": {**group, "rank": 0}, "tensors": own}})
        assert r.status_code == 400 and "broadcast.group" in r.text, r.text
        assert httpx.get(f"{server.url}/stats").json()["policy_version"] == 0  # nothing loaded
    finally:
        server.stop()


def test_weight_sync_is_a_named_choice():
    from megatron_s2.config.schema import from_mapping

    with pytest.raises(ConfigError, match="weight_sync"):
        from_mapping(DisaggregatedConfig, {"weight_sync": "rsync"}, "rl.disaggregated")
