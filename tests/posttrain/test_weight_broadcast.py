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

import subprocess
import sys
import time
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



@pytest.fixture(scope="module")
def run_dir(tiny_pretrained_run) -> Path:
    return tiny_pretrained_run  # tests/posttrain/conftest.py


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
        store_port = sync.store.port
        sync.close()
        for s in servers:
            s.stop()
    import socket

    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", store_port), timeout=5):
        pass  # close() stops the trainer's TCPStore: its port is free again


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
        # review (break 3): every entry is allocated on arrival, so nothing beyond the model's own
        # tensors, in their own dtypes, is taken, and the wait is capped
        for tensors, said in (([*own, ["huge.extra", [2 ** 20, 2 ** 20], "float32"]], "huge.extra"),
                              ([[name, list(t.shape), "float64"], *own[1:]], f"'{name}' is float64"),
                              ([*own, own[0]], "listed twice")):
            r = httpx.post(f"{server.url}/update_weights", json={"version": 1, "broadcast": {"group": group,
                                                                                          "tensors": tensors}})
            assert r.status_code == 400 and "broadcast.tensors" in r.text and said in r.text, r.text
        r = httpx.post(f"{server.url}/update_weights",
                       json={"version": 1, "broadcast": {"group": {**group, "timeout_s": 1e9}, "tensors": own}})
        assert r.status_code == 400 and "broadcast.group.timeout_s" in r.text, r.text
        assert httpx.get(f"{server.url}/stats").json()["policy_version"] == 0  # nothing loaded
    finally:
        server.stop()


def test_an_abandoned_broadcast_holds_the_update_lock_no_longer_than_its_timeout(run_dir):
    """review (break 3): a broadcast whose trainer never starts it (the root's store is up, the
    root never says go) answers 503 after its timeout_s; a checkpoint update queued behind it
    then runs at once."""
    import threading

    import torch.distributed as dist

    server = _server(run_dir)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a root that never goes on
    try:
        own = [[n, list(v.shape), str(v.dtype).replace("torch.", "")] for n, v in _served(server).items()]
        group = {"host": "127.0.0.1", "port": store.port, "prefix": "v1", "rank": 1, "world_size": 2, "timeout_s": 2}
        answers = {}

        def broadcast():
            answers["broadcast"] = httpx.post(f"{server.url}/update_weights", timeout=60,
                                              json={"version": 1, "broadcast": {"group": group, "tensors": own}})

        asker = threading.Thread(target=broadcast)
        t0 = time.perf_counter()
        asker.start()
        while store.add("v1/joined", 0) < 1:  # the server waits in the rendezvous, holding the lock
            time.sleep(0.02)
        r = httpx.post(f"{server.url}/update_weights", json={"version": 2, "path": str(run_dir)}, timeout=60)
        took = time.perf_counter() - t0
        asker.join()
        assert answers["broadcast"].status_code == 503 and "v1" in answers["broadcast"].text, answers["broadcast"].text
        assert r.status_code == 200 and r.json()["policy_version"] == 2, r.text
        assert took < 2 + 5, f"the checkpoint update waited {took:.1f} s"
        print(f"checkpoint update done {took:.2f} s after the abandoned broadcast began (timeout_s 2)")
    finally:
        server.stop()


MEMBER = Path(__file__).with_name("broadcast_member.py")
BUCKET = 4096
"""Bytes per bucket in the failure tests: the tiny model's update takes dozens of broadcasts."""


def _member(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, str]:
    """A stand-in server (``broadcast_member.py``) that dies after the first bucket or refuses."""
    port_file = tmp_path / f"{mode}.port"
    proc = subprocess.Popen([sys.executable, str(MEMBER), str(port_file), mode, str(BUCKET)])
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def test_a_root_that_tears_the_group_down_frees_a_member_waiting_for_the_next_bucket():
    """The root's side of a failed broadcast (review break 1): after ``close_group(abort=True)`` and
    dropping the group, a member blocked on the next bucket fails within a second, not after the
    group's timeout (30 s here). Real gloo groups on the root's TCPStore, the member on a thread."""
    import gc
    import threading

    import torch.distributed as dist

    from megatron_s2.inference.weight_broadcast import BroadcastSpec, close_group, open_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = BroadcastSpec("127.0.0.1", store.port, "v1", 0, 2, timeout_s=30)
    waited: dict[str, float] = {}

    def member():
        group, flat = open_group(spec.for_rank(1)), torch.empty(4)
        group.broadcast(flat, 0).wait()  # the first bucket
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):
            group.broadcast(flat, 0).wait()  # the second never comes
        waited["s"] = time.perf_counter() - t0

    thread = threading.Thread(target=member)
    thread.start()
    root = open_group(spec, store=store)
    root.broadcast(torch.ones(4), 0).wait()
    time.sleep(0.2)  # the member now waits for the next bucket
    close_group(root, abort=True)
    del root
    gc.collect()
    thread.join(60)
    assert waited and waited["s"] < 0.2 + 3, waited


