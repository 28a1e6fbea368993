"""A remote OPD teacher is asked once per data-parallel replica: the replica's first rank (tp =
cp = pp rank 0) sends the requests and the log-probs reach every rank of the replica through
pipeline, context and tensor broadcasts (4 gloo processes); a failure there is raised on every
rank of the replica instead of leaving them waiting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_s2.parallel.groups import Group, ParallelGroups
from megatron_s2.posttrain.opd.remote_teacher import RemoteTeacherError, once_per_replica
from tests.parallel.spawn import run_distributed


def _group(rank: int, partition: list[list[int]]) -> Group:
    mine = Group()
    for ranks in partition:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = Group(pg=pg, size=len(ranks), rank=ranks.index(rank), ranks=tuple(ranks))
    return mine


def _worker(rank: int, world: int, out_dir: str) -> None:
    tp = _group(rank, [[0, 1], [2, 3]])
    across = _group(rank, [[0, 2], [1, 3]])  # pp in one layout, cp in another, dp in a third
    layouts = {"tp_pp": ParallelGroups(tp=tp, pp=across), "tp_cp": ParallelGroups(tp=tp, cp=across),
               "tp_dp": ParallelGroups(tp=tp, dp=across)}
    calls, seen = [], {}

    def fetch():
        calls.append(rank)
        return torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * (rank + 1)

    for name, groups in layouts.items():
        seen[name] = once_per_replica(fetch, (2, 3), groups).tolist()
    # any shape: the held-out evaluation broadcasts a served teacher's [rows, positions, vocabulary]
    seen["3d"] = once_per_replica(lambda: fetch().view(1, 2, 3), (1, 2, 3), layouts["tp_pp"]).tolist()

    def broken():
        raise RemoteTeacherError("opd.teachers.t.endpoint: POST failed (boom)")

    try:
        once_per_replica(broken, (2, 3), layouts["tp_pp"])
        seen["failure"] = None
    except RemoteTeacherError as exc:
        seen["failure"] = str(exc)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"seen": seen, "calls": len(calls)}, f)


@pytest.mark.slow
def test_remote_teacher_log_probs_are_fetched_once_per_replica(tmp_path):
    run_distributed(4, _worker, str(tmp_path))
    out = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)}
    from_rank = lambda r: (torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * (r + 1)).tolist()  # noqa: E731
    for r in range(4):
        assert out[r]["seen"]["tp_pp"] == from_rank(0) and out[r]["seen"]["tp_cp"] == from_rank(0)
        assert out[r]["seen"]["tp_dp"] == from_rank(0 if r < 2 else 2)  # two replicas, two leaders
        assert out[r]["seen"]["3d"] == [from_rank(0)]
    assert [out[r]["calls"] for r in range(4)] == [4, 0, 1, 0]
    assert out[0]["seen"]["failure"] == "opd.teachers.t.endpoint: POST failed (boom)"
    for r in (1, 2, 3):
        assert "failed on this replica's first rank" in out[r]["seen"]["failure"]
