"""The loader refuses pickled payloads from an untrusted checkpoint — without unpickling them.

Each malicious file would create a marker file if it were ever unpickled; the tests check the
refusal message *and* that the marker does not exist.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from megatron_s2.checkpoint.hf.convert import export_model_state, import_model_state
from megatron_s2.checkpoint.hf.safetensors_io import INDEX_FILE, SafetensorsReader, UnsafeCheckpointError
from megatron_s2.checkpoint.hf.verify import VERIFICATION_FILE, check_reference_logits


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_pickle(marker) -> bytes:
    return pickle.dumps({"embed.weight": _Payload(marker)}, protocol=4)


@pytest.fixture
def good(tiny_cfg, tiny_state, tmp_path):
    return export_model_state(tiny_state, tiny_cfg, tmp_path / "good", progress=False).directory


def test_pickle_only_directory_is_refused(tiny_cfg, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    marker = tmp_path / "pwned"
    (d / "pytorch_model.bin").write_bytes(_evil_pickle(marker))
    (d / "config.json").write_text("{}")
    with pytest.raises(UnsafeCheckpointError, match=r"no \.safetensors files \(found pytorch_model.bin\)"):
        SafetensorsReader(d)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_pickle_disguised_as_safetensors_is_refused(good, tmp_path, kind):
    marker = tmp_path / "pwned"
    index = json.loads((good / INDEX_FILE).read_text())
    victim = good / sorted(set(index["weight_map"].values()))[0]
    if kind == "pickle":
        victim.write_bytes(_evil_pickle(marker))
        expect = "a Python pickle"
    else:
        torch.save({"embed.weight": _Payload(marker)}, victim)
        expect = r"a zip archive \(torch.save format, which embeds a pickle\)"
    with pytest.raises(UnsafeCheckpointError, match=f"{victim.name}: {expect}; only safetensors are loaded"):
        import_model_state(good)
    assert not marker.exists()


def test_index_pointing_outside_the_directory_is_refused(good):
    index = json.loads((good / INDEX_FILE).read_text())
    index["weight_map"]["embed.weight"] = "../elsewhere.safetensors"
    (good / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match="not a safetensors file in this directory"):
        SafetensorsReader(good)


def test_pickled_verification_file_is_refused(tiny_cfg, tiny_state, good, tmp_path):
    marker = tmp_path / "pwned"
    (good / VERIFICATION_FILE).write_bytes(_evil_pickle(marker))
    with pytest.raises(UnsafeCheckpointError, match="a Python pickle"):
        check_reference_logits(tiny_cfg, tiny_state, good)
    assert not marker.exists()
