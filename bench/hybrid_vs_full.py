"""Intern-S2 hybrid (3 Gated DeltaNet : 1 gated attention) vs an all-full-attention stack of the
same width: training step time and activation memory vs sequence length, and decode time per
token vs context length (issue 23 "Evidence"). Both stacks are the family's own model with
only ``layer_types`` changed, measured side by side in one process (ratios, not absolute times,
are what this noisy machine can tell).

Training: one forward + backward of one sequence; memory is the bytes autograd saves for the
backward (``saved_tensors_hooks``; on CUDA also ``max_memory_allocated``). Decode: the engine's
executor, one token after a prefill of the context, per-token time.

    python bench/hybrid_vs_full.py [--seq 1024 2048 4096 8192] [--ctx 256 1024 4096] [--device cpu]
    python bench/hybrid_vs_full.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from megatron_s2.config.engine import EngineConfig
from megatron_s2.models.family import family_of
from megatron_s2.models.family.engine import Chunk
from megatron_s2.models.intern_s2.config import FULL, InternS2Config


def configs(width: int, layers: int) -> dict[str, InternS2Config]:
    base = dict(vocab_size=512, hidden_size=width, layers=layers, num_attention_heads=width // 64, num_kv_heads=2,
                head_dim=64, linear_num_key_heads=width // 128, linear_num_value_heads=width // 64,
                linear_key_head_dim=64, linear_value_head_dim=64, num_routed_experts=8, moe_topk=2,
                moe_ffn_hidden_size=width, shared_expert_ffn_hidden_size=width)
    return {"hybrid": InternS2Config(name="hybrid", **base),
            "full": InternS2Config(name="full", layer_types=(FULL,) * layers, **base)}


def train_step(model, seq: int, device) -> tuple[float, int, int]:
    """(seconds, saved-activation bytes, CUDA peak bytes or 0) of one forward + backward."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, saved[0], torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


@torch.no_grad()
def decode_ms(model, ctx_len: int, device, steps: int) -> float:
    executor = family_of(model.config).executor(
        model, EngineConfig(max_num_seqs=1, max_model_len=ctx_len + steps + 1, page_tokens=64), device)
    req = types.SimpleNamespace(tokens=torch.randint(0, 512, (ctx_len + steps,)).tolist(), num_computed=0, kv=None)
    executor.admit(req)
    executor.forward([Chunk(req, 0, ctx_len, "last")])
    req.num_computed = ctx_len
    times = []
    for i in range(steps):
        start = time.perf_counter()
        executor.forward([Chunk(req, ctx_len + i, 1, "last")])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        req.num_computed += 1
    executor.release(req)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--ctx", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every part runs in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.ctx, args.width, args.decode_steps = [128, 256], [32, 128], 128, 2
    device = torch.device(args.device)
    torch.manual_seed(0)
    models = {name: family_of(cfg).build_model(cfg).init_weights(0).to(device) for name, cfg in
              configs(args.width, args.layers).items()}
    print(f"device {device}; width {args.width}, {args.layers} layers; hybrid = "
          f"{models['hybrid'].config.mixers.count(FULL)} of {args.layers} layers full attention")
    print("\ntraining step (one sequence, forward + backward)")
    print(f"{'tokens':>7} {'hybrid s':>9} {'full s':>8} {'time ratio':>10} {'hybrid MiB':>11} {'full MiB':>9} "
          f"{'mem ratio':>9}")
    for seq in args.seq:
        row = {}
        for name, model in models.items():  # interleaved per length: both see the same machine state
            train_step(model, min(seq, 64), device)  # warm-up
            row[name] = train_step(model, seq, device)
        (th, mh, ph), (tf, mf, pf) = row["hybrid"], row["full"]
        mh, mf = (ph, pf) if device.type == "cuda" else (mh, mf)
        print(f"{seq:>7} {th:>9.3f} {tf:>8.3f} {th / tf:>10.2f} {mh / 2**20:>11.1f} {mf / 2**20:>9.1f} "
              f"{mh / mf:>9.2f}")
    print("\ndecode (one token after a prefill of the context; median ms/token)")
    print(f"{'context':>7} {'hybrid':>8} {'full':>8} {'ratio':>6}")
    for ctx_len in args.ctx:
        h, f = (decode_ms(models[n], ctx_len, device, args.decode_steps) for n in ("hybrid", "full"))
        print(f"{ctx_len:>7} {h:>8.2f} {f:>8.2f} {h / f:>6.2f}")


if __name__ == "__main__":
    main()
