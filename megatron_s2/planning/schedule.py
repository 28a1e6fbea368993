"""The pipeline schedule as data: in-flight micro-batches and a unit-time timeline.

Both are derived from :func:`megatron_s2.pipeline.schedules.schedule_order` — the order of
(F|B, virtual stage, micro-batch) that each pipeline rank executes at run time — so the
memory plan and the picture describe the schedule the runtime runs, 1F1B or interleaved.

* :func:`peak_inflight` replays one rank's order: a forward makes the unit's activations
  live, its backward releases them; the peak of the live sum (with per-virtual-stage sizes)
  is what the rank must hold.
* :func:`timeline` places every operation of every rank on a clock (unit-time model: a
  forward takes ``f`` units, a backward ``b``): an operation starts when its rank is free and
  its dependency is done — the forward of the previous stage for the same micro-batch, the
  backward of the next stage (or the own forward on the last stage). Ranks execute their
  order strictly, like the runtime's blocking point-to-point transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_s2.pipeline.schedules import schedule_order

__all__ = ["ScheduledOp", "peak_inflight", "timeline", "bubble_fraction"]


def peak_inflight(p: int, v: int, m: int, rank: int, unit_bytes: dict[int, float] | None = None
                  ) -> tuple[float, int]:
    """(peak live bytes, peak number of live units) of pipeline rank ``rank``.

    ``unit_bytes[vi]``: bytes one micro-batch holds on the rank's virtual stage ``vi``
    (default 1 each, i.e. count units)."""
    sizes = unit_bytes or {}
    live = count = 0.0
    peak_bytes, peak_units = 0.0, 0
    for op, vi, _ in schedule_order(p, v, m, rank):
        delta = sizes.get(vi, 1.0)
        if op == "F":
            live += delta
            count += 1
            peak_bytes, peak_units = max(peak_bytes, live), max(peak_units, int(count))
        else:
            live -= delta
            count -= 1
    return peak_bytes, peak_units


@dataclass(frozen=True)
class ScheduledOp:
    rank: int
    kind: str          # "F" | "B"
    virtual: int       # virtual stage index on the rank
    stage: int         # global (virtual) stage id
    micro_batch: int
    start: float
    end: float


def timeline(p: int, v: int, m: int, *, forward: float = 1.0, backward: float = 2.0) -> list[ScheduledOp]:
    """Every operation of every rank with its start and end time (see module docstring)."""
    orders = [schedule_order(p, v, m, r) for r in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    nxt, free = [0] * p, [0.0] * p
    out: list[ScheduledOp] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            if nxt[r] >= len(orders[r]):
                continue
            op, vi, mb = orders[r][nxt[r]]
            stage = vi * p + r
            if op == "F":
                dep = ("F", stage - 1, mb) if stage > 0 else None
            else:
                dep = ("B", stage + 1, mb) if stage < last else ("F", stage, mb)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done[dep] if dep else 0.0)
            end = start + (forward if op == "F" else backward)
            done[(op, stage, mb)] = end
            free[r] = end
            out.append(ScheduledOp(r, op, vi, stage, mb, start, end))
            nxt[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule_order({p}, {v}, {m}) deadlocks under blocking transport")
    return out


def bubble_fraction(ops: list[ScheduledOp]) -> float:
    """Idle share of the ranks between the first start and the last end."""
    if not ops:
        return 0.0
    span = max(o.end for o in ops) - min(o.start for o in ops)
    ranks = {o.rank for o in ops}
    busy = sum(o.end - o.start for o in ops)
    return 1.0 - busy / (span * len(ranks))
