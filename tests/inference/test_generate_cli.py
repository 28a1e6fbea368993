"""``megatron-s2 generate <checkpoint> --prompt ...``: run, checkpoints, step and Hugging Face
export directories, greedy output equal to the model's own greedy continuation, streaming
through the console script, and bad input -> exit 2 with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.checkpoint.hf.checkpoint_io import write_full_state
from megatron_s2.cli import main
from megatron_s2.config.recipe import load_recipe
from megatron_s2.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
from megatron_s2.data.tokenizer_checks import record_run_tokenizer
from megatron_s2.models.v41.model import build_model
from tests.parallel.parity import RECIPE

PROMPT = "Hello, world"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the trainer leaves it: config, tokenizer, a committed checkpoint."""
    run = tmp_path_factory.mktemp("gen") / "run"
    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1", f"training.run_dir={run}"])
    model = build_model(recipe.model, seed=5)
    run.mkdir()
    (run / "config.yaml").write_text(recipe.to_yaml())
    record_run_tokenizer(CharTokenizer(), run)
    write_full_state(model.state_dict(), recipe, run / "checkpoints", step=7)
    return run


def greedy(run_dir, n):
    tok = CharTokenizer()
    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1"])
    model = build_model(recipe.model, seed=5).eval()
    model.set_token_map(tok.compressed_token_map(num_ids=recipe.model.vocab_size))
    ids = [tok.bos_id] + tok.encode(PROMPT)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_id:
                break
    return PROMPT + tok.decode(out)


@pytest.mark.parametrize("where", ["run", "checkpoints", "step"])
def test_generate_greedy_from_every_checkpoint_form(run_dir, where, capsys):
    path = {"run": run_dir, "checkpoints": run_dir / "checkpoints",
            "step": next((run_dir / "checkpoints").glob("step_*"))}[where]
    rc = main(["generate", str(path), "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "10",
               "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.rstrip("\n") == greedy(run_dir, 10)
    assert "finish reason" in out.err


def test_generate_from_a_hugging_face_export(run_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["checkpoint", "export", str(run_dir), str(hf), "--no-progress", "--no-verify"]) == 0
    capsys.readouterr()
    saved = hf / CHAR_TOKENIZER_FILE  # the export carries the run's tokenizer beside the weights
    kept = saved.read_bytes()
    saved.unlink()
    assert main(["generate", str(hf), "--prompt", PROMPT, "--max-tokens", "4"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    saved.write_bytes(kept)
    assert main(["generate", str(hf), "--prompt", PROMPT, "--max-tokens", "5", "--seed", "1", "--top-k", "8",
                 "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


@pytest.mark.parametrize("args, flag", [
    (["/does/not/exist", "--prompt", "x"], "checkpoint"),
    (["RUN", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["RUN", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["RUN", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["RUN", "--prompt", "x", "--top-k", "-2"], "--top-k"),
    (["RUN", "--prompt", "x", "--stop", ""], "--stop"),
    (["RUN", "--prompt", ""], "--prompt"),
    (["RUN", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["RUN", "--prompt", "x", "--seed", str(2 ** 64)], "--seed"),
    (["RUN", "--prompt", "x", "--seed", str(-2 ** 63 - 1)], "--seed"),
    (["RUN", "--prompt", "x", "--max-model-len", "0"], "--max-model-len"),
    (["RUN", "--prompt", "x" * 40, "--max-model-len", "20"], "--prompt"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(run_dir, args, flag, capsys):
    """Range errors named the SamplingParams field (``max_tokens``) instead of the flag, and a
    seed beyond what a generator takes was a traceback."""
    args = [str(run_dir) if a == "RUN" else a for a in args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].split("configuration error: ", 1)[-1].startswith(f"{flag}: "), err[0]


def test_a_seed_at_either_end_of_the_generator_range_is_used(run_dir, capsys):
    for seed in (2 ** 64 - 1, -2 ** 63):
        assert main(["generate", str(run_dir), "--prompt", PROMPT, "--max-tokens", "2", "--seed", str(seed),
                     "--device", "cpu"]) == 0
        assert capsys.readouterr().out.startswith(PROMPT)


@pytest.mark.slow
def test_console_script_streams(run_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("megatron-s2")
    proc = subprocess.run([str(exe), "generate", str(run_dir), "--prompt", PROMPT, "--temperature", "0",
                           "--max-tokens", "6"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == greedy(run_dir, 6)
