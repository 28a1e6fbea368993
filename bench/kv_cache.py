"""KV cache benchmark (issue 12): ratios measured side by side in one run (engine speed: bench/decode.py).

1. **Per-token decode time with the KV cache vs recomputing the sequence**, at several context
   lengths: the cache is filled by a chunked prefill, then the median time of one cached
   decode step is compared with one whole-sequence forward over the context + 1 tokens (what
   a cache-less decoder pays per token).
2. **Continuous batching**: tokens/s of 16 concurrent requests (``max_num_seqs=16``) vs the
   same requests one at a time (``max_num_seqs=1``), greedy, same prompts and lengths.
3. **KV bytes per token vs a DeepSeek-V3-style MLA cache of the same width** (the report's
   comparison): ours measured from the allocated page buffers (packed FP4 / MXFP4 formats,
   the QAT flags switched on), MLA = every layer caching its own ``head_dim`` latent plus a
   ``rope_head_dim`` RoPE key in BF16 (V3: 61 x (512 + 64) x 2 bytes). SWA state is per
   request (window x layers), not per token, and printed separately.

Random weights (the timings and bytes do not depend on them). Prints tables, exits 0.

    python bench/kv_cache.py --smoke                     # seconds: tiny, short contexts
    python bench/kv_cache.py                             # tiny, contexts 512 2048 8192
    python bench/kv_cache.py --model small --device cuda # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams  # noqa: E402
from megatron_s2.models.v41.inference.kv_store import GlobalKVStore, SequenceKV, SWAStore  # noqa: E402
from megatron_s2.models.v41.inference.runner import ForwardRow, ModelRunner  # noqa: E402
from megatron_s2.models.v41.accounting import kv_bytes  # noqa: E402
from megatron_s2.models.v41.model import build_model  # noqa: E402
from tests.models.conftest import load_model_recipe  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def decode_vs_recompute(model, contexts: list[int], steps: int, device) -> None:
    cfg = model.config
    print(f"\n1. per-token decode: KV cache vs recomputing the sequence ({cfg.name}, {device})")
    print(f"{'context':>8s} {'prefill s':>10s} {'cached ms/tok':>14s} {'recompute ms/tok':>17s} {'speed-up':>9s}")
    page = 64
    for n in contexts:
        g = torch.Generator().manual_seed(n)
        tokens = torch.randint(5, cfg.vocab_size, (n + steps + 1,), generator=g).tolist()
        gkv = GlobalKVStore(cfg, 2 + (n + steps + page) // page, page, device)
        swa = SWAStore(cfg, 1, device)
        runner = ModelRunner(model, gkv, swa)
        seq = SequenceKV(swa.allocate())
        sync(device)
        t0 = time.perf_counter()
        for s in range(0, n, 512):
            runner.forward([ForwardRow(seq, tokens[s:min(n, s + 512)], s, tokens[:s], logits="none")])
        sync(device)
        prefill = time.perf_counter() - t0
        pos = [n]

        def step():
            p = pos[0]
            runner.forward([ForwardRow(seq, tokens[p:p + 1], p, tokens[max(0, p - 8):p])])
            pos[0] += 1

        cached = timed(step, device, steps)
        ids = torch.tensor([tokens[:n + 1]], device=device)
        recompute = timed(lambda: model(ids), device, 2 if n <= 2048 else 1)
        print(f"{n:8d} {prefill:10.2f} {cached * 1e3:14.2f} {recompute * 1e3:17.1f} {recompute / cached:8.1f}x")


def batching(model, requests: int, prompt: int, gen: int, device) -> None:
    cfg = model.config
    print(f"\n2. continuous batching: {requests} requests x ({prompt} prompt + {gen} generated tokens)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, cfg.vocab_size, (prompt + (i % 4) * 8,), generator=g).tolist() for i in range(requests)]
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    rates = {}
    for concurrent in (requests, 1):
        engine = InferenceEngine(model, EngineConfig(max_num_seqs=concurrent, max_model_len=prompt + 32 + gen + 1,
                                                     prefill_chunk=256, max_prefill_tokens=1024, page_tokens=16))
        sync(device)
        t0 = time.perf_counter()
        done = engine.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - t0
        tokens = sum(len(d.token_ids) for d in done)
        rates[concurrent] = tokens / wall
        print(f"  max_num_seqs={concurrent:3d}: {tokens} tokens in {wall:7.2f} s = {tokens / wall:8.1f} tok/s")
    print(f"  continuous batching / one at a time: {rates[requests] / rates[1]:.2f}x")


def kv_footprint(names: list[str]) -> None:
    print("\n3. KV cache bytes per token: ours (measured, packed) vs a DeepSeek-V3-style MLA cache of the same width")
    print(f"{'model':9s} {'ours B/tok':>11s} {'MLA B/tok':>10s} {'MLA / ours':>11s} {'SWA B/request':>14s}")
    for name in names:
        cfg = load_model_recipe(name).replace(fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True)
        ratios = sorted({s.compress_ratio for s in cfg.plan if s.computes_main_kv})
        page = 16 * ratios[-1]
        ours = GlobalKVStore(cfg, 2, page, torch.device("meta")).bytes_per_token()
        swa = SWAStore(cfg, 1, torch.device("meta")).bytes_per_slot()
        mla = cfg.num_layers * (cfg.head_dim + cfg.rope_head_dim) * 2
        assert ours == kv_bytes(cfg)["global_kv_bytes_per_token"]
        print(f"{name:9s} {ours:11.1f} {mla:10d} {mla / ours:10.1f}x {swa:14d}")
    print("  (DeepSeek-V3 itself: 61 layers x (512 + 64) x 2 B = 70272 B/token)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | small (random weights)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per context")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: runs in seconds")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.smoke:
        args.model, args.contexts, args.steps, args.requests, args.prompt, args.gen = "tiny", [64, 128], 3, 4, 16, 4
    cfg = load_model_recipe(args.model).replace(fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True)
    model = build_model(cfg, seed=0).eval().to(device)
    decode_vs_recompute(model, args.contexts, args.steps, device)
    batching(model, args.requests, args.prompt, args.gen, device)
    kv_footprint(["tiny", "small", "flagship"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
