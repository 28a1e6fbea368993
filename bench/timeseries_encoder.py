"""Time-series encoder cost vs series length T (Intern-S2 report §2.2.1; issue 24): linear in T.

    python bench/timeseries_encoder.py                  # T = 4,096 .. 300,000, 3 channels, ~1 min
    python bench/timeseries_encoder.py --lengths 300000 --channels 8 --backward
    python bench/timeseries_encoder.py --smoke          # two short lengths (test suite)

Each T runs in its own child process (one torch thread) so the peak resident memory is that T's
alone: the child builds the encoder (token budget 1,024, Q = 4, the walkthrough's numbers, so
T = 300,000 gets L = 1,172; chunks capped at 16,384 samples), encodes one series of ``--channels`` x T random samples (median of
``--repeats`` forwards, no autograd; with ``--backward`` forward + backward) and reports the wall
time and ``ru_maxrss`` minus the RSS measured just before the forward (model and input already
allocated). The ratio columns divide by the first row: linear cost means time and memory ratios
near the T ratio (the fixed per-call cost of the token-budget-bounded Transformers makes the
short rows relatively dearer). The encoder is CPU-sized (hidden 64), the shape is illustrative.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def child(length: int, channels: int, repeats: int, backward: bool) -> dict:
    """Measure one length in this process; returns seconds and peak MiB above the baseline."""
    import torch

    from megatron_s2.models.timeseries.encoder import SeriesInput, TimeSeriesEncoder, TimeSeriesEncoderConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    enc = TimeSeriesEncoder(TimeSeriesEncoderConfig(output_hidden=256, hidden=64, token_budget=1024,
                                                    queries_per_patch=4, patches_per_chunk=64))
    series = [SeriesInput(torch.randn(channels, length), sample_rate=1000.0)]
    baseline = _rss_mib()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if backward:
            enc(series).tokens.square().mean().backward()
        else:
            with torch.no_grad():
                out = enc(series)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024    # KiB -> MiB on Linux
    plan = enc.plan(length)
    return {"T": length, "L": plan.patch_length, "chunks": plan.num_chunks, "tokens": plan.num_tokens, "seconds": statistics.median(times),
            "peak_mib": max(peak - baseline, 0.0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 37_500, 75_000, 150_000, 300_000])
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--smoke", action="store_true", help="two short lengths, one repeat")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.channels, args.repeats, args.backward)))
        return 0
    lengths, repeats = ([4096, 16_384], 1) if args.smoke else (args.lengths, args.repeats)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    rows = []
    for length in lengths:
        cmd = [sys.executable, __file__, "--child", str(length), "--channels", str(args.channels),
               "--repeats", str(repeats)] + (["--backward"] if args.backward else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mode = "forward + backward" if args.backward else "forward (no autograd)"
    print(f"time-series encoder, {args.channels} channels, budget 1,024, Q = 4, {mode}, 1 CPU thread")
    print(f"{'T':>9} {'L':>6} {'chunks':>6} {'tokens':>6} {'seconds':>9} {'peak MiB':>9} {'T ratio':>8} {'time ratio':>10} {'mem ratio':>9}")
    first = rows[0]
    for row in rows:
        mem_ratio = row["peak_mib"] / first["peak_mib"] if first["peak_mib"] > 0 else float("nan")
        print(f"{row['T']:>9,} {row['L']:>6} {row['chunks']:>6} {row['tokens']:>6} {row['seconds']:>9.3f} {row['peak_mib']:>9.1f} "
              f"{row['T'] / first['T']:>8.1f} {row['seconds'] / first['seconds']:>10.1f} {mem_ratio:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
