"""`megatron-s2 plan memory|layouts|schedule`: size a run before booking the cluster.

* ``plan memory <recipe> [section.key=value ...] [--world-size N]`` — per-rank memory of every
  pipeline stage and the breakdown of the most loaded one: parameters, gradients, optimiser
  state (Muon/Sinkhorn momentum, AdamW moments, ZeRO-1 ownership), saved activations of the
  micro-batches in flight under 1F1B (CSA2 gathered keys, indexer, MoE dispatch, ...),
  pipeline payload buffers (CSA2 shared states crossing a cut), transients and Engram shards.
* ``plan layouts <recipe> --gpus N [--gpu-mem GB]`` — every layout the runtime accepts for N
  GPUs, ranked by fit, communication volume per step and memory headroom.
* ``plan schedule <recipe> [overrides] --out schedule.svg`` — the pipeline schedule of the
  layout as a picture (SVG; PNG with matplotlib).

Everything is computed from the same config and layout objects the runtime builds
(``megatron_s2.planning``).
"""

from __future__ import annotations

import argparse
import json

from megatron_s2.config.recipe import load_recipe

__all__ = ["register", "run_memory", "run_layouts", "run_schedule", "human"]


def human(n: float) -> str:
    for div, unit in ((1024 ** 4, "TiB"), (1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), *(line(r) for r in rows)])


def _ranges(ids: list[int]) -> str:
    """[0, 1, 4, 5] -> '0-1,4-5'; [] -> '-' (a rank without backbone layers: the contrastive towers)."""
    if not ids:
        return "-"
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ",".join(out)


