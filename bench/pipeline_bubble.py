"""Pipeline bubble, step time vs torch.distributed.pipelining, payload bytes per cut, shared-state memory.

    python bench/pipeline_bubble.py                  # everything, tiny model, ~4 min on 2 cores
    python bench/pipeline_bubble.py --parts a b      # only the bubble and the torch comparison
    python bench/pipeline_bubble.py --m2 2 4 8 16 --m4 4 8 16 --repeats 5 --override training.seq_length=64
    python bench/pipeline_bubble.py --smoke          # every part once, smallest sizes (test suite)

The tiny recipe with the parity-test geometry (``tests/parallel/parity.py``: seq 32,
micro-batch 2) runs through the real :class:`~megatron_s2.training.trainer.Trainer` on spawned
gloo processes (one process per pipeline rank, one torch thread each); a step's micro-batches
are drawn once and reused for every repetition, gradients are zeroed between runs.

**(a) Bubble.** For p = 2 (layers split 4+4, the encoder/decoder boundary) and p = 4
(2+2+2+2), 1F1B and interleaved 1F1B (v = 2 virtual stages per rank), several m (micro-batches
per step): measured idle fraction of each rank = time blocked in pipeline receives
(``PipelineTransport.wait_time``) / the rank's forward-backward wall time, in the fastest of
``--repeats`` runs (the one least disturbed by other processes), against the theory

    1F1B:         (p - 1) / (m + p - 1)
    interleaved:  (p - 1) / (v m + p - 1)

which assumes equal stage times and free communication. The receive wait misses one part of
the bubble: after its last backward the last stage has nothing to receive and waits for the
drain inside the step's final loss reduction, so "+tail" adds the time from the rank's last
micro-batch to the end of the step. "compute" = wall - wait - tail per rank; its max/min ratio
shows the stage imbalance the theory ignores. For 1F1B a second table says where the idle time
goes: the theory again with each stage's *measured* compute per micro-batch ``c_i`` (the first
micro-batch crosses every stage, the other m - 1 follow at the slowest stage's pace:
``T = (m-1) max c + sum c``, ``idle_i = 1 - m c_i / T``), the tail's share, and the share of
time spent packing and posting payload sends.

**(b) Step time vs ``torch.distributed.pipelining.Schedule1F1B``** on the same stages (the same
model objects, the same layers, embedding and head), the same micro-batches and the same
objective: each rank's stage is wrapped in a ``PipelineStage`` whose module runs our stage
(import payload -> ``run_layers`` -> export payload) and returns our payload fields as a tuple,
plus the running auxiliary loss (MoE balance + indexer alignment) as one extra differentiable
field so every stage's auxiliary objective is back-propagated exactly as in our schedule; the
last stage returns the micro-batch objective (``scale_grads=False``). Shapes are given
statically (``input_args`` / ``output_args`` from ``PayloadSpec``). The script checks that both
schedules produce bit-identical gradients. Step time = max over ranks of the barrier-started
forward-backward wall time, median of ``--repeats`` alternating runs; "wait" is time blocked in
receives (ours) / in ``_wait_batch_p2p`` (theirs); "tail" is our time from the last
micro-batch to the end (send flush, shadow gradient sync, loss/metric reductions).

**(c) Payload bytes per micro-batch per cut** (``PayloadSpec``), without and with shadow
replicas (``PayloadModes(index_k="shadow", candidates="shadow")``): every cut of the tiny plan
— analytic and measured (``PipelineTransport.bytes_sent`` per micro-batch on a PP2 run cut
there: forward payload sent by stage 0, gradients sent back by stage 1) — and every cut of the
flagship plan (analytic; ``--flagship-seq`` 65536, micro-batch 1, tp 1; consecutive cuts with
the same fields are merged).

**(d) Shared-state memory vs micro-batches in flight**: the runtime's ``peak_state_bytes`` and
``peak_in_flight`` per rank for m = 2, 4, 8, 16 at p = 2, cut [5, 3] (main KV, index K, top-k
and candidate pool of layers 4/5 cross), against ``min(m, p - rank) x PayloadSpec.state_bytes()``.

Caveats: p = 4 runs 4 processes on the machine's cores (2 on CI): when all ranks compute at
once they share cores, so p = 4 wall times, idle fractions and ratios are oversubscribed
numbers. The tiny model's stages take milliseconds, so per-message Python overhead is
visible in every column.

Not part of the test suite; prints tables and exits 0. Output of one run: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from itertools import groupby
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHADOW = ["parallel.payload_index_k=shadow", "parallel.payload_candidates=shadow"]
BATCH_KEYS = ("tokens", "labels", "loss_mask", "doc_ids", "position_ids")


# ---- our stage inside torch.distributed.pipelining ----------------------------------------------
class OurStage(nn.Module):
    """One (non-virtual) pipeline stage of the V4.1 model as a ``PipelineStage`` module.

    Positional inputs: the first stage's token ids, or the incoming payload fields followed by
    the running auxiliary loss ``[1]``. Keyword inputs (all stages): the micro-batch fields.
    Output: the outgoing payload fields + running auxiliary loss, or on the last stage the
    micro-batch objective (token loss / global tokens + auxiliary losses / micro-batches)."""

    def __init__(self, model, runtime, stage: int, num_micro_global: int):
        super().__init__()
        self.model, self.rt, self.stage, self.num_micro_global = model, runtime, stage, num_micro_global
        self.global_tokens: torch.Tensor | None = None

    def forward(self, *payload, labels, loss_mask, doc_ids, position_ids, tokens=None):
        from megatron_s2.pipeline.step import make_context

        model, rt, stage = self.model, self.rt, self.stage
        if rt.is_first(stage):
            tokens, payload = payload[0], ()
        mb = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "doc_ids": doc_ids,
              "position_ids": position_ids}
        ctx = make_context(model, mb)
        rt.request_exports(stage, ctx)
        if rt.is_first(stage):
            x, pre = model.embed(tokens)
            aux_in = None
        else:
            spec = rt.spec_for(stage, mb)
            received, aux_in = list(payload[:-1]), payload[-1]
            x, pre = received[0], received[1]
            rt.import_states(stage, spec, received, ctx)
        x, pre = model.run_layers((x, pre), ctx, layer_ids=rt.stage_layers[stage])
        aux = ctx.total_aux_loss()
        aux = (aux / self.num_micro_global).reshape(1) if aux is not None else torch.zeros(1)
        if aux_in is not None:
            aux = aux + aux_in
        if rt.is_last(stage):
            token_loss = model.loss(model.head(x, pre), labels)
            return ((token_loss * loss_mask).sum() / self.global_tokens + aux).reshape(())
        return (*rt.export(stage, (x, pre), ctx, mb), aux)


def _meta(spec) -> tuple[torch.Tensor, ...]:
    fields = tuple(torch.empty(f.shape, dtype=f.dtype, device="meta", requires_grad=f.requires_grad)
                   for f in spec.fields)
    return fields + (torch.empty(1, device="meta", requires_grad=True),)


_TORCH_P2P_WAIT = [0.0]


def _time_torch_p2p_waits() -> None:
    """Accumulate the time ``Schedule1F1B`` spends in ``_wait_batch_p2p`` (its receive/send waits)."""
    import torch.distributed.pipelining.schedules as pipe_schedules

    original = pipe_schedules._wait_batch_p2p
    if getattr(original, "_timed", False):
        return

    def timed_wait(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            _TORCH_P2P_WAIT[0] += time.perf_counter() - t0

    timed_wait._timed = True
    pipe_schedules._wait_batch_p2p = timed_wait


class TorchSchedule:
    """``Schedule1F1B`` over :class:`OurStage`; ``run()`` does one forward-backward step."""

    def __init__(self, trainer, micro_batches: list[dict]):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        rt = trainer.pipeline
        if rt.vpp != 1:
            raise ValueError("Schedule1F1B runs one stage per rank (vpp = 1)")
        stage = rt.stages[0]
        self.module = OurStage(trainer.model, rt, stage, trainer.num_micro_global)
        self.module.global_tokens = sum(mb["loss_mask"].sum() for mb in micro_batches).float()
        mb0 = micro_batches[0]
        inputs = ((torch.empty(mb0["tokens"].shape, dtype=mb0["tokens"].dtype, device="meta"),) if rt.is_first(stage)
                  else _meta(rt.spec_for(stage, mb0)))
        outputs = (torch.empty((), device="meta", requires_grad=True) if rt.is_last(stage)
                   else _meta(rt.spec_for(stage + 1, mb0)))
        self.stage = PipelineStage(self.module, stage, rt.num_stages(), torch.device("cpu"), input_args=inputs,
                                   output_args=outputs, group=trainer.groups.pp.pg)
        self.m = len(micro_batches)
        self.schedule = Schedule1F1B(self.stage, self.m, loss_fn=lambda out, target: out, scale_grads=False)
        batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in BATCH_KEYS}
        self.args = (batch.pop("tokens"),) if rt.is_first(stage) else ()
        self.kwargs = batch
        _time_torch_p2p_waits()

    @property
    def wait_time(self) -> float:
        return _TORCH_P2P_WAIT[0]

    def run(self) -> None:
        if self.stage.is_last:
            self.schedule.step(*self.args, target=torch.zeros(self.m), return_outputs=False, **self.kwargs)
        else:
            self.schedule.step(*self.args, return_outputs=False, **self.kwargs)


# ---- worker ---------------------------------------------------------------------------------------
def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_task(rank: int, world: int, task: dict, base: list[str], out_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.pipeline.step import StepInputs
    from megatron_s2.training.trainer import Trainer
    from tests.parallel.parity import RECIPE

    run_dir = Path(out_dir) / task["name"] / "run"
    recipe = load_recipe(RECIPE, [*base, *task["overrides"], f"training.run_dir={run_dir}"])
    trainer = Trainer(recipe, run_dir, rank=rank, world_size=world, log=lambda *a, **k: None)
    rt = trainer.pipeline
    transport = rt.transport
    micro_batches = trainer.data.next_step()
    inputs = StepInputs(micro_batches, trainer.groups, trainer.num_micro_global)
    flush_at, send_time = [0.0], [0.0]
    original_flush, original_send = transport.flush, transport.send

    def timed_flush():
        flush_at[0] = time.perf_counter()
        original_flush()

    def timed_send(*a, **k):
        t0 = time.perf_counter()
        original_send(*a, **k)
        send_time[0] += time.perf_counter() - t0

    transport.flush, transport.send = timed_flush, timed_send

    def ours() -> dict:
        trainer.model.zero_grad(set_to_none=True)
        dist.barrier()
        w0, b0, s0 = transport.wait_time, transport.bytes_sent, send_time[0]
        t0 = time.perf_counter()
        trainer.forward_backward(trainer.model, inputs)
        t1 = time.perf_counter()
        return {"time": t1 - t0, "wait": transport.wait_time - w0, "tail": t1 - flush_at[0],
                "bytes": transport.bytes_sent - b0, "send": send_time[0] - s0}

    record = {"task": task, "rank": rank, "stages": rt.stages, "m": len(micro_batches),
              "stage_layers": [list(s) for s in rt.stage_layers]}
    ours()  # warm-up
    if task["kind"] == "payload":
        record["ours"] = [ours()]
    elif task["kind"] == "state":
        record["ours"] = [ours()]
        record["peak_state_bytes"] = rt.peak_state_bytes
        record["peak_in_flight"] = rt.peak_in_flight
        spec = rt.spec_for(rt.stages[0] + 1, micro_batches[0]) if not rt.is_last(rt.stages[0]) else \
            rt.spec_for(rt.stages[0], micro_batches[0])
        record["state_bytes_per_mb"] = spec.state_bytes()
    else:
        theirs = TorchSchedule(trainer, micro_batches) if task.get("torch") else None
        if theirs is not None:
            reference = _grads(trainer.model)
            trainer.model.zero_grad(set_to_none=True)
            dist.barrier()
            theirs.run()  # warm-up (and the gradient check)
            got = _grads(trainer.model)
            record["grad_max_abs_diff"] = max(float((reference[n] - got[n]).abs().max()) for n in reference)
            record["grad_names_equal"] = set(reference) == set(got)
        record["ours"], record["theirs"] = [], []
        for _ in range(task["repeats"]):
            record["ours"].append(ours())
            if theirs is not None:
                trainer.model.zero_grad(set_to_none=True)
                dist.barrier()
                w0 = theirs.wait_time
                t0 = time.perf_counter()
                theirs.run()
                record["theirs"].append({"time": time.perf_counter() - t0, "wait": theirs.wait_time - w0})
    return record


def worker(rank: int, world: int, tasks: list[dict], base: list[str], out_dir: str) -> None:
    for task in tasks:
        record = _run_task(rank, world, task, base, out_dir)
        path = Path(out_dir) / task["name"]
        path.mkdir(parents=True, exist_ok=True)
        (path / f"rank{rank}.json").write_text(json.dumps(record))


# ---- analytic payload table -------------------------------------------------------------------------
def payload_rows(cfg, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = False) -> list[dict]:
    """Every cut of ``cfg``'s plan: fields and bytes per micro-batch, send vs shadow replicas."""
    from megatron_s2.models.v41.pipeline.payload import PayloadModes, PayloadSpec

    stream = seq // tp if sequence_parallel else seq
    rows = []
    for cut in range(1, cfg.num_layers):
        specs = {mode: PayloadSpec.build(cfg, cfg.plan, cut, modes, batch=batch, local_seq=seq, full_seq=seq,
                                         stream_seq=stream, tp_size=tp)
                 for mode, modes in (("send", PayloadModes()), ("shadow", PayloadModes("shadow", "shadow")))}
        rows.append({"cut": cut,
                     **{f"{mode}_fields": [f.name for f in s.fields[2:]] for mode, s in specs.items()},
                     **{f"{mode}_bytes": s.nbytes for mode, s in specs.items()},
                     **{f"{mode}_state": s.state_bytes() for mode, s in specs.items()},
                     **{f"{mode}_grad": sum(f.nbytes for f in s.fields if f.requires_grad) for mode, s in specs.items()},
                     "streams": specs["send"].fields[0].nbytes + specs["send"].fields[1].nbytes})
    return rows


