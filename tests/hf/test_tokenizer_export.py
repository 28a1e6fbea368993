"""Checkpoints carry their tokenizer: train -> export -> import reproduces the *trained* model.

The trained model hashes Engram n-grams through its tokenizer's compressed token map; the
export must write the tokenizer files beside the weights, the import must use them, and the
export's own verification compares the trained model (with the map, on text tokens) against
the model rebuilt from the exported directory alone — so a lost map cannot pass silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state
from megatron_s2.checkpoint.hf.convert import load_hf_checkpoint
from megatron_s2.checkpoint.hf.verify import logits_divergence, model_logits, text_inputs
from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.data.tokenizer import load_tokenizer
from megatron_s2.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "v41" / "tiny_pretrain.yaml"
FAST = ["training.train_steps=5", "training.seq_length=32", "training.global_batch_size=4",
        "training.micro_batch_size=2", "data.num_documents=400", "logging.progress_bar=false",
        "logging.tensorboard=false", "schedule.warmup_steps=1", "schedule.decay_start_tokens=1024",
        "schedule.decay_end_tokens=2048"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    recipe = load_recipe(RECIPE, [*FAST, f"training.run_dir={run}"])
    trainer = Trainer(recipe, run, log=lambda *a, **k: None)
    trainer.train()
    return trainer, run


@pytest.mark.slow
def test_run_directory_records_the_tokenizer(trained):
    trainer, run = trained
    saved = load_tokenizer(run / "tokenizer")
    assert saved.fingerprint() == trainer.tokenizer.fingerprint()
    # the map the model hashes with is the one derived from the saved files
    token_map = saved.compressed_token_map(trainer.recipe.model.vocab_size)
    hashers = [m.hasher for m in trainer.model.modules() if hasattr(m, "hasher")]
    assert hashers and all(h._token_map.tolist() == token_map for h in hashers)
    assert all(h.compressed_vocab == saved.compressed_vocab_size for h in hashers)


@pytest.mark.slow
def test_export_import_reproduces_the_trained_logits_exactly(trained, tmp_path, capsys):
    trainer, run = trained
    assert main(["checkpoint", "export", str(run), str(tmp_path / "hf"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "verification (export -> import): passed" in out and "max |diff| 0.000e+00" in out
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").is_file() and (hf / "tokenizer_config.json").is_file()
    cfg, state, _ = load_hf_checkpoint(hf, progress=False)
    tokenizer = load_tokenizer(hf)
    ids = text_inputs(tokenizer, cfg)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(ids).float()
    got = model_logits(cfg, state, ids, tokenizer.compressed_token_map(cfg.vocab_size))
    assert torch.equal(got, want)  # fp32, bitwise
    # without the map (identity), the Engram hash ids change and so do the logits
    lost = model_logits(cfg, state, ids, None)
    assert logits_divergence(want, lost)[0] > 1e-4
    # import -> our checkpoint with its tokenizer; loading it gives the same logits again
    assert main(["checkpoint", "import", str(hf), str(tmp_path / "ckpt"), "--no-progress"]) == 0
    assert "verification (import" in capsys.readouterr().out
    assert load_tokenizer(tmp_path / "ckpt" / "tokenizer").fingerprint() == tokenizer.fingerprint()
    back = read_full_state(tmp_path / "ckpt")
    assert torch.equal(model_logits(cfg, back.state, ids, tokenizer.compressed_token_map(cfg.vocab_size)), want)


def test_export_without_a_tokenizer_is_refused(trained, tmp_path, capsys):
    _, run = trained
    copy = shutil.copytree(run / "checkpoints", tmp_path / "alone" / "checkpoints", symlinks=True)
    assert main(["checkpoint", "export", str(copy), str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer files found" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_import_with_the_wrong_tokenizer_fails_verification(trained, tmp_path, capsys):
    """An exported directory whose tokenizer was swapped: the stored logits of the trained
    model are not reproduced (the check compares against the trained model, not itself)."""
    _, run = trained
    assert main(["checkpoint", "export", str(run), str(tmp_path / "hf"), "--no-progress"]) == 0
    capsys.readouterr()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    assert main(["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "c1"), "--no-progress"]) == 2
    assert "no tokenizer files found" in capsys.readouterr().err
    assert main(["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "c2"), "--no-progress",
                 "--tokenizer", "char"]) == 2  # pad 0 is not the model's engram_pad_id
    assert "model.engram_pad_id: 2 is not the pad token" in capsys.readouterr().err
    from megatron_s2.data.bpe_training import synthetic_texts, train_bpe

    other = train_bpe(synthetic_texts(300, seed=5), 300, tmp_path / "other")  # fits, but another map
    args = ["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "c3"), "--no-progress", "--tokenizer",
            str(other)]
    assert main(args) == 2  # config.json states the map's size, as the release does
    assert "states engram_compressed_vocab_size=" in capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["text_config"]["engram_compressed_vocab_size"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(args) == 1  # the trained model's stored logits are not reproduced: nothing is committed
    err = capsys.readouterr().err
    assert "verification failed" in err and "nothing was written" in err
    assert not (tmp_path / "c3").exists() or not any((tmp_path / "c3").iterdir())
