"""The pipeline schedule as data and as a picture (from the runtime's schedule_order)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from megatron_s2.planning.schedule import bubble_fraction, peak_inflight, timeline
from megatron_s2.planning.schedule_svg import render_svg, write_schedule

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("p, v, m", [(1, 1, 3), (2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 2, 6)])
def test_timeline_respects_dependencies_and_bubble_formula(p, v, m):
    ops = timeline(p, v, m)
    assert len(ops) == 2 * p * v * m
    end = {(o.kind, o.stage, o.micro_batch): o for o in ops}
    for o in ops:
        if o.kind == "F" and o.stage > 0:
            assert o.start >= end[("F", o.stage - 1, o.micro_batch)].end
        if o.kind == "B":
            dep = ("B", o.stage + 1, o.micro_batch) if o.stage < p * v - 1 else ("F", o.stage, o.micro_batch)
            assert o.start >= end[dep].end
    for r in range(p):  # a rank runs one operation at a time
        mine = sorted((o for o in ops if o.rank == r), key=lambda o: o.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    # Megatron's bubble formula for the unit-time model (backward = 2 forward units)
    assert bubble_fraction(ops) == pytest.approx((p - 1) / (v * m + p - 1))


def test_inflight_units_follow_1f1b():
    assert [peak_inflight(4, 1, 8, r)[1] for r in range(4)] == [4, 3, 2, 1]
    assert [peak_inflight(4, 1, 2, r)[1] for r in range(4)] == [2, 2, 2, 1]  # never more than m
    # interleaved: (p - r - 1) * 2 + (v - 1) * p warm-up forwards, plus the one of the steady state
    assert [peak_inflight(2, 2, 4, r)[1] for r in range(2)] == [5, 3]
    assert peak_inflight(2, 1, 4, 0, {0: 10.0})[0] == 20.0


@pytest.mark.parametrize("p, v, m", [(2, 1, 4), (4, 2, 8)])
def test_svg_is_well_formed_with_one_box_per_operation(tmp_path, p, v, m):
    path = write_schedule(timeline(p, v, m), "test schedule", tmp_path / "schedule.svg")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    boxes = [g for g in root.iter(f"{SVG}g") if "op" in g.get("class", "").split()]
    kinds = [g.get("class").split()[1] for g in boxes]
    assert kinds.count("F") == kinds.count("B") == p * v * m
    assert all(len(list(g.iter(f"{SVG}rect"))) == 1 for g in boxes)
    per_rank = {r: sum(1 for g in boxes if g.get("data-rank") == str(r)) for r in range(p)}
    assert per_rank == {r: 2 * v * m for r in range(p)}
    assert "bubble" in root.find(f"{SVG}title").text


def test_png_and_unknown_suffix(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_schedule(timeline(2, 1, 3), "png", tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="svg or .png"):
        write_schedule(timeline(2, 1, 3), "x", tmp_path / "s.pdf")
    assert render_svg(timeline(1, 1, 1), "a < b & c").count("a &lt; b &amp; c") == 2