@pytest.mark.parametrize("mode", ["die", "refuse"])
def test_a_member_that_dies_or_refuses_frees_the_trainer_and_the_others_within_seconds(run_dir, tmp_path,
                                                                                        monkeypatch, mode):
    """review (disaggregated breaks 1, 2): a server killed after the first of many buckets, or one
    answering 400 before it joins, stalled the trainer (and a surviving server, holding its update
    lock) for the whole timeout (600 s). Now the push returns within seconds, counts the update as
    failed (the checkpoint covers it), and the surviving real server takes the next update whole."""
    import megatron_s2.inference.weight_broadcast as wb

    monkeypatch.setattr(wb, "BUCKET_BYTES", BUCKET)  # the trainer's and the in-process server's buckets
    trainer = _load(run_dir)[0]
    assert len(list(wb.buckets(wb.manifest_of(trainer.state_dict())))) >= 2
    survivor = _server(run_dir)
    member, url = _member(tmp_path, mode)
    exchange = tmp_path / "run"
    write_servers(exchange, [survivor.url, url])
    logs: list[str] = []
    sync = BroadcastWeightSync(trainer, exchange, DisaggregatedConfig(weight_sync="broadcast", request_timeout_s=600,
                                                                      broadcast_timeout_s=60), log=logs.append)
    try:
        _step(trainer)
        t0 = time.perf_counter()
        metrics = sync.push(1)
        took = time.perf_counter() - t0
        assert metrics["weight_sync_failed"] == 1, (metrics, logs)
        assert took < 10, f"push took {took:.1f} s"
        assert "incomplete" in logs[-1] and survivor.url in logs[-1], logs  # the survivor answered (503), freed
        # 'die' fails mid-broadcast (the group had formed), 'refuse' before the group forms
        assert ("BroadcastAborted" in logs[-1]) == (mode == "refuse"), logs
        assert httpx.get(f"{survivor.url}/stats").json()["policy_version"] == 0  # nothing half-swapped

        member.kill()
        member.wait()
        _step(trainer)  # the survivor's update lock is free: the next update reaches it whole
        t0 = time.perf_counter()
        metrics = sync.push(2)
        assert metrics["weight_sync_failed"] == 0 and metrics["weight_sync_servers"] == 1, (metrics, logs)
        assert time.perf_counter() - t0 < 10
        _assert_same(survivor, trainer, 2)
        print(f"{mode}: push returned after {took:.2f} s; {logs[0]}")
    finally:
        sync.close()
        member.kill()
        survivor.stop()


def test_weight_sync_is_a_named_choice():
    from megatron_s2.config.schema import from_mapping

    with pytest.raises(ConfigError, match="weight_sync"):
        from_mapping(DisaggregatedConfig, {"weight_sync": "rsync"}, "rl.disaggregated")
    with pytest.raises(ConfigError, match="broadcast_timeout_s"):
        DisaggregatedConfig(weight_sync="broadcast", broadcast_timeout_s=0)


RL = str(Path(__file__).resolve().parents[2] / "recipes" / "phases" / "rl_addition.yaml")
ASYNC = ["rl.mode=disaggregated", "rl.disaggregated.max_async_level=1", "rl.rollout.max_staleness=1",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.mark.parametrize("overrides, needle", [
    # review (break 4): accepted before, then every update failed and fell back to checkpoints, silently
    (["rl.disaggregated.weight_sync=broadcast", "rl.disaggregated.broadcast_backend=nccl"], "broadcast_backend=gloo"),
    (["rl.disaggregated.broadcast_backend=nccl"], "has no effect with weight_sync 'checkpoint'"),
    (["rl.disaggregated.broadcast_timeout_s=5"], "has no effect with weight_sync 'checkpoint'"),
])
def test_broadcast_settings_that_cannot_work_are_refused_before_any_rank_starts(overrides, needle, tmp_path, capsys):
    import torch.distributed as dist

    if "broadcast_backend=gloo" in needle and torch.cuda.is_available() and dist.is_nccl_available():
        pytest.skip("this machine has CUDA and NCCL: nccl is a valid choice here")
    rc = main(["train", RL, *ASYNC, *overrides, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "rl.disaggregated.broadcast_" in err and needle in err, err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
