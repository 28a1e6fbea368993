"""CSA2 attention layer vs dense causal attention on CPU: forward+backward time and peak memory.

    python bench/csa2_vs_dense.py [--max-seq 16384] [--repeats 3] [--warmup 1] [--threads N]

* **CSA2**: one Full layer of ``--model`` (default ``recipes/models/small.yaml``, layer 1: an
  encoder Full layer, m = 2) exactly as the model builds it — its own query and sliding-window
  KV, the compressor, index keys, the indexer's full scan and top-k, sparse attention over
  window ∪ top-k with the sink, grouped low-rank output — in training mode, so the backward
  includes the indexer's alignment loss. The recipe's QAT switches apply (``--no-qat`` turns
  FP8/FP4 fake quantisation off). Reference PyTorch kernels, no fused kernel.
* **dense**: q/k/v/o projections of the same width (hidden, heads x head_dim) and
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

Both run in float32, batch 1, on the CPU threads given.

* **Time**: median wall time of ``--repeats`` forward+backward passes after ``--warmup``
  passes. The ratio of the fastest passes and the ratio of median process CPU time (all
  threads) are printed too: on a shared machine a gap between the three flags interference
  from other processes, and the CPU-time ratio is the least sensitive to it.
* **Peak memory**: the rise of the process's peak resident set (``VmHWM`` in
  /proc/self/status, reset through /proc/self/clear_refs) over the resident set just before
  one forward+backward, measured after the warm-up with freed heap memory returned to the OS
  (``malloc_trim``), in a fresh subprocess per (layer, length). It counts activations, saved
  tensors, gradients and kernel workspaces of that pass; parameters and inputs exist before
  it. Where clear_refs is not writable a 1 ms RSS sampler is used instead (the header says
  which).

This is not part of the test suite; it prints one table with the CSA2/dense ratios side by side.
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


def build(impl: str, args):
    import torch
    import torch.nn.functional as F
    import yaml
    from torch import nn

    from megatron_s2.config.model import ModelConfig
    from megatron_s2.config.schema import from_mapping
    from megatron_s2.models.init import initialize_parameters
    from megatron_s2.models.v41.attention.csa2 import CSA2Attention
    from megatron_s2.models.v41.context import ForwardContext
    from megatron_s2.parallel.groups import ParallelGroups

    cfg = from_mapping(ModelConfig, yaml.safe_load(Path(args.model).read_text()))
    if args.no_qat:
        cfg = cfg.replace(fp4_main_kv=False, fp8_swa_kv=False, fp4_indexer=False)
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

    if impl == "csa2":
        spec = cfg.plan[args.layer]
        if spec.mode.value != "full":
            raise SystemExit(f"--layer {args.layer} is {spec.mode.value}; pick a Full layer")
        layer = CSA2Attention(cfg, spec, ParallelGroups.single())
        initialize_parameters(layer, 0, cfg.init_std)
        layer.train()

        def step(x, ids):
            ctx = ForwardContext.create(ids, cfg.plan)
            out = layer(x, ctx)
            loss = out.square().mean()
            aux = ctx.total_aux_loss()
            return loss if aux is None else loss + aux
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
        layer = DenseCausalAttention()

        def step(x, ids):
            return layer(x).square().mean()

    return cfg, layer, step


def worker(impl: str, seq: int, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cfg, layer, step = build(impl, args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, cfg.hidden_size, generator=g).requires_grad_()
    ids = torch.zeros(1, seq, dtype=torch.long)

    def once():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        step(x, ids).backward()

    for _ in range(args.warmup):
        once()
    with PeakMeter() as meter:
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
           "--threads", str(args.threads)] + (["--no-qat"] if args.no_qat else [])
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode:
        raise SystemExit(f"{impl} at {seq} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-seq", type=int, default=16384, help="largest sequence length (powers of two from 1K)")
    p.add_argument("--min-seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes first")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--model", default=str(REPO / "recipes" / "models" / "small.yaml"))
    p.add_argument("--layer", type=int, default=1, help="an encoder Full layer of --model")
    p.add_argument("--no-qat", action="store_true", help="turn FP8/FP4 fake quantisation off in CSA2")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", choices=["csa2", "dense"], help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.seq, args)))
        return 0

    seqs = []
    s = args.min_seq
    while s <= args.max_seq:
        seqs.append(s)
        s *= 2
    rows, raw = [], []
    t_start = time.time()
    for seq in seqs:
        c, d = run_one("csa2", seq, args), run_one("dense", seq, args)
        raw += [c, d]
        rows.append((seq, c, d))
        print(f"  measured {seq:>6}: csa2 {c['median_s'] * 1e3:9.1f} ms, dense {d['median_s'] * 1e3:9.1f} ms",
              file=sys.stderr, flush=True)

    import yaml

    from megatron_s2.config.model import ModelConfig
    from megatron_s2.config.schema import from_mapping

    cfg = from_mapping(ModelConfig, yaml.safe_load(Path(args.model).read_text()))
    spec = cfg.plan[args.layer]
    qat = "off" if args.no_qat else (f"fp8_swa_kv={cfg.fp8_swa_kv} fp4_main_kv={cfg.fp4_main_kv} "
                                      f"fp4_indexer={cfg.fp4_indexer}")
    print(f"CSA2 layer {args.layer} of {Path(args.model).name} (Full, m={spec.compress_ratio}, window "
          f"{cfg.window_size}, top-k {cfg.index_topk}, {cfg.index_num_heads} indexer heads, QAT {qat}; "
          f"{rows[0][1]['params']:,} params) vs dense SDPA causal attention "
          f"(hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}; "
          f"{rows[0][2]['params']:,} params)")
    print(f"float32, batch 1, CPU, {rows[0][1]['threads']} threads, torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f} at the end; time = median of "
          f"{args.repeats} fwd+bwd after {args.warmup} warm-up; peak = rise of peak RSS during one fwd+bwd "
          f"({rows[0][1]['memory_method']}, fresh process per cell)")
    head = (f"{'seq':>6} | {'CSA2 ms':>9} {'dense ms':>9} {'time CSA2/dense':>15} {'(fastest)':>9} "
            f"{'(CPU time)':>10} | {'CSA2 MiB':>9} {'dense MiB':>9} {'mem CSA2/dense':>14}")
    print(head)
    print("-" * len(head))
    for seq, c, d in rows:
        tr = c["median_s"] / d["median_s"]
        tmin = min(c["times_s"]) / min(d["times_s"])
        tcpu = c["median_cpu_s"] / d["median_cpu_s"]
        mr = c["peak_mib"] / d["peak_mib"] if d["peak_mib"] > 0 else float("nan")
        print(f"{seq:>6} | {c['median_s'] * 1e3:9.1f} {d['median_s'] * 1e3:9.1f} {tr:15.2f} {tmin:9.2f} {tcpu:10.2f} | "
              f"{c['peak_mib']:9.1f} {d['peak_mib']:9.1f} {mr:14.2f}")
    print(f"(total wall time {time.time() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
