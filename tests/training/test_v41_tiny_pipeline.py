"""The tiny V4.1 pipeline (pre-training on synthetic tasks with the BPE tokenizer -> SFT on
multi-turn chat data) end to end with ``megatron-s2 launch --local``, each phase starting from
the previous phase's checkpoint, shortened to a few steps per phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_s2.cli import main
from megatron_s2.data.tokenizer import load_tokenizer

PIPELINE = Path(__file__).resolve().parents[2] / "recipes" / "v41" / "tiny_pipeline.yaml"


@pytest.mark.slow
def test_tiny_pipeline_runs_pretrain_then_sft(tmp_path, capsys):
    short = ["training.train_steps=2", "training.global_batch_size=2", "training.micro_batch_size=1",
             "data.num_documents=200", "logging.progress_bar=false", "logging.tensorboard=false"]
    code = main(["launch", str(PIPELINE), "--local", "--run-dir", str(tmp_path), *short])
    assert code == 0, capsys.readouterr().err[-3000:]
    pretrain, sft = tmp_path / "pretrain", tmp_path / "sft"
    for phase in (pretrain, sft):
        assert (phase / "FINISHED").is_file(), phase
        assert json.loads((phase / "FINISHED").read_text())["step"] == 2
        records = [json.loads(line) for line in (phase / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
    # SFT started from the pre-training weights, with the same tokenizer recorded in both runs
    log = "".join(p.read_text() for p in sft.rglob("*.log"))
    assert "initialised from" in log and str(pretrain / "checkpoints") in log
    assert load_tokenizer(sft / "tokenizer").fingerprint() == load_tokenizer(pretrain / "tokenizer").fingerprint()
    sft_config = (sft / "config.yaml").read_text()
    assert "kind: chat" in sft_config and "kind: sft" in sft_config
