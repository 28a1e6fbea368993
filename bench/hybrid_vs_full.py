"""Intern-S2 hybrid (3 Gated DeltaNet : 1 gated attention) vs an all-full-attention stack of the
same width: training step time and memory vs sequence length, and decode time per token vs
context length (issue 23 "Evidence"). Both stacks are the family's own model with only
``layer_types`` changed.

Stacks:

* **hybrid**: Gated DeltaNet (lean chunked delta rule: chunk states recomputed in backward)
  with one gated-attention layer in four;
* **full**: every layer gated attention through PyTorch's fused causal
  ``scaled_dot_product_attention`` (what the family trains with): no s x s matrix is kept, so its
  memory is *linear* in the length too;
* **eager** (baseline for reference, not the family's path): the same all-attention stack with
  the scores materialised (``softmax(q k^T) v``, the probabilities kept for backward): memory
  *quadratic* in the length. Lengths whose score matrices would not fit are printed as such.

Training: one forward + backward of one sequence, each (stack, length) in a fresh process (so
the peak belongs to that step alone), stacks interleaved per length. Memory: **peak** = the
step's peak resident memory above what was resident before it (Linux VmHWM reset through
``/proc/self/clear_refs``; on CUDA the allocator's peak above its level before the step);
**saved** = the bytes autograd keeps for backward (unique storages, parameters excluded), also
split per layer into norms / token mixer / MoE. Decode: the engine's executor, one token after a
prefill of the context, median per-token time.

    python bench/hybrid_vs_full.py [--seq 4096 8192 16384 32768] [--ctx 256 1024 4096] [--device cpu]
    python bench/hybrid_vs_full.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from collections import defaultdict

import torch

import megatron_s2
from megatron_s2.config.engine import EngineConfig
from megatron_s2.models.family import family_of
from megatron_s2.models.family.engine import Chunk
from megatron_s2.models.intern_s2.config import FULL, InternS2Config
from megatron_s2.models.intern_s2.layers import GatedAttention

STACKS = ("hybrid", "full", "eager")
PARTS = ("norms", "mixer", "moe")


def configs(width: int, layers: int) -> dict[str, InternS2Config]:
    base = dict(vocab_size=512, hidden_size=width, layers=layers, num_attention_heads=width // 64, num_kv_heads=2,
                head_dim=64, linear_num_key_heads=width // 128, linear_num_value_heads=width // 64,
                linear_key_head_dim=64, linear_value_head_dim=64, num_routed_experts=8, moe_topk=2,
                moe_ffn_hidden_size=width, shared_expert_ffn_hidden_size=width)
    return {"hybrid": InternS2Config(name="hybrid", **base),
            "full": InternS2Config(name="full", layer_types=(FULL,) * layers, **base)}


class EagerGatedAttention(GatedAttention):
    """The bench's quadratic baseline: the family's gated attention with the score matrix
    materialised (softmax of ``q k^T``, kept for backward) instead of the fused kernel."""

    @staticmethod
    def attend(q, k, v, allowed):
        scores = (q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5              # [b, H, s, t]
        s, t = scores.shape[-2:]
        if allowed is None:
            allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
        else:
            allowed = allowed.unsqueeze(1)
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def build(stack: str, width: int, layers: int, device: torch.device):
    cfg = configs(width, layers)["hybrid" if stack == "hybrid" else "full"]
    model = family_of(cfg).build_model(cfg).init_weights(0).to(device)
    if stack == "eager":
        for module in model.modules():
            if isinstance(module, GatedAttention):
                module.__class__ = EagerGatedAttention
    return model


def eager_bytes(cfg: InternS2Config, seq: int) -> int:
    """Score-matrix bytes of the eager stack's step: the probabilities of every layer kept for
    backward plus ~3 transient s x s matrices of the layer at work (float32)."""
    return (cfg.mixers.count(FULL) + 3) * cfg.num_attention_heads * seq * seq * 4


def _part(name: str) -> tuple[int, str] | None:
    """``layers.3.moe.experts`` -> (3, "moe"); None outside the blocks."""
    bits = name.split(".")
    if len(bits) < 3 or bits[0] != "layers":
        return None
    return int(bits[1]), "norms" if bits[2].endswith("norm") else "moe" if bits[2] == "moe" else "mixer"


def train_step(model, seq: int, device) -> tuple[float, dict]:
    """(seconds, saved bytes by (layer, part) or "outside") of one forward + backward."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where: list = ["outside"]
    handles = []
    for name, module in model.named_modules():
        part = _part(name)
        if part is not None and name.count(".") == 2:  # a block's norm, mixer or MoE: tag what it saves
            handles.append(module.register_forward_pre_hook(lambda m, a, part=part: where.append(part)))
            handles.append(module.register_forward_hook(lambda m, a, o: where.pop() and None))
    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # one entry per storage: views of one buffer count once
            saved.setdefault(storage.data_ptr(), (where[-1], storage.nbytes()))
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    by_part: dict = defaultdict(int)
    for part, nbytes in saved.values():
        by_part[part] += nbytes
    return seconds, by_part


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def measure(stack: str, seq: int, width: int, layers: int, device: torch.device) -> dict:
    """One (stack, length) step in this process: seconds, peak bytes above the level before the
    step, saved bytes per layer part."""
    torch.manual_seed(0)
    model = build(stack, width, layers, device)
    train_step(model, min(seq, 64), device)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as refs:  # resets VmHWM to the current resident size
            refs.write("5")
        before = _status_kib("VmRSS") * 1024
    seconds, by_part = train_step(model, seq, device)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _status_kib("VmHWM") * 1024
    parts = [{"kind": model.config.mixers[i], **{p: by_part.get((i, p), 0) for p in PARTS}}
             for i in range(layers)]
    return {"seconds": seconds, "peak": peak - before, "saved": sum(by_part.values()), "layers": parts,
            "outside": by_part.get("outside", 0)}


