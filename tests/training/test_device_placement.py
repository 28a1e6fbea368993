"""Device placement and precision (issue 13 item 1), checked on CPU.

* The device table of :mod:`megatron_s2.runtime.device` (nccl <=> cuda, gloo <=> cpu).
* Every tensor factory our code calls during a real train step (single rank with a checkpoint
  save and a resume; pipeline pp2 and context-parallel cp2 on two gloo ranks) and a real
  inference-engine run names its device: :class:`~megatron_s2.runtime.audit.DeviceAudit`
  fails this test when a new ``torch.zeros(...)`` forgets ``device=``.
* Everything a model creates at construction follows the device it is built on (``meta``).
* The precision map: float32 master parameters and gradients, bfloat16 GEMMs, float32 islands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_s2.config.recipe import load_recipe
from megatron_s2.config.schema import ConfigError
from megatron_s2.runtime.audit import DeviceAudit
from megatron_s2.runtime.device import build_on, resolve_rank_device, to_device
from tests.models.conftest import load_model_recipe
from tests.parallel.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "pretrain_tiny.yaml"
FAST = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "training.seq_length=32", "training.global_batch_size=4",
        "training.micro_batch_size=2", "data.num_documents=200", "logging.progress_bar=false",
        "logging.log_interval=100", "logging.tensorboard=false", "schedule.warmup_steps=1",
        "model.fp4_main_kv=true", "model.fp8_swa_kv=true", "model.fp4_indexer=true"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the device table ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend, gpus, local_rank, expected", [
    ("auto", 0, 3, ("gloo", "cpu")),
    ("gloo", 8, 3, ("gloo", "cpu")),
    ("auto", 8, 3, ("nccl", "cuda:3")),
    ("nccl", 8, 5, ("nccl", "cuda:5")),
    ("auto", 1, 3, ("nccl", "cuda:0")),   # one GPU per rank (CUDA_VISIBLE_DEVICES per rank)
])
def test_device_table(backend, gpus, local_rank, expected):
    placed = resolve_rank_device(backend, local_rank, gpus=gpus)
    assert (placed.backend, str(placed.device)) == expected


def test_device_table_refusals():
    with pytest.raises(ConfigError, match="parallel.backend: nccl needs a GPU"):
        resolve_rank_device("nccl", 0, gpus=0)
    with pytest.raises(ConfigError, match="local rank 4 but only 4 GPUs"):
        resolve_rank_device("auto", 4, gpus=4)
    with pytest.raises(ConfigError, match="parallel.backend"):
        resolve_rank_device("mpi", 0, gpus=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_nccl_without_gpu_is_exit_2_and_one_line(tmp_path):
    cmd = [sys.executable, "-m", "megatron_s2.cli", "train", str(RECIPE), *FAST, "parallel.backend=nccl",
           f"training.run_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.backend: nccl needs a GPU" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_to_device_moves_nested_batches_only():
    batch = {"tokens": torch.ones(2, 3, dtype=torch.long), "extra": [torch.zeros(1)], "name": "x"}
    moved = to_device(batch, torch.device("meta"))
    assert moved["tokens"].is_meta and moved["extra"][0].is_meta and moved["name"] == "x"
    assert to_device(batch, torch.device("cpu"))["tokens"] is batch["tokens"]


# ---- the audit ----------------------------------------------------------------------------------
def test_audit_flags_a_factory_without_device():
    """The net itself: code compiled as if it lived in megatron_s2 is reported, with its line."""
    fake = str(ROOT / "megatron_s2" / "training" / "forgetful.py")
    code = compile("a = torch.zeros(3)\nb = torch.zeros(3, device='cpu')\nc = torch.empty_like(a)\n", fake, "exec")
    with DeviceAudit() as audit:
        exec(code, {"torch": torch})
    assert [str(c) for c in audit.offenders] == ["megatron_s2/training/forgetful.py:1: torch.zeros(...) without device="]


def _train(run_dir: Path, steps: int, *extra: str, rank: int = 0, world: int = 1):
    from megatron_s2.training.trainer import Trainer

    recipe = load_recipe(RECIPE, [*FAST, *extra, f"training.train_steps={steps}", f"training.run_dir={run_dir}"])
    trainer = Trainer(recipe, run_dir, rank=rank, world_size=world, log=lambda *a, **k: None)
    with DeviceAudit() as audit:
        result = trainer.train()
    return trainer, result, audit


def test_train_step_checkpoint_and_resume_name_their_device(tmp_path):
    _, first, audit = _train(tmp_path / "run", 1, "checkpoint.save_interval=1")
    assert audit.offenders == [], "factories without device= in a train step:\n" + audit.report()
    trainer, resumed, audit = _train(tmp_path / "run", 2, "checkpoint.save_interval=1")
    assert resumed.steps_run == 1 and trainer.device == torch.device("cpu")
    assert audit.offenders == [], "factories without device= while resuming:\n" + audit.report()


LAYOUTS = {
    "pp2": ["parallel.pp=2"],                                   # p2p buffers, payloads, shadows
    "cp2": ["parallel.cp=2"],                                   # chunking, halos, gathered compression
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],                                   # token all-to-all
    "dp2_zero1_engram2": ["parallel.distributed_optimizer=true", "parallel.engram_parallel=2"],
}


def _parallel_worker(rank: int, world: int, out_dir: str) -> None:
    found = {}
    for name, layout in LAYOUTS.items():
        _, _, audit = _train(Path(out_dir) / name, 1, *layout, "checkpoint.save_interval=1", rank=rank, world=world)
        found[name] = [str(c) for c in audit.offenders]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.slow
def test_parallel_steps_name_their_device(tmp_path):
    """Every parallel runtime on two ranks: one step and a sharded save each."""
    run_distributed(2, _parallel_worker, str(tmp_path))
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found == {name: [] for name in LAYOUTS}, found


def test_inference_engine_names_its_device():
    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
    from megatron_s2.models.v41.model import build_model

    cfg = load_model_recipe("tiny").replace(fp4_main_kv=True, fp8_swa_kv=True, fp4_indexer=True)
    model = build_model(cfg, seed=0).eval()
    prompts = [list(range(5, 5 + n)) for n in (13, 5, 20)]
    with DeviceAudit() as audit:
        engine = InferenceEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, prefill_chunk=6,
                                                     max_prefill_tokens=8, page_tokens=8))
        engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=3,
                                                logprobs=2, record_routing=True))
        engine.pause()
        engine.update_weights(model)
        engine.resume()
        engine.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0))
    assert audit.offenders == [], "factories without device= in the engine:\n" + audit.report()


# ---- construction follows the device ----------------------------------------------------------------
def _module_tensors(model):
    """Parameters, buffers and plain tensor attributes of every module."""
    for mname, module in model.named_modules():
        for name, value in vars(module).items():
            if torch.is_tensor(value):
                yield f"{mname}.{name}", value
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            yield f"{mname}.{name}", t


@pytest.mark.parametrize("stage", ["whole", "pipeline_stage"])
def test_model_built_on_a_device_lives_there(stage):
    from megatron_s2.models.v41.model import V41Model

    cfg = load_model_recipe("tiny")
    kwargs = {} if stage == "whole" else dict(layers=[4, 5, 6, 7], pre_process=False)
    with build_on(torch.device("meta")):
        model = V41Model(cfg, **kwargs).init_weights(seed=0)  # initial values drawn on the host
    model.to("meta")
    elsewhere = [(name, t.device) for name, t in _module_tensors(model) if not t.is_meta]
    assert elsewhere == []


# ---- precision map ----------------------------------------------------------------------------------
def test_float32_masters_with_bfloat16_gemms():
    from megatron_s2.models.v41.model import build_model
    from megatron_s2.parallel.linear import ColumnParallelLinear

    cfg = load_model_recipe("tiny").replace(compute_dtype="bfloat16")
    model = build_model(cfg, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights
    seen = {}

    def record(module, args, out):
        seen[type(module).__name__] = (args[0].dtype, out.dtype)

    model.layers["1"].attention.linear_q_up.register_forward_hook(record)
    model.output_layer.register_forward_hook(record)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    assert isinstance(model.layers["1"].attention.linear_q_up, ColumnParallelLinear)
    assert seen["ColumnParallelLinear"][1] == torch.bfloat16  # the GEMM ran in bfloat16
    assert seen["VocabParallelHead"][1] == torch.float32       # LM head: a float32 island
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert torch.isfinite(loss)
