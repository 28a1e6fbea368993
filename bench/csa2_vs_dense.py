"""CSA2 attention layer vs dense causal attention: forward+backward time and peak memory.

    python bench/csa2_vs_dense.py [--max-seq 16384] [--repeats 3] [--warmup 1] [--threads N]
                                  [--device cpu|cuda] [--impls csa2 csa2-selective dense ...]
                                  [--loss upstream|square-mean] [--fixed-mmap-threshold]

Implementations (``--impls``; each is run in a fresh subprocess per length):

* **csa2**: one Full layer of ``--model`` (default ``recipes/models/small.yaml``, layer 1: an
  encoder Full layer, m = 2) exactly as the model builds it — its own query and sliding-window
  KV, the compressor, index keys, the indexer's full scan and top-k, sparse attention over
  window ∪ top-k with the sink, grouped low-rank output — in training mode, so the backward
  includes the indexer's alignment loss. The recipe's QAT switches apply (``--no-qat`` turns
  FP8/FP4 fake quantisation off). Kernels through the dispatch functions of
  :mod:`megatron_s2.kernels`: on CPU the memory-bounded PyTorch references (per-chunk recompute
  in backward), on CUDA the Triton kernels. No activation recomputation
  (``parallel.recompute: none``): the layer's eager path, one pass over all queries.
* **csa2-selective**: the same layer under selective recomputation (``parallel.recompute:
  selective``): the attention core and the indexer's alignment scores run in checkpointed
  query chunks, recomputed in backward (``CSA2Attention.attend``) — the memory-bounded path.
* **csa2-ref** (CUDA only): ``csa2`` with ``MEGATRON_S2_KERNELS=reference``.
* **csa2-eager** (not run by default): ``csa2`` with the sparse attention and the
  alignment-loss scores under plain autograd (``sparse_attention_eager``: every chunk's
  ``[b, chunk, k, d]`` gather kept for backward) — the kernels' oracle.
* **dense**: q/k/v/o projections of the same width (hidden, heads x head_dim) and
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

All run in float32 (``--dtype bfloat16`` on GPU for the training precision), batch 1. Both
sides get the same treatment: same width, heads and head dim, forward + backward, same dtype,
fresh process. The backward starts, by default (``--loss upstream``), from a fixed output
gradient made before the pass (as inside a model, where it comes from the layer above), plus
the CSA2 layer's own indexer alignment loss; ``--loss square-mean`` backpropagates
``out.square().mean()`` instead, whose ``[s, d]`` temporaries then count on both sides.

* **Time**: median wall time of ``--repeats`` forward+backward passes after ``--warmup``
  passes. On CPU the ratio of the fastest passes and the ratio of median process CPU time (all
  threads) are printed too: on a shared machine a gap between the three flags interference
  from other processes, and the CPU-time ratio is the least sensitive to it.
* **Peak memory**: on CPU the rise of the process's peak resident set (``VmHWM`` in
  /proc/self/status, reset through /proc/self/clear_refs) over the resident set just before
  one forward+backward, measured after the warm-up with freed heap memory returned to the OS
  (``malloc_trim``) and the warm-up's gradients freed before that baseline (else freeing them
  inside the pass would hide the input gradient and part of the weight gradients). It counts
  activations, saved tensors, the pass's gradients (input and parameters) and kernel
  workspaces; parameters, the input and the upstream gradient exist before it. Where clear_refs is not writable a 1 ms
  RSS sampler is used instead (the header says which). The resident set also holds glibc heap
  fragmentation (after the warm-up glibc raises its mmap threshold to ~32 MiB, so most tensors
  come from the heap); ``--fixed-mmap-threshold`` serves every allocation over 64 KiB by mmap,
  so the figure is the allocation peak itself. On CUDA: ``max_memory_allocated`` minus the
  allocation before the pass.

This is not part of the test suite; it prints one table with the ratios to dense side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("csa2", "csa2-selective", "csa2-ref", "csa2-eager", "dense")


# ---- worker: one (implementation, length) in its own process ---------------------------------------
def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakMeter:
    """Peak RSS rise during a block: VmHWM after a clear_refs reset, else a 1 ms sampler."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "rss-sampler-1ms"

    def __enter__(self):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = _rss_kib()
        if self.method == "VmHWM":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self.peak, self.stop = self.base, False

            def sample():
                while not self.stop:
                    self.peak = max(self.peak, _rss_kib())
                    time.sleep(0.001)

            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.method == "VmHWM":
            self.peak = _hwm_kib()
        else:
            self.stop = True
            self.thread.join()
            self.peak = max(self.peak, _rss_kib())
        self.rise_mib = max(self.peak - self.base, 0) / 1024


