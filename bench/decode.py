"""Engine decode speed (issue 20): ms per token and ATen operators per decode step, this tree
against another git revision, side by side in one run.

For every (batch, context) pair a worker process per code tree builds the same model (same
recipe, seed and weights), fills ``batch`` requests with ``context`` prompt tokens by the
engine's own chunked prefill, and then waits. The parent alternates the trees round by round —
``--steps`` decode steps on one, then on the other — so both see the same machine load (this
machine is noisy); a worker sleeps on its pipe while the other runs. Reported per tree: the
median over rounds of the median step time (wall clock, or with ``--clock cpu`` the worker's CPU
time, which a shared machine's load inflates far less) (one step = one token for each of the ``batch``
requests), and the ATen operators of one step (torch profiler; operators called by another
operator are not counted again). ``ratio`` = baseline / this tree (> 1: this tree is faster).

The worker uses only the API both trees share (``InferenceEngine``, ``EngineConfig``,
``SamplingParams``, ``add_request``, ``step``), imports each tree from a staged copy of its
package layout (``megatron_s2`` + ``kernels`` / ``launcher`` / ``tools``), and runs fp32 on one
thread by default (``--threads``), as the issue measured. ``--baseline-rev REV [REV ...]`` checks
each REV out into a temporary worktree (removed afterwards); with several, all trees alternate in
the same rounds and each baseline gets its own columns.

    python bench/decode.py --baseline-rev main                  # small, batch 1 8, contexts 512 2048 8192
    python bench/decode.py --baseline-rev 6c2c05e arch --contexts 512 2048   # two baselines, one run
    python bench/decode.py --baseline-rev main --contexts 512 2048 --rounds 5
    python bench/decode.py --smoke                              # tiny, this tree against HEAD, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("kernels", "launcher", "tools")  # installed as megatron_s2.<name> (setup.py)


# ---- worker (runs inside one code tree) ---------------------------------------------------------
def _stage(tree: Path) -> Path:
    """A directory whose ``megatron_s2`` is ``tree``'s package with its sub-packages in place
    (what ``pip install`` makes of the tree), plus ``tests`` for the model recipes."""
    stage = Path(tempfile.mkdtemp(prefix="megatron-s2-bench-"))
    package = stage / "megatron_s2"
    package.mkdir()
    for entry in (tree / "megatron_s2").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in SUBPACKAGES:
        if (tree / name).is_dir() and not (package / name).exists():
            (package / name).symlink_to(tree / name)
    (stage / "tests").symlink_to(tree / "tests")
    return stage


def worker(tree: Path, model: str, batch: int, context: int, max_new: int, threads: int, device: str) -> None:
    stage = _stage(tree)
    sys.path.insert(0, str(stage))
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    import time

    import torch

    from megatron_s2.inference import EngineConfig, InferenceEngine, SamplingParams
    from megatron_s2.models.v41.model import build_model
    from tests.models.conftest import load_model_recipe

    import megatron_s2
    assert Path(megatron_s2.__file__).resolve().parent == (tree / "megatron_s2").resolve(), megatron_s2.__file__
    torch.set_num_threads(threads)
    dev = torch.device(device)
    cfg = load_model_recipe(model).replace(fp4_main_kv=True, fp4_indexer=True, fp8_swa_kv=True)
    net = build_model(cfg, seed=0).eval().to(dev)
    engine = InferenceEngine(net, EngineConfig(max_num_seqs=batch, max_model_len=context + max_new + 2,
                                               prefill_chunk=512, max_prefill_tokens=4096, page_tokens=16))
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(5, cfg.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
    while engine.waiting or len(engine.running) < batch or any(len(r.tokens) - r.num_computed > 1
                                                                 for r in engine.running):
        engine.step()  # the chunked prefill, up to the first decode step
    for _ in range(2):
        engine.step()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True})
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "time":
            clock = time.process_time if cmd[2] == "cpu" else time.perf_counter
            times = []
            for _ in range(int(cmd[1])):
                sync()
                t0 = clock()
                engine.step()
                sync()
                times.append(clock() - t0)
            reply({"ms": statistics.median(times) * 1e3})
        elif cmd[0] == "ops":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            top = [e for e in prof.events() if e.name.startswith("aten::")
                   and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
            reply({"ops": len(top)})
        else:
            break
    shutil.rmtree(stage, ignore_errors=True)


# ---- parent -------------------------------------------------------------------------------------
class Worker:
    def __init__(self, tree: Path, args, batch: int, context: int):
        max_new = 2 + 3 + args.rounds * args.steps + 8  # warm-up, ops, timed steps, margin
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--model", args.model,
               "--batch", str(batch), "--context", str(context), "--max-new", str(max_new),
               "--threads", str(args.threads), "--device", args.device]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=tree)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        self.proc.wait(timeout=60)


@contextmanager
def checkout(rev: str | None):
    """A temporary worktree of ``rev`` (None: no baseline)."""
    if rev is None:
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="megatron-s2-baseline-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(where), rev], check=True,
                   capture_output=True, text=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


def measure(trees: dict[str, Path], args, batch: int, context: int) -> dict[str, dict]:
    workers = {}
    try:
        for name, tree in trees.items():  # built one after the other: the prefill uses every core
            workers[name] = Worker(tree, args, batch, context)
            workers[name].read()
        times = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, w in workers.items():
                times[name].append(w.ask(f"time {args.steps} {args.clock}")["ms"])
        return {name: {"ms": statistics.median(times[name]), "ops": w.ask("ops")["ops"]}
                for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", nargs="+", default=[],
                    help="git revision(s) to compare with (e.g. main, a commit); several: one column group each")
    ap.add_argument("--model", default="small", help="model recipe (random weights): tiny | small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternations between the trees")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="step time as wall clock, or as the worker's CPU time (steadier on a shared machine "
                         "whose load makes a process wait for a core; one thread only, CPU device only)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny, batch 1 and 2, context 64, against HEAD")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-new", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.model, args.batch, args.context, args.max_new, args.threads, args.device)
        return 0
    if args.smoke:
        args.model, args.batches, args.contexts, args.steps, args.rounds = "tiny", [1, 2], [64], 2, 2
        args.baseline_rev = args.baseline_rev or ["HEAD"]
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        print("bench/decode.py: --clock cpu measures one CPU thread; use it with --threads 1 --device cpu",
              file=sys.stderr)
        return 2
    revs = list(dict.fromkeys(args.baseline_rev))
    with ExitStack() as stack:
        trees = {"this tree": REPO, **{rev: stack.enter_context(checkout(rev)) for rev in revs}}
        print(f"decode step, {args.model}, {args.device}, {args.threads} thread(s); {args.rounds} rounds of "
              f"{args.steps} steps, trees alternating, {args.clock} clock")
        head = f"{'batch':>5s} {'context':>7s} {'ms/token':>9s} {'ops/step':>9s}"
        for rev in revs:
            name = rev if len(revs) > 1 else "base"
            head += f" {name + ' ms/token':>13s} {name + ' ops':>9s} {'ratio':>6s} {'ops ratio':>9s}"
        print(head)
        for context in args.contexts:
            for batch in args.batches:
                got = measure(trees, args, batch, context)
                ours = got["this tree"]
                row = f"{batch:5d} {context:7d} {ours['ms']:9.2f} {ours['ops']:9d}"
                for rev in revs:
                    name = rev if len(revs) > 1 else "base"
                    base = got[rev]
                    row += (f" {base['ms']:{max(13, len(name) + 9)}.2f} {base['ops']:{max(9, len(name) + 4)}d}"
                            f" {base['ms'] / ours['ms']:5.2f}x {base['ops'] / ours['ops']:8.2f}x")
                print(row, flush=True)
        print("ms/token: median step time (one token for each request of the batch); ratio = baseline / this tree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
