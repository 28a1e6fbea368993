"""Checkpoints are untrusted input: loading never unpickles arbitrary objects.

Each test builds a small checkpoint, plants a payload whose unpickling would run code (it
would create a marker file), and *reseals* the checkpoint — rewrites the manifest checksums
and the commit marker as an attacker who controls the files would — so that the payload
reaches the reader instead of being stopped by the checksum. Loading must refuse it with a
message naming the file or tensor, and the marker must not exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from megatron_s2.checkpoint import COMMIT, MANIFEST, CheckpointError, CheckpointManager
from megatron_s2.checkpoint.describe import describe_step
from megatron_s2.checkpoint.format import DCP_METADATA, sha256_file
from megatron_s2.checkpoint.safe_pickle import load_dcp_index


class RunsCode:
    """Unpickling this runs ``exec``: it writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _checkpoint(tmp_path: Path) -> tuple[Path, CheckpointManager]:
    model = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(tmp_path / "checkpoints", log=lambda m: None)
    mgr.save(1, {"model": model, "optimizer": None, "data": None, "rng": None}, {"layout": "test", "config": {}})
    return tmp_path / "checkpoints" / "step_00000001", mgr


def _reseal(step_dir: Path) -> None:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"sha256": sha256_file(step_dir / name), "bytes": (step_dir / name).stat().st_size}
    data = json.dumps(manifest).encode()
    (step_dir / MANIFEST).write_bytes(data)
    (step_dir / COMMIT).write_text(hashlib.sha256(data).hexdigest() + "\n")


def _rewrite_index(step_dir: Path, edit) -> None:
    metadata = load_dcp_index(step_dir / DCP_METADATA)
    edit(metadata)
    (step_dir / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    _reseal(step_dir)


def test_pickled_code_in_the_index_is_refused(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    (step_dir / DCP_METADATA).write_bytes(pickle.dumps(RunsCode(marker)))
    _reseal(step_dir)
    try:
        FileSystemReader(step_dir).read_metadata()  # torch's stock reader runs the payload ...
    except AttributeError:
        pass  # ... then trips over the result, too late
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: unsafe or unreadable checkpoint index, refused "
                                              r"\(refusing to unpickle 'builtins\.exec'"):
        mgr.load(step_dir, torch.nn.Linear(4, 3))  # ... ours refuses it
    lines, _ = describe_step(step_dir)  # `checkpoint inspect` does not run it either
    assert any("refusing to unpickle" in line for line in lines)
    assert not marker.exists()


def test_pickled_code_in_a_tensor_shard_is_refused(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    shard = step_dir / "__0_0.distcp"
    buffer = io.BytesIO()
    torch.save(RunsCode(marker), buffer)
    shard.write_bytes(buffer.getvalue())

    def point_at_payload(metadata):
        metadata.storage_data = {index: dataclasses.replace(info, offset=0, length=len(buffer.getvalue()))
                                 for index, info in metadata.storage_data.items()}

    _rewrite_index(step_dir, point_at_payload)
    with pytest.raises(CheckpointError, match=f"{shard}: cannot be read safely .*Weights only load failed"):
        mgr.load(step_dir, torch.nn.Linear(4, 3))
    assert not marker.exists()


def test_pickled_object_entry_is_refused(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)

    def make_bytes_entry(metadata):
        metadata.state_dict_metadata["model/weight"] = BytesStorageMetadata()
        info = next(iter(metadata.storage_data.values()))
        metadata.storage_data = {MetadataIndex("model/weight"): info}

    _rewrite_index(step_dir, make_bytes_entry)
    with pytest.raises(CheckpointError, match="'model/weight' is stored as a pickled object, not a tensor; refused"):
        mgr.load(step_dir, torch.nn.Linear(4, 3))


def test_file_references_outside_the_checkpoint_are_refused(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)

    def escape(metadata):
        metadata.storage_data = {index: dataclasses.replace(info, relative_path="../../outside.distcp")
                                 for index, info in metadata.storage_data.items()}

    _rewrite_index(step_dir, escape)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory; refused"):
        mgr.load(step_dir, torch.nn.Linear(4, 3))


def test_manifest_must_be_our_format(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["format_version"] = 99
    data = json.dumps(manifest).encode()
    (step_dir / MANIFEST).write_bytes(data)
    (step_dir / COMMIT).write_text(hashlib.sha256(data).hexdigest() + "\n")
    with pytest.raises(CheckpointError, match="format version 99; this build reads up to 1"):
        mgr.load(step_dir, torch.nn.Linear(4, 3))


def test_intact_checkpoint_round_trips(tmp_path):
    step_dir, mgr = _checkpoint(tmp_path)
    source = torch.nn.Linear(4, 3)
    torch.manual_seed(0)
    target = torch.nn.Linear(4, 3)
    mgr.save(2, {"model": source, "optimizer": None, "data": None, "rng": None}, {"layout": "test", "config": {}})
    loaded = mgr.load(Path(step_dir).parent / "step_00000002", target)
    assert loaded.step == 2 and torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
