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


# ---- --image (a vision-language checkpoint) ---------------------------------------------------------

VISION = ["model.vision_n_layers=2", "model.vision_dim=16", "model.vision_n_heads=2", "model.vision_inter_dim=24",
          "model.vision_patch_size=4", "model.vision_downsample_ratio=3", "model.vision_max_n_token=40",
          "model.vision_min_pixels=256", "model.image_token_id=100"]


@pytest.fixture(scope="module")
def vl_run_dir(tmp_path_factory):
    """A run directory whose model has a two-block vision tower, and two PNG files."""
    from PIL import Image

    run = tmp_path_factory.mktemp("gen-vl") / "run"
    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1", f"training.run_dir={run}", *VISION])
    model = build_model(recipe.model, seed=5)
    run.mkdir()
    (run / "config.yaml").write_text(recipe.to_yaml())
    record_run_tokenizer(CharTokenizer(), run)
    write_full_state(model.state_dict(), recipe, run / "checkpoints", step=7)
    for seed, size in ((0, (20, 20)), (1, (30, 24))):
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels, "RGB").save(run / f"image{seed}.png")
    return run


def vl_greedy(run_dir, prompt_ids, files, n):
    """The model's own greedy continuation of ``prompt_ids`` (placeholders) with ``files``."""
    from PIL import Image

    from megatron_s2.models.v41.context import ForwardContext
    from megatron_s2.models.v41.vision.processor import TEXT, prepare_vl_inputs

    tok = CharTokenizer()
    recipe = load_recipe(RECIPE, ["parallel.tp=1", "parallel.pp=1", *VISION])
    model = build_model(recipe.model, seed=5).eval()
    model.set_token_map(tok.compressed_token_map(num_ids=recipe.model.vocab_size))
    ids, types, inputs = prepare_vl_inputs(prompt_ids, [Image.open(f).convert("RGB") for f in files], recipe.model)
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids + out])
            ctx = ForwardContext.create(x, model.plan, image_mask=torch.tensor([[t != TEXT for t in types]
                                                                                + [False] * len(out)]))
            nxt = int(model.head(*model.run_layers(model.embed(x, images=[inputs]), ctx))[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_id:
                break
    return tok.decode(out)


@pytest.mark.parametrize("where", ["prepended", "marked"])
def test_generate_with_images_is_the_models_greedy_continuation(vl_run_dir, where, capsys):
    tok, files = CharTokenizer(), [vl_run_dir / "image0.png", vl_run_dir / "image1.png"]
    if where == "prepended":  # no <image> in the prompt: the images go first
        prompt, ids = PROMPT, [tok.bos_id, 100, 100] + tok.encode(PROMPT)
    else:
        prompt = "A <image> and <image>?"
        ids = [tok.bos_id] + tok.encode("A ") + [100] + tok.encode(" and ") + [100] + tok.encode("?")
    rc = main(["generate", str(vl_run_dir), "--prompt", prompt, "--image", str(files[0]), "--image", str(files[1]),
               "--temperature", "0", "--max-tokens", "6", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.rstrip("\n") == prompt + vl_greedy(vl_run_dir, ids, files, 6)


def test_bad_images_exit_2_with_one_line(vl_run_dir, run_dir, tmp_path, capsys):
    good = str(vl_run_dir / "image0.png")
    truncated = tmp_path / "cut.png"
    truncated.write_bytes((vl_run_dir / "image0.png").read_bytes()[:60])
    text_file = tmp_path / "notes.png"
    text_file.write_text("not an image")
    cases = [
        ([str(vl_run_dir), "--image", str(tmp_path / "missing.png")], "--image: ", "no such file"),
        ([str(vl_run_dir), "--image", str(truncated)], "--image: ", "truncated or corrupt"),
        ([str(vl_run_dir), "--image", str(text_file)], "--image: ", "not a recognised image"),
        ([str(run_dir), "--image", good], "--image: ", "no vision tower"),
        ([str(vl_run_dir), "--image", good, "--prompt", "<image><image>"], "--prompt: ", "2 <image> placeholder"),
    ]
    for args, flag, words in cases:
        if "--prompt" not in args:
            args = [*args, "--prompt", "x"]
        assert main(["generate", *args, "--device", "cpu", "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        message = err[0].split("configuration error: ", 1)[-1]
        assert message.startswith(flag) and words in message, message
