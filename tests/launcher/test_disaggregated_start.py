"""``launch --local`` of a disaggregated RL phase whose inference servers cannot start: one line and
the server's own reason, before the trainer starts (review57) — not a RuntimeError traceback that
points at a log. ``rl.rollout.engine.speculative`` with a ``checkpoint.load`` whose model has no
drafter is refused before anything starts (the servers load the checkpoint's own architecture)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_s2.checkpoint import CheckpointStore
from megatron_s2.checkpoint.dcp_io import GlobalShard, save_shards
from megatron_s2.checkpoint.format import Manifest, sha256_file
from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RL = ROOT / "recipes" / "phases" / "rl_addition.yaml"
DISAGGREGATED = ["rl.mode=disaggregated", "rl.rollout.max_staleness=1", "rl.eval.interval=0", "rl.eval.at_start=false",
                 "rl.disaggregated.num_servers=1", "training.train_steps=1"]
DRAFTER = ["model.dspark_layers=2", "model.dspark_block_size=4", "model.dspark_noise_token_id=127",
           "model.dspark_target_layer_ids=[5,6,7]", "model.dspark_markov_rank=8", "model.dspark_num_routed_experts=4",
           "model.dspark_moe_topk=2"]


def _tensorless_checkpoint(root: Path, overrides: list[str]) -> Path:
    """A committed checkpoint that records the architecture of ``rl_addition`` + ``overrides`` and
    holds one stray tensor: enough for the start-up checks, unloadable by a server."""
    recipe = load_recipe(RL, overrides)
    store = CheckpointStore(root / "checkpoints", keep_last=10)
    tmp = store.prepare(1)
    save_shards({"model/w": GlobalShard(torch.ones(2), (2,), (0,))}, tmp, None, 0)
    manifest = Manifest(step=1, world_size=1, layout="world=1", config=recipe.to_mapping())
    manifest.files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in tmp.iterdir()}
    store.commit(1, manifest)
    return root / "checkpoints"


def test_speculative_servers_on_a_checkpoint_without_a_drafter_are_refused_before_start(tmp_path, capsys):
    load = _tensorless_checkpoint(tmp_path / "sft", [])   # the SFT run's architecture: no drafter
    code = main(["launch", str(RL), *DISAGGREGATED, *DRAFTER, "rl.rollout.engine.speculative=true",
                 f"checkpoint.load={load}", "--local", "--run-dir", str(tmp_path / "rl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "rl.rollout.engine.speculative" in err[0] and str(load) in err[0], err
    assert not (tmp_path / "rl" / "logs").exists()   # no server was started


def test_a_server_that_exits_at_start_up_is_one_line_with_its_reason(tmp_path, capsys):
    from megatron_s2.posttrain.disaggregated.exchange import SERVERS, exchange_dir, write_servers

    load = _tensorless_checkpoint(tmp_path / "sft", [])   # committed, but no tensors to load
    write_servers(tmp_path / "rl", ["http://127.0.0.1:1"])  # a previous launch's: a resumed trainer must not read it
    code = main(["launch", str(RL), *DISAGGREGATED, f"checkpoint.load={load}", "--local",
                 "--run-dir", str(tmp_path / "rl")])
    assert not (exchange_dir(tmp_path / "rl") / SERVERS).exists()  # removed when the roles start
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "inference server" in line]
    assert code != 0
    assert len(err) == 1 and "server0.log" in err[0] and "megatron-s2 serve:" in err[0], err
    assert "Traceback" not in capsys.readouterr().err


def test_a_server_that_never_comes_back_is_given_up_and_fails_the_run(tmp_path):
    """A server that dies mid-run and then fails every restart (its checkpoint deleted, say) is
    restarted MAX_FAILED_RESTARTS times, then given up, and the trainer is told why — not
    restarted forever (review57)."""
    import subprocess
    import sys
    import time

    from launcher.disaggregated import MAX_FAILED_RESTARTS, ServedRoles
    from megatron_s2.posttrain.disaggregated.exchange import ORCHESTRATOR_FAILED, exchange_dir

    recipe = load_recipe(RL, DISAGGREGATED)
    said: list[str] = []
    roles = ServedRoles(recipe, tmp_path / "run", tmp_path / "config.yaml", tmp_path / "logs", say=said.append)

    def dying_server(i: int) -> None:   # a real process that exits at once, as a server with nothing to load
        roles.servers[i] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])

    roles._start_server = dying_server
    roles._start_server(0)
    roles._watcher.start()
    marker = exchange_dir(roles.run_dir) / ORCHESTRATOR_FAILED
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)   # it must not restart after giving up
    roles.stop()
    assert marker.exists() and "inference server 0" in marker.read_text() and "server0.log" in marker.read_text()
    assert roles.restarts == MAX_FAILED_RESTARTS and roles.servers[0] is None, said
    assert sum("restarting it" in line for line in said) == MAX_FAILED_RESTARTS
