"""A second model family, living in the test suite, through every generic path (issue 19).

``model.family: tests.families.dense_gqa`` — a dense GQA + SwiGLU transformer (the Llama
architecture). Nothing under ``megatron_s2/`` names it: the trainer, pipeline schedules,
checkpoints, resharding, Hugging Face conversion, planner, inference engine and server reach it
through :mod:`megatron_s2.models.family` only. Checked here:

* parity: TP2, TP2+SP, PP2 and DP2 against one rank (three optimiser steps, fp32);
* a TP2 checkpoint reshards to PP2 and to one rank with every tensor equal;
* export to Hugging Face (Llama layout) -> ``transformers.LlamaForCausalLM`` gives our logits;
  import back at PP2 gives the same tensors;
* the engine's paged-KV incremental decode equals the full forward's greedy continuation;
  ``megatron-s2 generate`` and ``megatron-s2 serve`` (the real ``openai`` client) answer from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel.parity import BASE, TOLERANCES, check_against_reference, load_records, run_layouts

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "tests" / "families" / "dense_gqa" / "pretrain.yaml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
       "OMP_NUM_THREADS": "1"}
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "pp2": ["parallel.pp=2"], "dp2": []}

pytestmark = pytest.mark.slow


def cli(*args: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "megatron_s2.cli", *args], env=ENV, cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"megatron-s2 {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def test_generic_code_never_names_the_test_family():
    roots = [REPO / "megatron_s2", REPO / "launcher", REPO / "kernels", REPO / "tools"]
    hits = [str(p) for root in roots for p in root.rglob("*.py") if "dense_gqa" in p.read_text()]
    assert hits == []


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("dense_parity"), 2, LAYOUTS, recipe_path=RECIPE, base=BASE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_one_rank(parity, layout):
    root, ref = parity
    check_against_reference(load_records(root / layout, 2), ref, layout, **TOLERANCES)


# ---- a trained checkpoint: reshard, Hugging Face round trip, engine, server ---------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TP2 run of 6 steps (two local ranks), its checkpoints directory."""
    run = tmp_path_factory.mktemp("dense_run") / "run"
    cli("launch", str(RECIPE), "--local", "--run-dir", str(run), "parallel.tp=2", "launcher.nproc_per_node=2",
        "training.train_steps=6", "checkpoint.save_interval=6", timeout=600)
    return run / "checkpoints"


def _full_state(path: Path) -> dict[str, torch.Tensor]:
    from megatron_s2.checkpoint.hf.checkpoint_io import read_full_state

    return read_full_state(path).state


def test_reshard_to_pipeline_and_one_rank(trained, tmp_path):
    source = _full_state(trained)
    for name, overrides in {"pp2": ["parallel.tp=1", "parallel.pp=2"], "one": ["parallel.tp=1"]}.items():
        cli("checkpoint", "reshard", str(trained), str(tmp_path / name), *overrides)
        resharded = _full_state(tmp_path / name)
        assert set(resharded) == set(source)
        assert all(torch.equal(resharded[k], source[k]) for k in source), name


def _our_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    from megatron_s2.inference.weights import load_model

    model, _, _ = load_model(str(checkpoint), "cpu")
    with torch.no_grad():
        return model(ids).float()


def test_hugging_face_round_trip_with_transformers_as_oracle(trained, tmp_path):
    from transformers import LlamaForCausalLM

    hf = tmp_path / "hf"
    out = cli("checkpoint", "export", str(trained), str(hf), "--no-progress")
    assert "passed" in out.stdout
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "llama" and config["megatron_s2"]["model"]["family"] == "tests.families.dense_gqa"
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(trained, ids)
    theirs = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        oracle = theirs(input_ids=ids).logits.float()
    assert float((ours - oracle).abs().max()) < 2e-5
    cli("checkpoint", "import", str(hf), str(tmp_path / "back"), "parallel.pp=2", "--no-progress")
    back, source = _full_state(tmp_path / "back"), _full_state(trained)
    assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source)


def test_engine_decode_equals_the_full_forward(trained):
    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
    from megatron_s2.inference.weights import load_model

    model, tokenizer, _ = load_model(str(trained), "cpu")
    prompts = [[tokenizer.bos_id] + tokenizer.encode(text) for text in ("12+30=", "copy:abc", "sort: dcba -> ")]
    engine = InferenceEngine(model, EngineConfig(max_num_seqs=3, max_model_len=64, page_tokens=4, prefill_chunk=5))
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(12):  # greedy continuation by whole-sequence forwards
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert result.token_ids == tokens[len(prompt):]


def test_generate_and_serve(trained):
    out = cli("generate", str(trained), "--prompt", "12+30=", "--max-tokens", "6", "--temperature", "0")
    assert out.stdout.startswith("12+30=") and out.stdout.endswith("\n")
    completion = out.stdout[len("12+30="):-1]  # the command echoes the prompt and ends the line
    import openai

    server = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "serve", str(trained), "--port", "0"],
                              env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stderr:
            if "listening on http://" in line:
                port = int(line.split("http://")[1].split()[0].rsplit(":", 1)[1])
                break
        assert port, "the server did not start"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt="12+30=", max_tokens=6, temperature=0)
        assert answer.choices[0].text == completion  # greedy: the server and the command agree
    finally:
        server.terminate()
        server.wait(timeout=30)