# ---- report -------------------------------------------------------------------------------------------
def _table(header, rows, left=(0,)) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in (tuple(header), *rows)) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(fmt(r))


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _load(out_dir: Path, task: dict, world: int) -> list[dict]:
    return [json.loads((out_dir / task["name"] / f"rank{r}.json").read_text()) for r in range(world)]


def report_bubble(out_dir: Path, tasks: list[dict]) -> None:
    print("\n(a) Idle fraction per rank, from the fastest of the repeats (the one least disturbed by other "
          "processes):\n    recv = time blocked in pipeline receives / the rank's forward-backward wall time;\n    +tail adds the time after the rank's last micro-batch (send flush, "
          "loss/metric reductions: the last stage waits there for the drain)")
    rows, cmp_rows, where_rows = [], [], []
    for task in tasks:
        recs = _load(out_dir, task, task["p"])
        p, v, m = task["p"], task["v"], recs[0]["m"]
        theory = (p - 1) / (v * m + p - 1)
        n = len(recs[0]["ours"])
        best = min(range(n), key=lambda i: max(r["ours"][i]["time"] for r in recs))  # least disturbed repeat
        runs = [r["ours"][best] for r in recs]
        idle = [o["wait"] / o["time"] for o in runs]
        idle_tail = [(o["wait"] + o["tail"]) / o["time"] for o in runs]
        compute = [o["time"] - o["wait"] - o["tail"] for o in runs]
        mean, mean_tail = statistics.mean(idle), statistics.mean(idle_tail)
        rows.append((f"{'1F1B' if v == 1 else f'interleaved v={v}'}", p, m, f"{theory:.3f}",
                     " ".join(f"{x:.3f}" for x in idle), f"{mean:.3f}", " ".join(f"{x:.3f}" for x in idle_tail),
                     f"{mean_tail:.3f}", f"{mean_tail / theory:.2f}", f"{max(compute) / min(compute):.2f}"))
        if v == 1:
            # 1F1B with unequal stages: the first micro-batch crosses every stage, the other m - 1
            # follow at the slowest stage's pace -> T = (m - 1) max c + sum c, idle_i = 1 - m c_i / T
            # (c_i = stage i's compute per micro-batch, measured). Median over the repeats.
            med = lambda f: statistics.median(f(i) for i in range(n))
            def imbalance_theory(i):
                c = [(r["ours"][i]["time"] - r["ours"][i]["wait"] - r["ours"][i]["tail"]) / m for r in recs]
                span = (m - 1) * max(c) + sum(c)
                return statistics.mean(1 - m * x / span for x in c)
            measured = med(lambda i: statistics.mean((r["ours"][i]["wait"] + r["ours"][i]["tail"]) / r["ours"][i]["time"]
                                                     for r in recs))
            sends = med(lambda i: statistics.mean(r["ours"][i].get("send", 0.0) / r["ours"][i]["time"] for r in recs))
            tail = med(lambda i: statistics.mean(r["ours"][i]["tail"] / r["ours"][i]["time"] for r in recs))
            with_imbalance = med(imbalance_theory)
            where_rows.append((p, m, f"{theory:.3f}", f"{with_imbalance:.3f}", f"{measured:.3f}",
                               f"{measured / theory:.2f}", f"{measured / with_imbalance:.2f}", f"{tail:.3f}",
                               f"{sends:.3f}"))
        if task.get("torch"):
            n = len(recs[0]["ours"])
            ours = [max(r["ours"][i]["time"] for r in recs) for i in range(n)]
            theirs = [max(r["theirs"][i]["time"] for r in recs) for i in range(n)]
            o_med, t_med = statistics.median(ours), statistics.median(theirs)
            med = lambda r, side, f: statistics.median(f(x) for x in r[side])
            o_wait = statistics.mean(med(r, "ours", lambda x: x["wait"]) for r in recs)
            t_wait = statistics.mean(med(r, "theirs", lambda x: x["wait"]) for r in recs)
            o_busy = statistics.mean(med(r, "ours", lambda x: x["time"] - x["wait"] - x["tail"]) for r in recs)
            t_busy = statistics.mean(med(r, "theirs", lambda x: x["time"] - x["wait"]) for r in recs)
            tail0 = med(recs[0], "ours", lambda x: x["tail"])
            same = all(r["grad_names_equal"] and r["grad_max_abs_diff"] == 0.0 for r in recs)
            cmp_rows.append((p, m, f"{o_med * 1e3:.0f}", f"{t_med * 1e3:.0f}", f"{o_med / t_med:.3f}",
                             f"{min(ours) / min(theirs):.3f}", f"{o_busy * 1e3:.0f}", f"{t_busy * 1e3:.0f}",
                             f"{o_wait * 1e3:.0f}", f"{t_wait * 1e3:.0f}", f"{tail0 * 1e3:.1f}", "yes" if same else
                             f"NO (max |diff| {max(r['grad_max_abs_diff'] for r in recs):.1e})"))
    _table(("schedule", "p", "m", "theory", "recv per rank", "mean", "recv+tail per rank", "mean", "mean/theory",
            "compute max/min"), rows)
    if where_rows:
        print("\n    Where 1F1B's idle time goes (median of the repeats, mean over ranks, fractions of the step): "
              "theory = equal stages;\n    + imbalance = the same schedule with each stage's measured compute; "
              "measured = recv + tail; tail = after the last backward\n    (drain + loss/metric all-reduce); "
              "sends = packing + isend (counted as busy time, not idle)")
        _table(("p", "m", "theory", "+ imbalance", "measured", "meas/theory", "meas/(+imbalance)", "tail", "sends"),
               where_rows)
    if cmp_rows:
        print("\n(b) Step time, ours vs torch.distributed.pipelining.Schedule1F1B (same stages, micro-batches, "
              "objective; ms).\n    step = max over ranks (median / min of repeats); busy = wall - waits (- our "
              "tail), mean over ranks; tail r0 = rank 0's time after its last backward")
        _table(("p", "m", "ours", "torch", "ours/torch median", "ours/torch min", "busy ours", "busy torch",
                "wait ours", "wait torch", "tail r0", "identical grads"), cmp_rows)