class CudaPeakMeter:
    """Peak CUDA allocation during a block over the allocation before it."""

    method = "cuda max_memory_allocated"

    def __enter__(self):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.synchronize()
        self.rise_mib = (torch.cuda.max_memory_allocated() - self.base) / 2 ** 20


def build(impl: str, args):
    import torch
    import torch.nn.functional as F
    import yaml
    from torch import nn

    from megatron_s2.models.v41.config import V41Config
    from megatron_s2.config.schema import from_mapping
    from megatron_s2.models.init import initialize_parameters
    from megatron_s2.models.v41.attention.csa2 import CSA2Attention
    from megatron_s2.models.v41.context import ForwardContext
    from megatron_s2.parallel.groups import ParallelGroups

    dtype = getattr(torch, args.dtype)
    cfg = from_mapping(V41Config, yaml.safe_load(Path(args.model).read_text()))
    if args.no_qat:
        cfg = cfg.replace(fp4_main_kv=False, fp8_swa_kv=False, fp4_indexer=False)
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

    if impl.startswith("csa2"):
        if impl == "csa2-ref":
            os.environ["MEGATRON_S2_KERNELS"] = "reference"
        if impl == "csa2-eager":
            import megatron_s2.models.v41.attention.csa2 as csa2_module
            import megatron_s2.models.v41.attention.indexer as indexer_module
            from megatron_s2.kernels.indexer import _eager_gathered
            from megatron_s2.kernels.sparse_attention import sparse_attention_eager

            csa2_module.sparse_attention = sparse_attention_eager
            indexer_module.indexer_gathered_scores = _eager_gathered
        spec = cfg.plan[args.layer]
        if spec.mode.value != "full":
            raise SystemExit(f"--layer {args.layer} is {spec.mode.value}; pick a Full layer")
        layer = CSA2Attention(cfg, spec, ParallelGroups.single())
        initialize_parameters(layer, 0, cfg.init_std)
        layer.to(device=args.device, dtype=dtype).train()
        layer.selective_recompute = impl == "csa2-selective"  # what V41Model.set_recompute sets

        def step(x, ids):
            ctx = ForwardContext.create(ids, cfg.plan)
            return layer(x, ctx), ctx.total_aux_loss()
    else:
        class DenseCausalAttention(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.k, self.v = (nn.Linear(d, h * hd, bias=False) for _ in range(3))
                self.o = nn.Linear(h * hd, d, bias=False)

            def forward(self, x):
                b, s, _ = x.shape
                q, k, v = (p(x).view(b, s, h, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.o(o.transpose(1, 2).reshape(b, s, h * hd))

        torch.manual_seed(0)
        layer = DenseCausalAttention().to(device=args.device, dtype=dtype)

        def step(x, ids):
            return layer(x), None

    return cfg, layer, step


def worker(impl: str, seq: int, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    cfg, layer, step = build(impl, args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, cfg.hidden_size, generator=g).to(args.device, getattr(torch, args.dtype)).requires_grad_()
    ids = torch.zeros(1, seq, dtype=torch.long, device=args.device)
    grad_out = torch.randn(x.shape, generator=g).to(x)

    def clear():
        for p in layer.parameters():
            p.grad = None
        x.grad = None

    def once():
        clear()
        out, aux = step(x, ids)
        if args.loss == "square-mean":
            loss = out.square().mean()
            (loss if aux is None else loss + aux).backward()
        else:  # the output's gradient arrives from above, as in a model (it exists before the pass)
            torch.autograd.backward([out] + ([aux] if aux is not None else []),
                                    [grad_out] + ([None] if aux is not None else []))
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        once()
    meter = CudaPeakMeter() if cuda else PeakMeter()
    clear()  # the warm-up's gradients go before the baseline: the pass's own new ones count in full
    with meter:
        once()
    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        once()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"impl": impl, "seq": seq, "median_s": statistics.median(times), "times_s": times,
            "median_cpu_s": statistics.median(cpu), "cpu_s": cpu,
            "peak_mib": meter.rise_mib, "memory_method": meter.method,
            "params": sum(p.numel() for p in layer.parameters()), "threads": torch.get_num_threads()}


# ---- driver ---------------------------------------------------------------------------------------------
def run_one(impl: str, seq: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, "--seq", str(seq), "--model", args.model,
           "--layer", str(args.layer), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype, "--loss", args.loss] + \
        (["--no-qat"] if args.no_qat else [])
    env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if args.fixed_mmap_threshold else {}))
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False, env=env)
    if res.returncode:
        raise SystemExit(f"{impl} at {seq} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import torch

    impl_doc = __doc__[__doc__.index("Implementations"):__doc__.index("All run in float32")].strip()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=impl_doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-seq", type=int, default=16384, help="largest sequence length (powers of two from --min-seq)")
    p.add_argument("--min-seq", type=int, default=1024, help="smallest sequence length (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes first")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads of each worker")
    p.add_argument("--model", default=str(REPO / "recipes" / "models" / "small.yaml"), help="model YAML (default small)")
    p.add_argument("--layer", type=int, default=1, help="an encoder Full layer of --model")
    p.add_argument("--no-qat", action="store_true", help="turn FP8/FP4 fake quantisation off in CSA2")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--loss", default="upstream", choices=["upstream", "square-mean"],
                   help="upstream: backward from a fixed output gradient made before the pass (the layer's own "
                        "memory, as inside a model); square-mean: backward of out.square().mean() (adds the "
                        "loss's [s, d] temporaries to both sides)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", nargs="+", choices=IMPLS,
                   help="default: csa2 csa2-selective dense (+ csa2-ref on CUDA)")
    p.add_argument("--fixed-mmap-threshold", action="store_true",
                   help="CPU: run the workers with MALLOC_MMAP_THRESHOLD_=65536 (no glibc heap reuse, so the RSS peak "
                        "is the allocation peak rather than allocation + fragmentation; slower)")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true",
                   help="one short sequence, one pass (the test suite's check that the bench runs)")
    args = p.parse_args(argv)
    if args.smoke and not args.worker:
        args.min_seq = args.max_seq = 256
        args.repeats, args.warmup = 1, 0
    if not args.worker and not 1 <= args.min_seq <= args.max_seq:
        p.error(f"--min-seq {args.min_seq} must be between 1 and --max-seq {args.max_seq}")
    if not args.worker and (args.repeats < 1 or args.warmup < 0):
        p.error("--repeats must be at least 1 and --warmup at least 0")
    if not args.worker and args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU is visible to torch {torch.__version__}; use --device cpu")

    if args.worker:
        print(json.dumps(worker(args.worker, args.seq, args)))
        return 0

    seqs = []
    s = args.min_seq
    while s <= args.max_seq:
        seqs.append(s)
        s *= 2
    cuda = args.device.startswith("cuda")
    impls = args.impls or ["csa2", "csa2-selective"] + (["csa2-ref"] if cuda else []) + ["dense"]
    if "dense" not in impls:
        impls = list(impls) + ["dense"]
    if "csa2-ref" in impls and not cuda:
        raise SystemExit("--impls csa2-ref is the CUDA reference run; on CPU csa2 already is the reference")
    others = [i for i in impls if i != "dense"]
    rows, raw = [], []
    t_start = time.time()
    for seq in seqs:
        cell = {impl: run_one(impl, seq, args) for impl in impls}
        raw += list(cell.values())
        rows.append((seq, cell))
        print(f"  measured {seq:>6}: " + ", ".join(f"{i} {r['median_s'] * 1e3:.1f} ms" for i, r in cell.items()),
              file=sys.stderr, flush=True)

    import yaml

    from megatron_s2.models.v41.config import V41Config
    from megatron_s2.config.schema import from_mapping

    cfg = from_mapping(V41Config, yaml.safe_load(Path(args.model).read_text()))
    spec = cfg.plan[args.layer]
    first = rows[0][1]
    qat = "off" if args.no_qat else (f"fp8_swa_kv={cfg.fp8_swa_kv} fp4_main_kv={cfg.fp4_main_kv} "
                                      f"fp4_indexer={cfg.fp4_indexer}")
    print(f"CSA2 layer {args.layer} of {Path(args.model).name} (Full, m={spec.compress_ratio}, window "
          f"{cfg.window_size}, top-k {cfg.index_topk}, {cfg.index_num_heads} indexer heads, QAT {qat}; "
          f"{first[others[0]]['params']:,} params) vs dense SDPA causal attention "
          f"(hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}; "
          f"{first['dense']['params']:,} params)")
    where = f"{args.device}" if cuda else f"CPU, {first['dense']['threads']} threads"
    source = "an upstream gradient" if args.loss == "upstream" else "out.square().mean()"
    print(f"{args.dtype}, batch 1, {where}, backward from {source}, "
          f"torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f} at the end; time = median of "
          f"{args.repeats} fwd+bwd after {args.warmup} warm-up; peak = rise during one fwd+bwd "
          f"({first['dense']['memory_method']}, fresh process per cell"
          f"{', MALLOC_MMAP_THRESHOLD_=65536' if args.fixed_mmap_threshold else ''})")
    print("ratios to dense: time (median wall) [fastest] {CPU time} | peak memory")
    head = f"{'seq':>6} | {'dense ms':>9} {'dense MiB':>9} | " + " | ".join(f"{i:^36}" for i in others)
    print(head)
    print(f"{'':>6} | {'':>9} {'':>9} | " + " | ".join(f"{'ms':>8} {'time':>5} {'[min]':>6} {'{cpu}':>6} {'mem':>6}"
                                                        for _ in others))
    print("-" * len(head))
    for seq, cell in rows:
        d = cell["dense"]
        parts = []
        for i in others:
            c = cell[i]
            mr = c["peak_mib"] / d["peak_mib"] if d["peak_mib"] > 0 else float("nan")
            parts.append(f"{c['median_s'] * 1e3:8.1f} {c['median_s'] / d['median_s']:5.2f} "
                         f"{min(c['times_s']) / min(d['times_s']):6.2f} "
                         f"{c['median_cpu_s'] / max(d['median_cpu_s'], 1e-9):6.2f} {mr:6.2f}")
        print(f"{seq:>6} | {d['median_s'] * 1e3:9.1f} {d['peak_mib']:9.1f} | " + " | ".join(parts))
    if "csa2" in others and "csa2-selective" in others:
        def vs_none(cell) -> str:
            sel, none = cell["csa2-selective"], cell["csa2"]
            return (f"time {sel['median_s'] / none['median_s']:.2f} [{min(sel['times_s']) / min(none['times_s']):.2f}] "
                    f"{{{sel['median_cpu_s'] / max(none['median_cpu_s'], 1e-9):.2f}}} "
                    f"mem {sel['peak_mib'] / max(none['peak_mib'], 1e-9):.2f}")

        print("selective recomputation vs none (csa2-selective / csa2): "
              + "; ".join(f"{seq}: {vs_none(cell)}" for seq, cell in rows))
    print("absolute peak MiB: " + "; ".join(f"{seq}: " + ", ".join(f"{i} {c['peak_mib']:.1f}" for i, c in cell.items())
                                           for seq, cell in rows))
    print(f"(total wall time {time.time() - t_start:.0f} s)")
    if args.smoke:
        print("(smoke run: one pass without warm-up at 256 tokens checks that the bench runs; its ratios are not "
              "measurements: use the defaults, 1K-16K)")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
