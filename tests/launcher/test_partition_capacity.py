"""Submit-time check that the partition can ever hold the job (instead of pending forever)."""

from __future__ import annotations

import pytest
from launcher_helpers import RECIPES, RESUMABLE, payload_job

from megatron_s2.cli import main
from megatron_s2.config.schema import ConfigError
from megatron_s2.launcher.capacity import PartitionCapacity, check_capacity, gres_gpus, query_partition

RECIPE = str(RECIPES / "tiny_4rank.yaml")


@pytest.mark.parametrize("gres, gpus", [("(null)", 0), ("gpu:8", 8), ("gpu:h100:4(S:0-1),nic:2", 4),
                                        ("gpu:a100:2,gpu:v100:1", 3)])
def test_gres_gpus(gres, gpus):
    assert gres_gpus(gres) == gpus


@pytest.mark.parametrize("request_, field", [
    ({"nodes": 4}, "launcher.nodes"),
    ({"nproc": 9}, "launcher.nproc_per_node"),
    ({"nproc": 3, "sbatch_args": ("--cpus-per-task=4",)}, "launcher.nproc_per_node"),
])
def test_requests_beyond_the_partition(tmp_path, request_, field):
    capacity = PartitionCapacity("gpu", nodes=2, cpus_per_node=8, gpus_per_node=0)
    job = payload_job(tmp_path, RESUMABLE, **request_)
    with pytest.raises(ConfigError, match=field):
        check_capacity(job, capacity)
    check_capacity(payload_job(tmp_path, RESUMABLE, nodes=2, nproc=8), capacity)
    torchrun = payload_job(tmp_path, RESUMABLE, nproc=16, mode="torchrun")
    check_capacity(torchrun, capacity)  # one agent task per node


def test_live_partition(slurm, capsys, tmp_path):
    capacity = query_partition("")
    assert (capacity.name, capacity.nodes, capacity.cpus_per_node, capacity.gpus_per_node) == ("debug", 1, 4, 0)
    for flags, field in ((["--nodes", "2"], "launcher.nodes"), (["--gpus-per-node", "4"], "launcher.gpus_per_node"),
                         (["--partition", "nope"], "launcher.partition")):
        code = main(["launch", RECIPE, "--slurm", "--run-dir", str(tmp_path / "run"), *flags])
        _, err = capsys.readouterr()
        assert code == 2 and field in err, err
    code = main(["launch", RECIPE, "parallel.dp=4", "--slurm", "--run-dir", str(tmp_path / "run")])
    _, err = capsys.readouterr()
    assert code == 2 and "launcher.nproc_per_node: 8 ranks per node need 8 CPUs" in err
    assert slurm.run(["squeue", "-h"]).stdout == "", "nothing was queued"
    assert not (tmp_path / "run").exists()