def report_payload(out_dir: Path, tasks: list[dict], tiny, flagship, args) -> None:
    print(f"\n(c) Payload bytes per micro-batch per cut — tiny (micro-batch {args.mbs}, seq {args.seq}); "
          "fwd = payload sent by stage 0, bwd = gradients sent back")
    measured = {}
    for task in tasks:
        recs = _load(out_dir, task, 2)
        m = recs[0]["m"]
        measured[(task["cut"], task["mode"])] = (recs[0]["ours"][0]["bytes"] / m, recs[1]["ours"][0]["bytes"] / m)
    rows = []
    for row in payload_rows(tiny, batch=args.mbs, seq=args.seq):
        for mode in ("send", "shadow"):
            fwd, bwd = measured.get((row["cut"], mode), (None, None))
            rows.append((row["cut"], mode, ", ".join(row[f"{mode}_fields"]) or "—", f"{row[f'{mode}_bytes']:,}",
                         "—" if fwd is None else f"{fwd:,.0f}", f"{row[f'{mode}_grad']:,}",
                         "—" if bwd is None else f"{bwd:,.0f}", f"{row[f'{mode}_state']:,}"))
    _table(("cut", "mode", "shared-state fields (besides x, pre)", "fwd analytic B", "fwd measured B",
            "bwd analytic B", "bwd measured B", "state B"), rows, left=(0, 1, 2))
    fs = args.flagship_seq
    frows = payload_rows(flagship, batch=1, seq=fs, tp=args.flagship_tp, sequence_parallel=args.flagship_tp > 1)
    print(f"\n    flagship (micro-batch 1, seq {fs:,}, tp {args.flagship_tp}; streams x + pre = "
          f"{_bytes(frows[0]['streams'])} per cut, float32 as PayloadSpec declares)")
    rows = []
    for _, group in groupby(frows, key=lambda r: (r["send_fields"], r["shadow_fields"])):
        group = list(group)
        r = group[0]
        cuts = f"{group[0]['cut']}" if len(group) == 1 else f"{group[0]['cut']}-{group[-1]['cut']}"
        rows.append((cuts, ", ".join(r["send_fields"]) or "—", _bytes(r["send_bytes"]), _bytes(r["send_state"]),
                     ", ".join(r["shadow_fields"]) or "—", _bytes(r["shadow_bytes"]), _bytes(r["shadow_state"]),
                     f"{1 - r['shadow_bytes'] / r['send_bytes']:.0%}"))
    _table(("cuts", "fields (send)", "total", "state", "fields (shadow)", "total", "state", "saved"), rows,
           left=(0, 1, 4))


