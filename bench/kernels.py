"""Kernel parity and throughput: each Triton kernel against its PyTorch reference.

    python bench/kernels.py --device cuda            # flagship-like shapes, TFLOP/s and GB/s
    TRITON_INTERPRET=1 python bench/kernels.py --device cpu --tiny    # smoke run on CPU
    python bench/kernels.py --smoke                  # the same (sets TRITON_INTERPRET=1 itself)

For every kernel: max |triton - reference| (and bit-equality for the quantisers), median time
of the Triton kernel and of the reference, achieved TFLOP/s (GEMM-like kernels) or GB/s
(memory-bound ones) and, with ``--peak-tflops`` / ``--peak-gbs`` (defaults: H200 dense BF16
989 TFLOP/s, HBM3e 4800 GB/s), the fraction of that roofline. One JSON line per kernel is
printed after the table (``--json`` writes them to a file) for tools/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _time(fn, device, repeats):
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases(args):
    import torch

    from megatron_s2.kernels import quant_formats as qf
    from megatron_s2.kernels.indexer import indexer_scores_reference
    from megatron_s2.kernels.sparse_attention import sparse_attention_reference
    from megatron_s2.kernels.triton.indexer import indexer_scores_triton
    from megatron_s2.kernels.triton.quant import quantize_triton
    from megatron_s2.kernels.triton.sparse_attention import sparse_attention_triton

    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    if args.tiny:
        s, h, d, n, k, hi, di = 8, 4, 32, 24, 20, 4, 32
    else:  # one flagship decoder layer's attention on 8K tokens (64 heads x 512, top-512 + window 128)
        s, h, d, n, k, hi, di = 8192, 64, 512, 8192, 640, 32, 128
    q = torch.randn(1, s, h, d, generator=g).to(dev, dt)
    kv = torch.randn(1, n, d, generator=g).to(dev, dt)
    idx = torch.randint(0, n, (1, s, k), generator=g).to(dev)
    sink = torch.zeros(h, device=dev)
    flops = 4 * s * h * k * d
    yield ("sparse_attention_fwd", flops, None,
           lambda: sparse_attention_triton(q, kv, idx, sink, d ** -0.5)[0],
           lambda: sparse_attention_reference(q, kv, idx, sink, d ** -0.5)[0])
    qi = torch.randn(1, s, hi, di, generator=g).to(dev, dt)
    ki = torch.randn(1, n, di, generator=g).to(dev, dt)
    wi = torch.randn(1, s, hi, generator=g).to(dev)
    yield ("indexer_scores", 2 * s * hi * n * di, None, lambda: indexer_scores_triton(qi, ki, wi),
           lambda: indexer_scores_reference(qi.float(), ki.float(), wi))
    x = torch.randn(s, 512 if not args.tiny else 64, generator=g).to(dev, dt)
    for fmt, pack in (("fp4_e4m3", qf.pack_fp4_e4m3), ("mxfp4", qf.pack_mxfp4), ("fp8", qf.pack_fp8)):
        moved = x.numel() * x.element_size() + x.numel() // (2 if fmt != "fp8" else 1)
        yield (f"pack_{fmt}", None, moved, lambda fmt=fmt: quantize_triton(x, fmt, dequantized=False, packed=True)[1],
               lambda pack=pack: pack(x)[0])
    # Engram: rows of 8K tokens x 24 hashed n-grams (3 orders x 8 heads, 256 channels) from a
    # 1M-row table, FP8 fake-quantised (forward), and the row-gradient sum (backward).
    from megatron_s2.kernels.engram import engram_rows_reference
    from megatron_s2.kernels.triton.engram import gather_quant_rows, scatter_row_grads

    rows, width, tokens = (251, 32, 8 * 6) if args.tiny else (1 << 20, 256, 8192 * 24)
    table = torch.randn(rows, width, generator=g).to(dev, dt)
    ids = torch.randint(0, rows, (tokens,), generator=g).to(dev)
    e = table.element_size()
    yield ("engram_gather_fp8", None, 2 * tokens * width * e + tokens * 8,
           lambda: gather_quant_rows(ids, table, 32), lambda: engram_rows_reference(ids, table, True))
    grad = torch.randn(tokens, width, generator=g).to(dev, dt)
    uniq = int(torch.unique(ids).numel())
    yield ("engram_row_grads", None, (tokens + rows + uniq) * width * e + tokens * 8,
           lambda: scatter_row_grads(ids, grad, rows),
           lambda: torch.zeros(rows, width, dtype=torch.float32, device=dev).index_add_(0, ids, grad.float()).to(dt))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    p.add_argument("--smoke", action="store_true", help="--device cpu --tiny under the Triton interpreter")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--peak-gbs", type=float, default=4800.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.smoke:  # must precede the first import of triton
        args.device = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {args.device} (the default): no CUDA GPU is visible to torch {torch.__version__}; "
                    "on CPU use --smoke (Triton interpreter, tiny shapes)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 (Triton runs on CPU tensors only under the interpreter)")
    if args.device == "cpu":
        args.tiny, args.dtype, args.repeats = True, "float32", 1
    rows = []
    for name, flops, moved, fast, ref in cases(args):
        try:
            rows.append(_measure(name, flops, moved, fast, ref, args))
        except Exception as exc:  # one kernel failing (compile, memory) must not hide the others
            rows.append({"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    print(f"{'kernel':<22} {'err':>10} {'triton ms':>10} {'ref ms':>10} {'speedup':>8} {'TFLOP/s|GB/s':>13} {'roofline':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<22} ERROR {r['error']}")
            continue
        rate = r.get("tflops", r.get("gbs", float("nan")))
        print(f"{r['kernel']:<22} {r['max_abs_err_or_mismatches']:10.3g} {r['triton_ms']:10.3f} {r['reference_ms']:10.3f} "
              f"{r['speedup']:8.2f} {rate:13.3f} {r.get('roofline_fraction', float('nan')):9.3f}")
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 1 if any("error" in r for r in rows) else 0


def _measure(name, flops, moved, fast, ref, args) -> dict:
    import torch

    out, expected = fast(), ref()
    if out.dtype == torch.uint8 or expected.dtype == torch.uint8:
        err = float((out.view(torch.uint8) != expected.view(torch.uint8)).sum())
    else:
        err = float((out.float() - expected.float()).abs().max())
    t_fast = _time(fast, torch.device(args.device), args.repeats)
    t_ref = _time(ref, torch.device(args.device), args.repeats)
    row = {"kernel": name, "max_abs_err_or_mismatches": err, "triton_ms": t_fast * 1e3, "reference_ms": t_ref * 1e3,
           "speedup": t_ref / t_fast}
    if flops:
        row["tflops"] = flops / t_fast / 1e12
        row["roofline_fraction"] = row["tflops"] / args.peak_tflops
    if moved:
        row["gbs"] = moved / t_fast / 1e9
        row["roofline_fraction"] = row["gbs"] / args.peak_gbs
    return row


if __name__ == "__main__":
    sys.exit(main())