def run_child(stack: str, seq: int, args) -> dict | None:
    """:func:`measure` in a fresh process; None when it did not finish (killed for memory)."""
    cmd = [sys.executable, __file__, "--child", stack, "--seq", str(seq), "--width", str(args.width),
           "--layers", str(args.layers), "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode < 0 or "MemoryError" in done.stderr or "out of memory" in done.stderr:
        print(f"  ({stack} at {seq} tokens did not fit: exit {done.returncode})", flush=True)
        return None
    if done.returncode != 0:
        raise SystemExit(f"{stack} at {seq} tokens failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  measured {stack} at {seq} tokens: {result['seconds']:.1f} s, peak {result['peak'] / 2**20:.0f} MiB",
          file=sys.stderr, flush=True)  # progress while the tables wait for every length
    return result


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


def _fmt(value, scale=1.0, spec="9.1f", missing="n/f"):
    return f"{value / scale:{spec}}" if value is not None else f"{missing:>{spec.split('.')[0]}}"


def _ratio(a, b):
    return f"{a / b:6.2f}" if a is not None and b else f"{'-':>6}"


def print_training(rows: dict, args) -> None:
    print(f"{'tokens':>7} {'hybrid s':>9} {'full s':>9} {'eager s':>9} {'h/full':>6} {'h/eager':>7}")
    for seq, row in rows.items():
        t = {k: (v["seconds"] if v else None) for k, v in row.items()}
        print(f"{seq:>7} {_fmt(t['hybrid'], 1, '9.2f')} {_fmt(t['full'], 1, '9.2f')} {_fmt(t['eager'], 1, '9.2f')} "
              f"{_ratio(t['hybrid'], t['full'])} {_ratio(t['hybrid'], t['eager']):>7}")
    where = "allocator peak above the step's start" if args.device == "cuda" else "peak RSS rise of the step"
    print(f"\nmemory, MiB (peak = {where}; saved = kept by autograd for backward, unique storages;"
          f"\n'mem ratio' = hybrid / full (fused, linear); 'vs eager' = hybrid / eager (quadratic); n/f = does not fit)")
    print(f"{'tokens':>7} {'hybrid pk':>9} {'full pk':>9} {'eager pk':>9} {'mem ratio':>9} {'vs eager':>8} "
          f"{'hyb saved':>9} {'full saved':>10} {'saved ratio':>11}")
    mib = 2 ** 20
    for seq, row in rows.items():
        pk = {k: (v["peak"] if v else None) for k, v in row.items()}
        sv = {k: (v["saved"] if v else None) for k, v in row.items()}
        print(f"{seq:>7} {_fmt(pk['hybrid'], mib)} {_fmt(pk['full'], mib)} {_fmt(pk['eager'], mib)} "
              f"{_ratio(pk['hybrid'], pk['full']):>9} {_ratio(pk['hybrid'], pk['eager']):>8} "
              f"{_fmt(sv['hybrid'], mib)} {_fmt(sv['full'], mib, '10.1f')} {_ratio(sv['hybrid'], sv['full']):>11}")


def print_breakdown(seq: int, row: dict) -> None:
    """Saved bytes per token per layer, by part, and the floor this puts under the memory ratio."""
    print(f"\nsaved for backward at {seq} tokens, bytes per token per layer (float32 model)")
    print(f"{'layer':<30} {'norms':>7} {'mixer':>7} {'moe':>7} {'total':>7}")
    kinds = {}
    for stack in STACKS:
        if not row.get(stack):
            continue
        for layer in row[stack]["layers"]:
            label = {"linear_attention": "Gated DeltaNet (hybrid)"}.get(
                layer["kind"], {"hybrid": "attention, fused (hybrid)", "full": "attention, fused (full)",
                                "eager": "attention, eager (eager)"}[stack])
            kinds.setdefault(label, layer)
    for label, layer in kinds.items():
        vals = [layer[p] / seq for p in PARTS]
        print(f"{label:<30} {vals[0]:>7.0f} {vals[1]:>7.0f} {vals[2]:>7.0f} {sum(vals):>7.0f}")
    for stack in STACKS:
        if row.get(stack):  # embedding, final norm, output layer, loss: once per stack
            print(f"{'outside the layers (' + stack + ')':<30} {'':>23} {row[stack]['outside'] / seq:>7.0f}")
    hybrid, full = row.get("hybrid"), row.get("full")
    if hybrid and full:
        floor = hybrid["saved"] - sum(layer["mixer"] for layer in hybrid["layers"] if layer["kind"] != FULL)
        print(f"floor: with Gated DeltaNet mixers that kept nothing, hybrid saved / full saved would be "
              f"{floor / full['saved']:.2f} (norms + MoE are the same in both stacks)")


def child_main(args) -> None:
    print(json.dumps(measure(args.child, args.seq[0], args.width, args.layers, torch.device(args.device))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--ctx", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--eager-max-gib", type=float, default=10.0,
                        help="skip the eager stack where its score matrices would pass this (printed n/f)")
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS),
                        help="which stacks to train (decode always compares hybrid and full)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every part runs in seconds")
    parser.add_argument("--child", choices=STACKS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    if args.smoke:
        args.seq, args.ctx, args.width, args.decode_steps = [128, 256], [32, 128], 128, 2
    device = torch.device(args.device)
    cfg = configs(args.width, args.layers)
    print(f"device {device}; width {args.width}, {args.layers} layers; hybrid = "
          f"{cfg['hybrid'].mixers.count(FULL)} of {args.layers} layers full attention; "
          f"megatron_s2 from {megatron_s2.__file__}")
    print("\ntraining step (one sequence, forward + backward; each in a fresh process), seconds")
    rows = {}
    for seq in args.seq:
        rows[seq] = {}
        for stack in STACKS:
            if stack not in args.stacks:
                rows[seq][stack] = None
                continue
            if stack == "eager" and eager_bytes(cfg["full"], seq) > args.eager_max_gib * 2 ** 30:
                print(f"  (eager at {seq} tokens: score matrices need ~{eager_bytes(cfg['full'], seq) / 2**30:.0f} "
                      f"GiB > --eager-max-gib {args.eager_max_gib:g}: not run)", flush=True)
                rows[seq][stack] = None
                continue
            rows[seq][stack] = run_child(stack, seq, args)
    print_training(rows, args)
    at = max((s for s in rows if s <= 16384 and rows[s].get("hybrid") and rows[s].get("full")), default=None)
    if at is not None:
        print_breakdown(at, rows[at])
    print("\ndecode (one token after a prefill of the context; median ms/token)")
    print(f"{'context':>7} {'hybrid':>8} {'full':>8} {'ratio':>6}")
    torch.manual_seed(0)
    models = {name: build(name, args.width, args.layers, device) for name in ("hybrid", "full")}
    for ctx_len in args.ctx:
        h, f = (decode_ms(models[n], ctx_len, device, args.decode_steps) for n in ("hybrid", "full"))
        print(f"{ctx_len:>7} {h:>8.2f} {f:>8.2f} {h / f:>6.2f}")


if __name__ == "__main__":
    main()