def report_state(out_dir: Path, tasks: list[dict]) -> None:
    print("\n(d) Shared-state memory held at the stage boundary vs micro-batches per step (p = 2, cut [5, 3])")
    rows = []
    for task in tasks:
        recs = _load(out_dir, task, 2)
        m = recs[0]["m"]
        per_mb = recs[0]["state_bytes_per_mb"]
        rows.append((m, " ".join(str(r["peak_in_flight"]) for r in recs),
                     " ".join(f"{r['peak_state_bytes']:,}" for r in recs),
                     " ".join(f"{min(m, 2 - r['rank']) * per_mb:,}" for r in recs), f"{per_mb:,}"))
    _table(("m", "peak in flight (rank 0 1)", "peak_state_bytes (rank 0 1)", "expected min(m, p-rank) x state",
            "state B / micro-batch"), rows)


# ---- main -------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from megatron_s2.config.recipe import load_recipe
    from tests.parallel.parity import BASE, RECIPE
    from tests.parallel.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["a", "b", "c", "d"], choices=["a", "b", "c", "d"])
    ap.add_argument("--m2", nargs="+", type=int, default=[2, 4, 8], help="micro-batches per step at p = 2")
    ap.add_argument("--m4", nargs="+", type=int, default=[4, 8], help="micro-batches per step at p = 4 (0 = skip p = 4)")
    ap.add_argument("--state-m", nargs="+", type=int, default=[2, 4, 8, 16], help="micro-batches for part (d)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions per configuration")
    ap.add_argument("--flagship-seq", type=int, default=65536)
    ap.add_argument("--flagship-tp", type=int, default=1, help="tensor parallel (with SP) for the flagship payload table")
    ap.add_argument("--cuts", nargs="+", type=int, default=None, help="cuts measured in part (c) (default: all)")
    ap.add_argument("--override", action="append", default=[], help="recipe override a.b=c (repeatable)")
    ap.add_argument("--smoke", action="store_true",
                    help="every part once at its smallest size (the test suite's check that the bench runs)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.m2, args.m4, args.state_m, args.repeats, args.cuts = [2], [0], [2], 1, [4]
        args.flagship_seq = 4096
    base = [*BASE, *args.override]
    recipe = load_recipe(RECIPE, base)
    args.mbs, args.seq = recipe.training.micro_batch_size, recipe.training.seq_length
    n_layers = recipe.model.num_layers
    gbs = lambda m: f"training.global_batch_size={m * args.mbs}"

    tasks: dict[int, list[dict]] = {2: [], 4: []}
    bubble, payload, state = [], [], []
    if {"a", "b"} & set(args.parts):
        for p, ms in ((2, args.m2), (4, [m for m in args.m4 if m])):
            for v in (1, 2):
                for m in ms:
                    if v > 1 and m % p:
                        continue
                    t = {"name": f"bubble_p{p}_v{v}_m{m}", "kind": "bubble", "p": p, "v": v, "repeats": args.repeats,
                         "torch": v == 1 and "b" in args.parts,
                         "overrides": [f"parallel.pp={p}", f"parallel.vpp={v}", gbs(m)]}
                    tasks[p].append(t)
                    bubble.append(t)
    if "c" in args.parts:
        for cut in args.cuts or range(1, n_layers):
            for mode in ("send", "shadow"):
                t = {"name": f"payload_cut{cut}_{mode}", "kind": "payload", "cut": cut, "mode": mode,
                     "overrides": ["parallel.pp=2", f"parallel.pipeline_layers=[{cut},{n_layers - cut}]", gbs(2),
                                   *(SHADOW if mode == "shadow" else [])]}
                tasks[2].append(t)
                payload.append(t)
    if "d" in args.parts:
        for m in args.state_m:
            t = {"name": f"state_m{m}", "kind": "state", "overrides": ["parallel.pp=2", "parallel.pipeline_layers=[5,3]",
                                                                      gbs(m)]}
            tasks[2].append(t)
            state.append(t)

    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pipeline_bubble_") as tmp:
        for world, todo in sorted(tasks.items()):
            if todo:
                run_distributed(world, worker, todo, base, tmp)
        print(f"tiny model, micro-batch {args.mbs}, seq {args.seq}; one process (1 torch thread) per pipeline rank on "
              f"{os.cpu_count()} cores; load average before / after: {' '.join(f'{x:.1f}' for x in load0)} / "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if bubble:
            report_bubble(Path(tmp), bubble)
        if "c" in args.parts:
            flagship = load_recipe(RECIPE, [*base, "model=flagship"]).model
            report_payload(Path(tmp), payload, recipe.model, flagship, args)
        if state:
            report_state(Path(tmp), state)
    print(f"\n(total {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
