"""Bytes moved per step per process group, measured vs analytic; per-rank parameter + optimiser memory.

    python bench/comm_volume.py                       # all 10 layouts, tiny model, ~1.5 min on 2 cores
    python bench/comm_volume.py --layouts tp2 ep2 --detail   # per-collective breakdown
    python bench/comm_volume.py --override model.hidden_size=128 --override training.seq_length=64
    python bench/comm_volume.py --smoke                      # two layouts, one step (test suite)

Runs the real :class:`~megatron_s2.training.trainer.Trainer` (recipe ``recipes/pretrain_tiny.yaml``
with the parity-test overrides of ``tests/parallel/parity.py``: seq 32, global batch 8,
micro-batch 2) on spawned gloo processes, one spawn per world size, for ``--steps`` optimiser
steps under each layout of issue 4: TP2, TP2+SP, EP2, EP4, EP4+ZeRO-1, ETP2xEP2, DP2,
DP2+ZeRO-1, engram-parallel 2, TP2xEP2xDP2 (a layout on fewer ranks than the world leaves dp to
fill it: EP2 on 2 ranks is EP2 over DP2). The last table sets each ZeRO-1 layout's wire bytes on
the replica groups beside the same layout without it (issue 10: reduce-scatter + all-gather must
cost what plain data parallelism's all-reduce costs).

**Measured**: every ``torch.distributed`` collective the step issues (all_reduce, all_gather,
all_gather_into_tensor / all_gather_single, reduce_scatter, reduce_scatter_tensor /
reduce_scatter_single, all_to_all_single, broadcast, isend) is wrapped in
the worker processes — the product code is untouched — and its payload is attributed to the
``ParallelGroups`` field whose process group it ran on (``world`` for the default group).
Bytes are per rank per step, averaged over the ranks; the payload convention and every
analytic formula are in :mod:`bench.comm_model`. "wire" is what a ring algorithm sends from the
rank (``2(g-1)/g N`` all-reduce, ``(g-1)/g`` of the gathered / scattered size, off-rank slices
of an all-to-all).

**Memory**: on each rank, bytes of parameters and of optimiser state after the last step, and
of gradients after its backward + reduction (before the optimiser frees them), against
``comm_model.estimate_memory``.

Not part of the test suite; it prints tables and exits 0.

Output of ``python bench/comm_volume.py`` (2 cores, torch 2.13 CPU), see bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2": (2, ["parallel.ep=2"]),
    "dp2": (2, []),
    "dp2_zero1": (2, ["parallel.distributed_optimizer=true"]),
    "engram2": (2, ["parallel.engram_parallel=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep4_zero1": (4, ["parallel.ep=4", "parallel.distributed_optimizer=true"]),
    "etp2_ep2": (4, ["parallel.etp=2", "parallel.ep=2"]),
    "tp2_ep2_dp2": (4, ["parallel.tp=2", "parallel.ep=2"]),
}


# ---- measurement: wrap torch.distributed in the worker ------------------------------------------
class CollectiveCounter:
    """Counts payload and ring-wire bytes of every collective while ``enabled``, keyed by
    (group name, op, calling function). Group names come from :meth:`name_groups`."""

    OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast", "isend")

    def __init__(self):
        self.enabled = False
        self.names: dict[int, str] = {}
        self.records: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def install(self) -> None:
        import torch.distributed as dist

        for op in self.OPS:
            fn = getattr(dist, op, None)
            if fn is not None and not getattr(fn, "_counted", False):
                wrapped = self._wrap(op, fn)
                wrapped._counted = True
                setattr(dist, op, wrapped)
        # all_to_all.py binds these two at import time
        import megatron_s2.parallel.all_to_all as a2a

        a2a._all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        a2a._reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def name_groups(self, groups) -> None:
        import dataclasses

        self.names = {}
        for f in dataclasses.fields(groups):
            g = getattr(groups, f.name)
            if getattr(g, "pg", None) is not None:
                self.names[id(g.pg)] = f.name

    def _wrap(self, op, fn):
        counter = self

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if counter.enabled:
                frame = sys._getframe(1)
                where = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
                group = kwargs.get("group")
                payload, wire = counter._sizes(op, args, kwargs, group)
                name = counter._group_name(group)
                rec = counter.records[(name, op, where)]
                rec[0] += 1
                rec[1] += payload
                rec[2] += wire
            return fn(*args, **kwargs)

        return wrapped

    def _group_name(self, group) -> str:
        import torch.distributed as dist

        if group is None:
            return "world"
        return self.names.get(id(group), f"ranks{dist.get_process_group_ranks(group)}")

    @staticmethod
    def _sizes(op, args, kwargs, group) -> tuple[float, float]:
        import torch.distributed as dist

        def nb(t):
            return t.numel() * t.element_size()

        g = dist.get_world_size(group)
        if op == "all_reduce":
            n = nb(args[0])
            return n, 2 * (g - 1) / g * n
        if op == "all_gather":
            n = sum(nb(x) for x in args[0])
            return n, (g - 1) / g * n
        if op in ("all_gather_into_tensor", "all_gather_single"):
            n = nb(args[0])
            return n, (g - 1) / g * n
        if op == "reduce_scatter":
            n = sum(nb(x) for x in args[1])
            return n, (g - 1) / g * n
        if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
            n = nb(args[1])
            return n, (g - 1) / g * n
        if op == "all_to_all_single":
            inp = args[1]
            n = nb(inp)
            splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            me = dist.get_rank(group)
            if splits:
                row = n / max(inp.size(0), 1)
                own = splits[me] * row
            else:
                own = n / g
            return n, n - own
        if op == "broadcast":
            n = nb(args[0])
            return n, (g - 1) / g * n
        if op == "isend":
            n = nb(args[0])
            return n, n
        raise ValueError(op)


COUNTER = CollectiveCounter()


def _memory(trainer) -> dict[str, int]:
    import torch

    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    opt = 0
    for o in inner.optimizers.values():
        for state in o.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return {"params": params, "optimizer": opt}


def run_layouts(rank: int, world: int, layouts: list[str], base: list[str], steps: int, out_dir: str) -> None:
    """Worker: every layout of this world size, ``steps`` counted optimiser steps each."""
    import dataclasses

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.training.trainer import Trainer
    from tests.parallel.parity import RECIPE

    COUNTER.install()
    for name in layouts:
        run_dir = Path(out_dir) / name / "run"
        recipe = load_recipe(RECIPE, [*base, *LAYOUTS[name][1], f"training.run_dir={run_dir}",
                                      f"training.train_steps={steps}"])
        trainer = Trainer(recipe, run_dir, rank=rank, world_size=world, log=lambda *a, **k: None)
        COUNTER.name_groups(trainer.groups)
        COUNTER.records.clear()
        grads = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.schedule.apply(trainer.optimizer, trainer.step)
            COUNTER.enabled = True
            trainer.compute_gradients(trainer.data.next_step())
            grads = sum(p.grad.numel() * p.grad.element_size() for p in trainer.model.parameters()
                        if p.grad is not None)
            trainer.apply_gradients()
            COUNTER.enabled = False
        elapsed = (time.perf_counter() - t0) / steps
        groups = {f.name: list(getattr(trainer.groups, f.name).ranks) for f in dataclasses.fields(trainer.groups)
                  if hasattr(getattr(trainer.groups, f.name), "ranks")}
        record = {"layout": name, "rank": rank, "world": world, "steps": steps, "step_time": elapsed,
                  "describe": trainer.layout.describe(), "groups": groups,
                  "records": [[*k, *v] for k, v in COUNTER.records.items()],
                  "memory": {**_memory(trainer), "grads": grads}}
        (Path(out_dir) / name).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name / f"rank{rank}.json").write_text(json.dumps(record))


# ---- report ----------------------------------------------------------------------------------------
GROUP_ORDER = ("tp", "ep", "etp", "engram", "dp_cp", "expert_dp", "engram_replica", "stage", "world")
REPLICA_GROUPS = ("dp_cp", "expert_dp", "engram_replica")


def _ring_wire(term, g: int) -> float:
    """Ring-algorithm bytes a rank sends for an analytic term (payload convention of comm_model)."""
    if g < 2:
        return 0.0
    if "all-reduce" in term.what or "scalars" in term.what:
        return 2 * (g - 1) / g * term.bytes
    return (g - 1) / g * term.bytes


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("—" if not a else "inf")


def report(out_dir: Path, layouts: list[str], base: list[str], detail: bool) -> None:
    from comm_model import Geometry, analytic_volume, estimate_memory, group_sizes

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.parallel.layout import ParallelLayout
    from tests.parallel.parity import RECIPE

    rows, mem_rows = [], []
    replica_wire: dict[str, tuple[float, float]] = {}  # layout -> (measured, analytic) wire of the replica groups
    for name in layouts:
        world = LAYOUTS[name][0]
        recs = [json.loads((out_dir / name / f"rank{r}.json").read_text()) for r in range(world)]
        steps = recs[0]["steps"]
        recipe = load_recipe(RECIPE, [*base, *LAYOUTS[name][1]])
        t = recipe.training
        layout = ParallelLayout.from_recipe(recipe, world)
        terms = analytic_volume(recipe.model, layout, Geometry(t.micro_batch_size, t.seq_length, t.global_batch_size),
                                sinkhorn_iters=recipe.optimizer.sinkhorn_iters,
                                grad_bucket_mb=recipe.parallel.grad_bucket_mb, rules=recipe.optimizer.rules)
        measured: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        by_op: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for rec in recs:
            for group, op, where, calls, payload, wire in rec["records"]:
                for acc, key in ((measured, group), (by_op, (group, op, where))):
                    acc[key][0] += calls / (world * steps)
                    acc[key][1] += payload / (world * steps)
                    acc[key][2] += wire / (world * steps)
        analytic: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for term in terms:
            analytic[term.group][0] += term.calls
            analytic[term.group][1] += term.bytes
        sizes = group_sizes(layout)
        an_wire = sum(_ring_wire(term, sizes[term.group]) for term in terms if term.group in REPLICA_GROUPS)
        replica_wire[name] = (sum(measured.get(k, [0, 0.0, 0.0])[2] for k in REPLICA_GROUPS), an_wire)
        kinds = [k for k in GROUP_ORDER if k in measured or k in analytic]
        kinds += sorted(set(measured) - set(kinds))
        print(f"\n{name}: {recs[0]['describe']}  ({steps} steps, {sum(r['step_time'] for r in recs) / world:.2f} s/step)")
        for k in kinds:
            ranks = sorted({tuple(r["groups"].get(k, ())) for r in recs}) if k != "world" else [tuple(range(world))]
            mc, mb, mw = measured.get(k, [0, 0.0, 0.0])
            ac, ab = analytic.get(k, [0, 0.0])
            rows.append((name, k, " ".join("[" + ",".join(map(str, g)) + "]" for g in ranks), f"{mc:.0f}", f"{ac:.0f}",
                         _kib(mb), _kib(ab), _ratio(mb, ab), _kib(mw)))
            if detail:
                print(f"  {k} (size {sizes.get(k, world)})")
                for (g, op, where), (c, p, w) in sorted(by_op.items()):
                    if g == k:
                        print(f"    measured  {op:24s} {where:42s} calls {c:7.1f}  {_kib(p):>10s} KiB")
                for term in terms:
                    if term.group == k:
                        print(f"    analytic  {term.what:67s} calls {term.calls:7.1f}  {_kib(term.bytes):>10s} KiB")
        est = estimate_memory(recipe.model, layout, recipe.optimizer.rules)
        for part in ("params", "grads", "optimizer"):
            values = [r["memory"][part] for r in recs]
            mem_rows.append((name, part, _kib(sum(values) / world), _kib(min(values)), _kib(max(values)),
                             _kib(est[part]), _ratio(max(values), est[part])))
        totals = [sum(r["memory"].values()) for r in recs]
        est_total = sum(est.values())
        mem_rows.append((name, "total", _kib(sum(totals) / world), _kib(min(totals)), _kib(max(totals)),
                         _kib(est_total), _ratio(max(totals), est_total)))
    print("\nBytes per rank per optimiser step, by process group (KiB; payload convention of bench/comm_model.py)")
    _table(("layout", "group", "ranks", "calls", "calls(an)", "measured", "analytic", "meas/an", "wire"), rows)
    print("\nPer-rank memory after a step (KiB): parameters, gradients (after reduction), optimiser state")
    _table(("layout", "what", "mean", "min rank", "max rank", "estimate", "max/est"), mem_rows)
    pairs = [(n, f"{n}_zero1") for n in layouts if f"{n}_zero1" in layouts]
    if pairs:
        print("\nZeRO-1 against plain data parallelism: wire bytes per rank per step of the replica groups "
              f"({', '.join(REPLICA_GROUPS)}), KiB (ZeRO-1 before: all-reduce + broadcast, ratio ~1.5)")
        _table(("layouts", "plain DP", "ZeRO-1", "ratio", "ratio(an)"),
               [(f"{a} / {b}", _kib(replica_wire[a][0]), _kib(replica_wire[b][0]),
                 _ratio(replica_wire[b][0], replica_wire[a][0]), _ratio(replica_wire[b][1], replica_wire[a][1]))
                for a, b in pairs])


def _table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    left = {0, 1, 2}
    fmt = lambda r: "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    last = None
    for r in rows:
        if last is not None and r[0] != last:
            print()
        print(fmt(r))
        last = r[0]


def main(argv=None) -> int:
    from tests.parallel.parity import BASE
    from tests.parallel.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=2, help="optimiser steps counted per layout (default 2)")
    ap.add_argument("--override", action="append", default=[],
                    help="recipe override a.b=c on top of the parity-test geometry (repeatable), "
                         "e.g. model.hidden_size=128 training.seq_length=64 training.global_batch_size=16")
    ap.add_argument("--detail", action="store_true", help="per-collective measured and per-term analytic breakdown")
    ap.add_argument("--smoke", action="store_true",
                    help="two 2-rank layouts, one step, with --detail (the test suite's check that the bench runs)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layouts, args.steps, args.detail = ["tp2", "ep2"], 1, True
    base = [*BASE, *args.override]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="comm_volume_") as tmp:
        by_world: dict[int, list[str]] = defaultdict(list)
        for name in args.layouts:
            by_world[LAYOUTS[name][0]].append(name)
        for world, names in sorted(by_world.items()):
            run_distributed(world, run_layouts, names, base, args.steps, tmp)
        report(Path(tmp), args.layouts, base, args.detail)
    print(f"\n(total {time.time() - t0:.0f} s; {len(args.layouts)} layouts, {args.steps} steps each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
