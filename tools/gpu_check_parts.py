"""The parts of ``tools/gpu_check.sh`` (driven by :mod:`tools.gpu_check`, one process per part).

Each ``part_<name>(ctx)`` returns ``{"checks": [...], "figures": {...}, "notes": [...]}``; a
check is ``{"name", "ok", "value", "limit"}``. ``ctx.smoke`` selects tiny shapes on CPU
(Triton under ``TRITON_INTERPRET=1``) so the test suite can run every part in seconds.

Parts: ``env`` (versions, dependencies, the device table), ``kernel_parity`` (Triton vs the
PyTorch references on the device), ``kernel_bench`` (``bench/kernels.py``: TFLOP/s, GB/s and
the fraction of the roofline), ``train_parity`` (tiny and small models: the same steps on
the device and on CPU in this process, losses compared), ``main_recipe``
(``recipes/pretrain_tiny.yaml`` with tp = pp = 1 through ``megatron-s2 train``), ``layer_mfu``
(one flagship-shaped layer, bf16 and FP8 experts) and ``decode`` (engine decode equals the
full forward; ``megatron-s2 generate`` on the main run's checkpoint).
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap_imports() -> None:
    """Make ``megatron_s2`` (and its ``kernels`` / ``launcher`` / ``tools`` subpackages, which
    live at the repository's top level) importable whether or not ``pip install -e .`` worked."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import megatron_s2.kernels  # noqa: F401
        import megatron_s2.launcher  # noqa: F401
    except ImportError:
        import megatron_s2

        if str(ROOT) not in megatron_s2.__path__:
            megatron_s2.__path__.append(str(ROOT))


@dataclass
class Context:
    device: str
    out: Path
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def check(name: str, ok: bool, value=None, limit=None) -> dict:
    return {"name": name, "ok": bool(ok), "value": value, "limit": limit}


def _result(checks=(), figures=None, notes=()) -> dict:
    return {"checks": list(checks), "figures": dict(figures or {}), "notes": list(notes)}


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _max_rel(a, b) -> float:
    """max |a - b| / max(|b|, tiny): the error relative to the reference's scale."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- env -------------------------------------------------------------------------------------------
def part_env(ctx: Context) -> dict:
    import importlib.util

    import torch

    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
               "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
               "pip_install": os.environ.get("GPU_CHECK_PIP", "not run")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2 ** 30, 1))
    deps = {}
    for name in ("triton", "numpy", "yaml", "safetensors", "megatron.core", "transformer_engine", "tensorboard", "tqdm"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        deps[name] = found
    if deps["triton"]:
        import triton

        figures["triton"] = triton.__version__
    figures["dependencies"] = deps
    from megatron_s2.models.v41.spec import MODULE_SPEC_SOURCE
    from megatron_s2.runtime.device import resolve_rank_device

    figures["module_spec"] = MODULE_SPEC_SOURCE
    placed = resolve_rank_device("auto", 0)
    figures["rank_device"] = f"{placed.backend} / {placed.device}"
    checks = [check("numpy, PyYAML importable (needed by every training part)", deps["numpy"] and deps["yaml"],
                    {k: deps[k] for k in ("numpy", "yaml")}),
              check("triton importable", deps["triton"])]
    if ctx.cuda:
        checks.append(check("auto backend picks nccl + cuda:0", str(placed.device) == "cuda:0", figures["rank_device"]))
    notes = [] if deps["transformer_engine"] else ["Transformer Engine not installed: the TE provider is not checked"]
    return _result(checks, figures, notes)


# ---- kernel parity ---------------------------------------------------------------------------------
def part_kernel_parity(ctx: Context) -> dict:
    import torch

    from megatron_s2.kernels import quant_formats as qf
    from megatron_s2.kernels.engram import engram_rows_reference, fp8_row_block
    from megatron_s2.kernels.fp8_gemm import _ONE_CALL_OK, fp8_linear
    from megatron_s2.kernels.indexer import indexer_scores_reference
    from megatron_s2.kernels.sparse_attention import sparse_attention_eager
    from megatron_s2.kernels.triton.engram import engram_rows_triton
    from megatron_s2.kernels.triton.indexer import indexer_scores_triton
    from megatron_s2.kernels.triton.quant import dequantize_triton, quantize_triton
    from megatron_s2.kernels.triton.sparse_attention import sparse_attention_triton
    from megatron_s2.kernels.quantize import fake_quant_reference

    dev = torch.device(ctx.device)
    g = torch.Generator().manual_seed(0)
    checks, figures = [], {}
    # CSA2 sparse attention: forward, probability mass and backward, float32 and bfloat16.
    b, s, h, d, n, k = (1, 6, 2, 16, 12, 10) if ctx.smoke else (2, 256, 16, 128, 512, 192)
    q, kv, sink = torch.randn(b, s, h, d, generator=g), torch.randn(b, n, d, generator=g), torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, s, k), generator=g)
    idx = torch.where(torch.rand(b, s, k, generator=g) < 0.2, -1, idx)
    q, kv, sink, idx = (t.to(dev) for t in (q, kv, sink, idx))
    a = [t.clone().requires_grad_() for t in (q, kv, sink)]
    r = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out, mass = sparse_attention_triton(a[0], a[1], idx, a[2], d ** -0.5, split=k // 2)
    ref, ref_mass = sparse_attention_eager(r[0], r[1], idx, r[2], d ** -0.5, split=k // 2)
    grad = torch.randn(out.shape, generator=g).to(dev)
    (out * grad).sum().backward()
    (ref * grad).sum().backward()
    errs = {"out": _max_rel(out, ref), "mass": _max_rel(mass, ref_mass),
            **{f"d{name}": _max_rel(x.grad, y.grad) for name, x, y in zip(("q", "kv", "sink"), a, r)}}
    figures["sparse_attention_fp32_rel_err"] = errs
    checks.append(check("sparse attention fp32 fwd/mass/bwd vs reference", max(errs.values()) <= 1e-4,
                        max(errs.values()), 1e-4))
    out16, _ = sparse_attention_triton(q.bfloat16(), kv.bfloat16(), idx, sink, d ** -0.5)
    ref16, _ = sparse_attention_eager(q.bfloat16(), kv.bfloat16(), idx, sink, d ** -0.5)
    err16 = _max_rel(out16, ref16)
    checks.append(check("sparse attention bf16 fwd vs reference", err16 <= 2e-2, err16, 2e-2))
    # Indexer scores.
    hi, di = (2, 32) if ctx.smoke else (32, 128)
    qi, ki = torch.randn(b, s, hi, di, generator=g).to(dev), torch.randn(b, n, di, generator=g).to(dev)
    wi = torch.randn(b, s, hi, generator=g).to(dev)
    err = _max_rel(indexer_scores_triton(qi, ki, wi), indexer_scores_reference(qi, ki, wi))
    checks.append(check("indexer scores fp32 vs reference", err <= 1e-5, err, 1e-5))
    # Quantisers: packed bytes, unpacked values and fake quantisation, bit for bit.
    x = torch.randn(64, 128, generator=g) * torch.logspace(-8, 2, 64).unsqueeze(1)  # E4M3 scales stay finite
    mismatches = {}
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dev, dtype)
        for fmt, pack, unpack, block in (("fp4_e4m3", qf.pack_fp4_e4m3, qf.unpack_fp4_e4m3, 16),
                                         ("mxfp4", qf.pack_mxfp4, qf.unpack_mxfp4, 32),
                                         ("fp8", qf.pack_fp8, qf.unpack_fp8, 32)):
            deq, codes, scales = quantize_triton(xd, fmt, packed=True)
            rc, rs = pack(xd)
            bad = int((codes.view(torch.uint8) != rc.view(torch.uint8)).sum())
            bad += int((scales.view(torch.uint8) != rs.view(torch.uint8)).sum())
            bad += int((dequantize_triton(codes, scales, fmt).view(torch.int32) != unpack(rc, rs).view(torch.int32)).sum())
            bad += int(((xd + (deq - xd)).view(torch.uint8)
                        != fake_quant_reference(xd, fmt, block).contiguous().view(torch.uint8)).sum())
            mismatches[f"{fmt}_{str(dtype)[6:]}"] = bad
    figures["quant_mismatched_bytes"] = mismatches
    checks.append(check("FP4 / MXFP4 / FP8 quantisers bit-identical", sum(mismatches.values()) == 0,
                        sum(mismatches.values()), 0))
    # Engram gather + FP8 rows: forward bit-identical, backward = embedding backward.
    rows, width = (50, 32) if ctx.smoke else (100_000, 256)
    for dtype in (torch.float32, torch.bfloat16):
        table = (torch.randn(rows, width, generator=g) * 0.02).to(dev, dtype).requires_grad_()
        ids = torch.randint(0, rows, (4, 16 if ctx.smoke else 4096, 6), generator=g).to(dev)
        ref_table = table.detach().clone().requires_grad_()
        got, want = engram_rows_triton(ids, table, fp8_row_block(width)), engram_rows_reference(ids, ref_table, True)
        gr = torch.randn(got.shape, generator=g).to(dev, dtype)
        got.backward(gr)
        want.backward(gr)
        same = bool(torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)))
        gerr = _max_rel(table.grad, ref_table.grad)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        checks.append(check(f"engram gather+FP8 {str(dtype)[6:]}: forward bit-identical, row grads vs embedding backward",
                            same and gerr <= tol, {"forward_identical": same, "grad_rel_err": gerr}, tol))
    # Native FP8 GEMM (DeepSeek-V3 blockwise) against the bf16 GEMM.
    m, kk, nn_ = (64, 256, 128) if ctx.smoke else (4096, 5120, 2304)
    xa = torch.randn(m, kk, generator=g).to(dev, torch.bfloat16).requires_grad_()
    wa = (torch.randn(nn_, kk, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_()
    y = fp8_linear(xa, wa, 128)
    y_ref = torch.nn.functional.linear(xa.float(), wa.float())
    ferr = _max_rel(y, y_ref)
    y.float().sum().backward()
    checks.append(check("native FP8 blockwise GEMM vs float32 GEMM (relative)", ferr <= 6e-2, ferr, 6e-2))
    checks.append(check("native FP8 GEMM backward finite", bool(torch.isfinite(xa.grad).all() and torch.isfinite(wa.grad).all())))
    figures["fp8_gemm_one_call_block_scaled"] = {str(key): ok for key, ok in _ONE_CALL_OK.items()} or "per-slice path"
    return _result(checks, figures)


# ---- kernel throughput -----------------------------------------------------------------------------
def part_kernel_bench(ctx: Context) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    out = ctx.out / "kernel_bench.jsonl"
    argv = ["--smoke"] if ctx.smoke else ["--device", ctx.device, "--repeats", "5"]
    bench.main([*argv, "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    figures = {r["kernel"]: {k: v for k, v in r.items() if k != "kernel"} for r in rows}
    checks = []
    for r in rows:
        if "error" in r:
            checks.append(check(f"{r['kernel']}: runs", False, r["error"]))
            continue
        exact = r["kernel"].startswith(("pack_", "engram"))
        limit = 0 if exact else 5e-2
        checks.append(check(f"{r['kernel']}: result matches the reference", r["max_abs_err_or_mismatches"] <= limit,
                            r["max_abs_err_or_mismatches"], limit))
    return _result(checks, figures, ["roofline: H200 dense BF16 989 TFLOP/s, HBM3e 4800 GB/s (bench/kernels.py)"])


# ---- training: device vs CPU -----------------------------------------------------------------------
def _recipe(model: str, run_dir: Path, extra: list[str]):
    from megatron_s2.config.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / "pretrain_tiny.yaml", [
        f"model={model}", "parallel.tp=1", "parallel.pp=1", "parallel.dp=0", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.log_interval=1000", "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false", "checkpoint.resume=false", "schedule.warmup_steps=1",
        "data.num_documents=500", f"training.run_dir={run_dir}", *extra])


def _train_losses(model: str, device: str, run_dir: Path, extra: list[str], steps: int,
                  optimizer: bool = True) -> tuple[list[float], list[float], float]:
    """Losses and gradient norms (before clipping) of the first ``steps`` steps of ``model``
    on ``device``; ``optimizer=False``: one forward/backward only (the CPU side of the small
    model, whose Muon step costs minutes on a CPU)."""
    import torch

    from megatron_s2.parallel.grad_finalize import clip_grads
    from megatron_s2.training.trainer import Trainer

    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = Trainer(_recipe(model, run_dir, extra), run_dir, log=lambda *a, **k: None, device=device)
    losses, norms = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.schedule.apply(trainer.optimizer, trainer.step)
        result = trainer.compute_gradients(trainer.data.next_step())
        losses.append(result.loss)
        if optimizer:
            norms.append(trainer.apply_gradients(result.loss))
        else:
            norms.append(float(clip_grads(trainer.params, 0.0, trainer.groups)))
    _sync(device)
    elapsed = time.perf_counter() - t0
    del trainer
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return losses, norms, elapsed


def part_train_parity(ctx: Context) -> dict:
    checks, figures = [], {}
    batch = ["training.global_batch_size=4", "training.micro_batch_size=2"]
    # (model, overrides, steps compared, optimizer step on the CPU side)
    plan = [("tiny", ["training.seq_length=64", *batch], 2, True),
            ("small", ["training.seq_length=64", "training.global_batch_size=2", "training.micro_batch_size=2"], 1, False)]
    if ctx.smoke:
        plan = [("tiny", ["training.seq_length=32", "training.global_batch_size=2", "training.micro_batch_size=2"], 2, True)]
    for model, extra, steps, cpu_optimizer in plan:
        ref, ref_norm, t_cpu = _train_losses(model, "cpu", ctx.out / "runs" / f"{model}_cpu", extra, steps, cpu_optimizer)
        got, got_norm, t_dev = _train_losses(model, ctx.device, ctx.out / "runs" / f"{model}_dev", extra, steps)
        rel = max(abs(a - b) / abs(b) for a, b in zip(got + got_norm, ref + ref_norm))
        tol = 1e-3
        figures[model] = {"cpu_losses": ref, "device_losses": got, "cpu_grad_norms": ref_norm,
                          "device_grad_norms": got_norm, "max_rel_diff": rel, "cpu_s": t_cpu, "device_s": t_dev}
        what = f"{steps} steps" if cpu_optimizer else "first step"
        checks.append(check(f"{model}: fp32 losses and gradient norms on {ctx.device} equal CPU's ({what}, relative)",
                            rel <= tol, rel, tol))
        if not ctx.smoke:  # the GPU precision: float32 master weights, bfloat16 GEMMs
            bf, bf_norm, t_bf = _train_losses(model, ctx.device, ctx.out / "runs" / f"{model}_bf16",
                                              [*extra, "model.compute_dtype=bfloat16"], steps)
            rel_bf = max(abs(a - b) / abs(b) for a, b in zip(bf, ref))
            figures[model].update(bf16_losses=bf, bf16_grad_norms=bf_norm, bf16_max_rel_loss_diff=rel_bf, bf16_s=t_bf)
            checks.append(check(f"{model}: bf16-compute losses within 3% of fp32 CPU", rel_bf <= 3e-2, rel_bf, 3e-2))
    return _result(checks, figures)


# ---- the main recipe through the CLI ---------------------------------------------------------------
def _cli(args: list[str], timeout: float, log: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}\n")
    return done


def part_main_recipe(ctx: Context) -> dict:
    run = ctx.out / "runs" / "main"
    shutil.rmtree(run, ignore_errors=True)
    steps = 3 if ctx.smoke else 30
    warmup = min(5, steps - 1)
    args = ["train", str(ROOT / "recipes" / "pretrain_tiny.yaml"), "parallel.tp=1", "parallel.pp=1",
            f"training.train_steps={steps}", f"training.run_dir={run}", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.log_interval=10", "checkpoint.save_interval=0",
            f"schedule.warmup_steps={warmup}", f"schedule.decay_start_step={steps}", f"schedule.decay_end_step={steps + 1}"]
    if ctx.smoke:
        args += ["parallel.backend=gloo", "training.seq_length=32", "training.global_batch_size=4",
                 "training.micro_batch_size=2", "data.num_documents=200"]
    else:
        args += ["model.compute_dtype=bfloat16"]
    done = _cli(args, 170, ctx.out / "logs" / "main_recipe_cli.log")
    checks = [check("megatron-s2 train exits 0", done.returncode == 0, done.returncode)]
    device_line = next((line for line in done.stdout.splitlines() if line.startswith("device: ")), "")
    want = "cpu" if ctx.smoke else "cuda:0"
    checks.append(check(f"trained on {want} (start-up log)", device_line.startswith(f"device: {want}"), device_line))
    figures = {}
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        losses = [r["loss"] for r in records]
        k = min(5, max(1, len(losses) // 2))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        steady = records[len(records) // 2:] or records
        figures = {"losses": losses, "first_mean": first, "last_mean": last,
                   "step_time_s": sum(r["step_time_s"] for r in steady) / len(steady),
                   "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
                   "mfu": steady[-1].get("mfu")}
        checks.append(check("losses finite", all(math.isfinite(v) for v in losses)))
        if not ctx.smoke:
            checks.append(check("loss falls (mean of last 5 < mean of first 5 - 0.1)", last < first - 0.1,
                                round(first - last, 4), 0.1))
    else:
        checks.append(check("metrics.jsonl written", False, str(metrics)))
    return _result(checks, figures, [f"run directory: {run}"])


# ---- MFU of one flagship-shaped layer --------------------------------------------------------------
def load_model_config(name: str):
    """``recipes/models/<name>.yaml`` as a V41Config."""
    from megatron_s2.config.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / "pretrain_tiny.yaml", [f"model={name}"]).model


def _flagship_layer(smoke: bool, fp8: bool):
    from megatron_s2.config.fp8 import FP8Config
    from megatron_s2.models.v41.config import LayerGroupSpec

    base = load_model_config("tiny" if smoke else "flagship")
    fp8_cfg = FP8Config(recipe="blockwise", experts=True, attention=False, block=16 if smoke else 128) if fp8 else FP8Config()
    # One encoder CSA2 Full layer (m = 2) with the flagship's widths; 48 routed experts = the
    # flagship's 384 on one rank of expert parallelism 8 (6 active per token either way).
    return base.replace(name="flagship_layer", vocab_size=256, num_encoder_layers=1,
                        layer_groups=(LayerGroupSpec(("full",), 1, 2),), engram_layers=(),
                        num_routed_experts=8 if smoke else 48, candidate_topk_blocks=0,
                        params_dtype="float32", compute_dtype="float32" if smoke else "bfloat16", fp8=fp8_cfg)


def part_layer_mfu(ctx: Context) -> dict:
    import torch

    from megatron_s2.training.metrics import device_peak_tflops

    dev = torch.device(ctx.device)
    seq = 64 if ctx.smoke else 4096
    peak = device_peak_tflops() if ctx.cuda else None
    checks, figures = [], {"seq_length": seq, "peak_tflops": peak}
    for label, fp8 in (("bf16", False), ("fp8_experts", True)):
        try:
            fig = _time_layer(ctx, dev, seq, peak, fp8)
        except Exception as exc:  # e.g. a kernel that does not compile at this shape: the other mode still runs
            fig = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            gc.collect()  # the model of this mode is gone before the next one is built
            if ctx.cuda:
                torch.cuda.empty_cache()
        if "error" in fig:
            figures[label] = fig
            checks.append(check(f"{label}: forward + backward of the layer", False, fig["error"]))
            continue
        figures[label] = fig
        checks.append(check(f"{label}: finite loss and a positive rate", math.isfinite(fig["loss"]) and fig["model_tflops"] > 0,
                            round(fig["model_tflops"], 3)))
    notes = ["FLOPs from models/v41/accounting.py (sparse attention counted as sparse, 6 active experts per token); "
             "MFU against the dense BF16 peak also for the FP8 run"]
    return _result(checks, figures, notes)


def _fast_init(model, std: float) -> None:
    """The model's initialisation, except that tensors above 16M elements (the experts: plain
    N(0, std) in the model too) are drawn on the device instead of on the host."""
    import torch

    from megatron_s2.models.init import normal_init
    from megatron_s2.parallel.sharding import init_from_full

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() > (1 << 24):
                p.normal_(0.0, std)
            else:
                init_from_full(p, name, 0, normal_init(std))
    model.apply_precision_map()


def _time_layer(ctx: Context, dev, seq: int, peak, fp8: bool) -> dict:
    import torch

    from megatron_s2.models.v41.accounting import train_flops_per_token
    from megatron_s2.models.v41.model import V41Model
    from megatron_s2.runtime.device import build_on

    cfg = _flagship_layer(ctx.smoke, fp8)
    with build_on(dev):
        model = V41Model(cfg)
    _fast_init(model, cfg.init_std)
    model.to(dev).train()
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(dev)

    def step():
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    loss = step()  # warm-up: Triton compilation, FP8 path selection
    _sync(dev)
    reps = 1 if ctx.smoke else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        loss = step()
    _sync(dev)
    dt = (time.perf_counter() - t0) / reps
    flops = train_flops_per_token(cfg, seq) * seq
    tflops = flops / dt / 1e12
    fig = {"step_s": dt, "model_tflops": tflops, "mfu": (tflops / peak) if peak else None,
           "params": sum(p.numel() for p in model.parameters()), "loss": float(loss)}
    if ctx.cuda:
        fig["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        torch.cuda.reset_peak_memory_stats(dev)
    return fig




# ---- decode on the device ---------------------------------------------------------------------------
def part_decode(ctx: Context) -> dict:
    import torch

    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
    from megatron_s2.models.v41.model import V41Model
    from megatron_s2.runtime.device import build_on

    dev = torch.device(ctx.device)
    checks, figures = [], {}
    prompts = [list(range(5, 5 + n)) for n in (13, 5, 20)]
    # FP4/FP8 KV: a last-bit difference between the full forward's and the decode's GEMM shapes
    # can move a value across a quantisation boundary on a GPU, hence the wider limit there.
    for label, quant, tol in (("fp32 KV", False, 1e-4), ("fp4/fp8 KV", True, 1e-4 if ctx.smoke else 2e-3)):
        cfg = load_model_config("tiny").replace(fp4_main_kv=quant, fp8_swa_kv=quant, fp4_indexer=quant)
        with build_on(dev):
            model = V41Model(cfg).init_weights(1)
        model.to(dev).eval()
        engine = InferenceEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, prefill_chunk=6,
                                                     max_prefill_tokens=8, page_tokens=8))
        results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1))
        worst, flips = 0.0, 0
        for prompt, r in zip(prompts, results):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + r.token_ids], device=dev))[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits, -1)
            chosen = torch.tensor(r.token_ids, device=dev)
            got = torch.tensor(r.logprobs, device=dev)
            worst = max(worst, float((got - ref.gather(1, chosen[:, None])[:, 0]).abs().max()))
            top2 = ref.topk(2, dim=-1)
            for t, tok in enumerate(r.token_ids):  # a different argmax only within a numerical tie
                if tok != int(top2.indices[t, 0]) and float(top2.values[t, 0] - ref[t, tok]) > 1e-4:
                    flips += 1
        figures[label] = {"max_abs_logprob_diff": worst, "non_tie_token_mismatches": flips}
        checks.append(check(f"decode ({label}) equals the full forward on {ctx.device}", worst <= tol and flips == 0,
                            {"max_abs_logprob_diff": worst, "mismatches": flips}, tol))
    run = ctx.out / "runs" / "main"
    if (run / "checkpoints").is_dir():
        done = _cli(["generate", str(run), "--prompt", "2+2=", "--max-tokens", "12", "--temperature", "0",
                     "--device", ctx.device], 90, ctx.out / "logs" / "decode_generate_cli.log")
        checks.append(check("megatron-s2 generate on the main run's checkpoint exits 0", done.returncode == 0,
                            done.returncode))
        figures["generate_output"] = done.stdout.strip()[-200:]
    return _result(checks, figures)


PARTS = {
    "env": part_env,
    "kernel_parity": part_kernel_parity,
    "kernel_bench": part_kernel_bench,
    "train_parity": part_train_parity,
    "main_recipe": part_main_recipe,
    "layer_mfu": part_layer_mfu,
    "decode": part_decode,
}
