"""The cached datastore under a layout (megatron_s2/posttrain/memdec/datastore.py, walkthrough Ch. 2
Step 1): every rank agrees on the backbone's fingerprint although each holds other shards, and the
ranks read the cache or build together — a rank building alone runs the backbone's tp collectives
while the others have moved on (a resumed tp2 memory phase hung at start-up this way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def _ranks(rank: int, world: int, root: str) -> None:
    from megatron_s2.models.memory_decoder.knn import Datastore
    from megatron_s2.posttrain.memdec import datastore as ds

    torch.manual_seed(rank)  # each rank its own "shard": different weights
    shard = torch.nn.Linear(4, 4)
    built = []

    def build(*args, meta=None, **kwargs):  # stands for the backbone's forward (collectives under tp)
        built.append(True)
        return Datastore(torch.ones(3, 2), torch.arange(3), dict(meta or {}))

    ds.build_datastore = build
    fingerprint = ds.layout_fingerprint(shard)
    out = {"own": ds.weights_fingerprint(shard), "layout": fingerprint}
    run_dir = Path(root)
    meta = {"backbone": fingerprint, "seq_length": 8}
    first = ds.load_or_build_datastore(run_dir, shard, [], meta=meta, seq_length=8, pad_id=0, device="cpu",
                                       save=rank == 0, log=lambda _: None)
    torch.distributed.barrier()
    again = ds.load_or_build_datastore(run_dir, shard, [], meta=meta, seq_length=8, pad_id=0, device="cpu",
                                       save=False, log=lambda _: None)  # a resume: every rank reads
    torch.distributed.barrier()
    stale = dict(meta, seq_length=9 if rank == 1 else 8)  # only rank 1 cannot use the cache
    ds.load_or_build_datastore(run_dir, shard, [], meta=stale, seq_length=8, pad_id=0, device="cpu",
                               save=False, log=lambda _: None)
    out.update(built=len(built), keys=[len(first), len(again)])
    (run_dir / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_ranks_agree_on_the_fingerprint_and_read_or_build_together(tmp_path):
    from tests.parallel.spawn import run_distributed

    run_distributed(2, _ranks, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["own"] != ranks[1]["own"] and ranks[0]["layout"] == ranks[1]["layout"]
    # built once on the fresh run, read on the resume, built by both when one rank's cache is stale
    assert [r["built"] for r in ranks] == [2, 2] and all(r["keys"] == [3, 3] for r in ranks), ranks