def _positive(text: str) -> int:
    """``--world-size``: a positive number of ranks (0 was silently the recipe's default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_memory(args: argparse.Namespace) -> int:
    from megatron_s2.planning.memory import estimate_memory
    from megatron_s2.training.run_checks import check_phase_layout

    recipe = load_recipe(args.recipe, args.overrides)
    # a layout the phase refuses at any rank count (series / memdec: cp, etp) is not planned (review24)
    check_phase_layout(recipe)
    plan = estimate_memory(recipe, args.world_size)
    if args.json:
        print(json.dumps([{"rank": r.rank, "pp_rank": r.pp_rank, "total": r.total, "parameters": r.state.parameter_bytes,
                           "gradients": r.state.gradients, "optimizer": r.state.optimizer_bytes,
                           "saved_activations": r.saved_activations, "payload_buffers": r.payload_buffers,
                           "transient": r.transient, "engram": r.state.engram, "inflight": r.inflight,
                           "resident": r.resident}
                          for r in plan.ranks], indent=1))
        return 0
    print(f"layout: {plan.layout.describe()}")
    resident = any(r.resident for r in plan.ranks)
    rows = [[f"pp {r.pp_rank} (rank {r.rank})", _ranges(r.layers), human(r.state.parameter_bytes),
             human(r.state.gradients), human(r.state.optimizer_bytes), str(r.inflight),
             human(r.activations)] + ([human(r.resident_bytes)] if resident else []) + [human(r.total)]
            for r in plan.ranks]
    print(_table(["stage", "layers", "params", "grads", "optimizer", "units in flight", "activations"]
                 + (["rollout + frozen"] if resident else []) + ["total"], rows))
    peak = plan.peak
    print(f"\nmost loaded: pipeline stage {peak.pp_rank} (rank {peak.rank}), {human(peak.total)}")
    s = peak.state
    lines = [("parameters", s.parameter_bytes)] + [(f"  {k}", v) for k, v in sorted(s.parameters.items())]
    if s.shadow_parameters:
        lines.append(("  shadow replicas (§3.1.2)", s.shadow_parameters))
    lines += [("buffers", s.buffers), ("gradients", s.gradients), ("optimizer state", s.optimizer_bytes)]
    lines += [(f"  {k}", v) for k, v in sorted(s.optimizer.items())]
    lines.append((f"saved activations ({peak.inflight} (stage, micro-batch) units in flight of "
                  f"{peak.micro_batches} micro-batches)", peak.saved_activations))
    lines += [(f"  {k}", v) for k, v in sorted(peak.activation_parts.items(), key=lambda kv: -kv[1])]
    lines += [("pipeline payload buffers", peak.payload_buffers), ("transients", peak.transient),
              ("engram shard (table + grad + optimizer, included above)", s.engram)]
    if peak.resident:
        lines.append(("co-located rollout and frozen models (rl / opd, report §5.2.1; memdec backbone and objective)", peak.resident_bytes))
        lines += [(f"  {k}", v) for k, v in peak.resident.items()]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {human(v):>12}")
    return 0


def run_layouts(args: argparse.Namespace) -> int:
    from megatron_s2.planning.layouts import rank_layouts

    recipe = load_recipe(args.recipe, args.overrides)
    ranked, rejected = rank_layouts(recipe, args.gpus, args.gpu_mem, max_tp=args.max_tp)
    rows = []
    for i, c in enumerate(ranked[: args.top], 1):
        p = c.parallel
        rows.append([str(i), str(p.tp), "y" if p.sequence_parallel else "n", str(p.pp), str(p.vpp), str(p.cp),
                     str(c.layout.dp), str(p.ep), str(p.etp), str(p.engram_parallel), human(c.memory),
                     "-" if c.headroom is None else human(c.headroom), human(c.comm), f"{c.bubble:.0%}",
                     "yes" if c.fits else "NO"])
    print(f"{len(ranked)} valid layouts for {args.gpus} GPUs ({len(rejected)} candidates rejected by the layout "
          f"validation){'' if args.gpu_mem is None else f', {args.gpu_mem:g} GB per GPU'}")
    print(_table(["#", "tp", "sp", "pp", "vpp", "cp", "dp", "ep", "etp", "engram", "memory", "headroom",
                  "comm/step", "bubble", "fits"], rows))
    if args.show_rejected:
        for r in rejected:
            p = r.parallel
            print(f"  rejected tp={p.tp} pp={p.pp} vpp={p.vpp} cp={p.cp} ep={p.ep} etp={p.etp}: {r.reason}")
    return 0 if ranked else 1


def run_schedule(args: argparse.Namespace) -> int:
    from megatron_s2.parallel.layout import ParallelLayout
    from megatron_s2.planning.memory import default_world_size
    from megatron_s2.planning.schedule import timeline
    from megatron_s2.planning.schedule_svg import write_schedule

    recipe = load_recipe(args.recipe, args.overrides)
    layout = ParallelLayout.from_recipe(recipe, args.world_size or default_world_size(recipe))
    t = recipe.training
    m = args.micro_batches or t.global_batch_size // (t.micro_batch_size * layout.dp)
    ops = timeline(layout.pp, layout.vpp, m, forward=args.forward_units, backward=args.backward_units)
    kind = "interleaved 1F1B" if layout.vpp > 1 else ("1F1B" if layout.pp > 1 else "no pipelining")
    path = write_schedule(ops, f"{kind}: pp={layout.pp} vpp={layout.vpp}, {m} micro-batches", args.out)
    print(f"wrote {path}: {sum(o.kind == 'F' for o in ops)} forward and {sum(o.kind == 'B' for o in ops)} backward "
          f"operations on {layout.pp} pipeline ranks")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory, layout and pipeline-schedule planning", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_sub = p.add_subparsers(dest="plan_command", metavar="WHAT", required=True)

    def common(q):
        q.add_argument("recipe", help="recipe YAML")
        q.add_argument("overrides", nargs="*", help="section.key=value overrides")

    q = plan_sub.add_parser("memory", help="per-rank memory of the most loaded pipeline stage")
    common(q)
    q.add_argument("--world-size", type=_positive, default=None, help="ranks (default: from the recipe's parallel sizes)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=run_memory)

    q = plan_sub.add_parser("layouts", help="rank the valid layouts for a cluster size")
    common(q)
    q.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) available")
    q.add_argument("--gpu-mem", type=float, default=None, help="memory per GPU in GB (GiB)")
    q.add_argument("--top", type=int, default=20, help="rows to print")
    q.add_argument("--max-tp", type=int, default=8, help="largest tp / etp considered (one node)")
    q.add_argument("--show-rejected", action="store_true", help="list rejected candidates with the reason")
    q.set_defaults(func=run_layouts)

    q = plan_sub.add_parser("schedule", help="picture of the pipeline schedule (SVG, or PNG with matplotlib)")
    common(q)
    q.add_argument("--out", default="schedule.svg", help="output file (.svg or .png)")
    q.add_argument("--world-size", type=_positive, default=None)
    q.add_argument("--micro-batches", type=int, default=None, help="override the micro-batches per step")
    q.add_argument("--forward-units", type=float, default=1.0, help="duration of a forward (time units)")
    q.add_argument("--backward-units", type=float, default=2.0, help="duration of a backward (time units)")
    q.set_defaults(func=run_schedule)
