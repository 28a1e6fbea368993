"""Every benchmark in bench/ runs in a smoke configuration (seconds, no timing asserted).

A refactor that breaks a benchmark fails here instead of when someone tries to reproduce the
README's figures (reproduced break: ``bench/pipeline_bubble.py`` crashed on main after
``PipelineRuntime.export()`` gained an argument). Each script is run as a user would, with
``--smoke``: the smallest configuration that still goes through every part and prints every
table.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

# script -> lines its smoke run must print (table headers of every part)
EXPECTED = {
    "pipeline_bubble.py": ["(a) Idle fraction per rank", "(b) Step time, ours vs torch.distributed.pipelining",
                           "(c) Payload bytes per micro-batch per cut", "(d) Shared-state memory"],
    "comm_volume.py": ["tp2", "measured"],
    "csa2_vs_dense.py": ["CSA2 layer", "ratios to dense"],
    "kernels.py": ["sparse_attention", "speedup"],
    "kv_cache.py": ["decode", "MLA"],
    "decode.py": ["ms/token", "ratio"],
    "bounded_replay.py": ["KL mean", "prefill GFLOP", "train-aware replay on", "train-aware replay off"],
    "remote_teacher.py": ["in process", "endpoint, 2 in flight"],
    "hybrid_vs_full.py": ["training step", "mem ratio", "vs eager", "bytes per token per layer", "floor:", "decode",
                          "ms/token"],
    "speculative.py": ["plain tok/s", "acceptance per position", "ratio = speculative / plain"],
    "contrastive_overlap.py": ["ratio blocking/overlapped", "identical"],
    "timeseries_encoder.py": ["peak MiB", "time ratio"],
    "timeseries_forecast.py": ["horizon predictor", "MASE mean", "vs naive", "seasonal naive", "(acf lag)"],
    "memory_decoder.py": ["held-out perplexity", "fused/backbone", "mean lambda"],
    "memdec_objective_bytes.py": ["memdec:", "router:", "bytes per position x vocabulary entry"],
    "async_rl.py": ["(a) Step throughput", "ratio = disaggregated / co-located", "(b) Rollout accuracy per step"],
}


def _scripts() -> list[str]:
    """bench/*.py files that are programs (have a ``__main__`` block); the rest are libraries."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            found.append(path.name)
    return found


def test_every_benchmark_has_a_smoke_run():
    assert _scripts() == sorted(EXPECTED), "add the new bench script to EXPECTED (and give it --smoke)"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_smoke_run(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(BENCH / script), "--smoke"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    for line in EXPECTED[script]:
        assert line in result.stdout, (line, result.stdout[-3000:])


def test_benchmark_library_imports():
    """bench/ modules without a program (comm_model.py) at least import and evaluate."""
    sys.path.insert(0, str(BENCH))
    try:
        import comm_model  # noqa: F401
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_csa2_bench_help_and_bad_lengths():
    """`--help` listed `--impls csa2 csa2-selective csa2-ref csa2-eager dense` without saying what
    they are; `--min-seq 4096 --max-seq 1024` crashed with an IndexError traceback after parsing."""
    script = str(BENCH / "csa2_vs_dense.py")
    help_text = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120).stdout
    for impl in ("csa2-selective", "csa2-ref", "csa2-eager", "dense"):
        assert f"* **{impl}**" in help_text, help_text
    bad = subprocess.run([sys.executable, script, "--min-seq", "4096", "--max-seq", "1024"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--min-seq 4096" in bad.stderr, bad.stderr
    import torch

    if not torch.cuda.is_available():  # was "Torch not compiled with CUDA enabled" from a worker's traceback
        bad = subprocess.run([sys.executable, script, "--smoke", "--device", "cuda"], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no CUDA GPU" in bad.stderr, bad.stderr


def test_kernel_bench_without_gpu_says_so():
    """`python bench/kernels.py` (default --device cuda) on a CPU-only machine was an
    AssertionError traceback ("Torch not compiled with CUDA enabled")."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bad = subprocess.run([sys.executable, str(BENCH / "kernels.py")], capture_output=True, text=True, timeout=120,
                         env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--smoke" in bad.stderr, bad.stderr
