"""Picture of a pipeline schedule: one row per pipeline rank, one box per operation.

Rendered from :func:`megatron_s2.planning.schedule.timeline` (the runtime's
``schedule_order`` on a unit-time clock). Forward boxes are light, backward boxes dark; the
hue is the micro-batch, the label ``F3`` / ``B3`` (``F3.1`` with virtual stages: micro-batch 3
on virtual stage 1); each box carries ``class="op F|B"`` and ``data-*`` attributes, so the file
is also machine-checkable. SVG needs no dependency; PNG goes through matplotlib when it is
installed.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

from megatron_s2.planning.schedule import ScheduledOp, bubble_fraction

__all__ = ["render_svg", "render_png", "write_schedule"]

UNIT, ROW, MARGIN, LABEL = 28, 34, 12, 70


def _hue(mb: int) -> int:
    return (mb * 137) % 360  # golden-angle spacing: neighbours get distinct colours


def _fill(op: ScheduledOp) -> str:
    light = 78 if op.kind == "F" else 45
    return f"hsl({_hue(op.micro_batch)},65%,{light}%)"


def _label(op: ScheduledOp, virtual: int) -> str:
    return f"{op.kind}{op.micro_batch}" + (f".{op.virtual}" if virtual > 1 else "")


def render_svg(ops: list[ScheduledOp], title: str) -> str:
    ranks = max(o.rank for o in ops) + 1
    virtual = max(o.virtual for o in ops) + 1
    span = max(o.end for o in ops)
    width = LABEL + span * UNIT + 2 * MARGIN
    height = 40 + ranks * ROW + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="11">',
             f"<title>{escape(title)}</title>",
             f'<text x="{MARGIN}" y="20" font-size="13">{escape(title)}</text>']
    for r in range(ranks):
        y = 40 + r * ROW
        parts.append(f'<text x="{MARGIN}" y="{y + ROW / 2 + 4:.0f}">rank {r}</text>')
        parts.append(f'<line x1="{LABEL}" y1="{y + ROW - 2}" x2="{LABEL + span * UNIT:.0f}" y2="{y + ROW - 2}" '
                     'stroke="#ddd"/>')
    for op in ops:
        x = LABEL + op.start * UNIT
        y = 40 + op.rank * ROW
        w = (op.end - op.start) * UNIT
        text_fill = "#000" if op.kind == "F" else "#fff"
        parts.append(
            f'<g class="op {op.kind}" data-rank="{op.rank}" data-stage="{op.stage}" data-virtual="{op.virtual}" '
            f'data-micro-batch="{op.micro_batch}" data-start="{op.start:g}" data-end="{op.end:g}">'
            f'<rect x="{x:.1f}" y="{y}" width="{w - 1:.1f}" height="{ROW - 6}" rx="3" fill="{_fill(op)}" '
            f'stroke="#333" stroke-width="0.5"/>'
            f'<text x="{x + w / 2:.1f}" y="{y + ROW / 2 + 1:.0f}" text-anchor="middle" fill="{text_fill}">'
            f'{_label(op, virtual)}</text></g>')
    ticks = int(span)
    for t in range(0, ticks + 1, max(1, ticks // 20)):
        x = LABEL + t * UNIT
        parts.append(f'<text x="{x}" y="{height - 10}" text-anchor="middle" fill="#666">{t}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_png(ops: list[ScheduledOp], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise RuntimeError("PNG output needs matplotlib (pip install matplotlib); write .svg instead") from None
    import colorsys

    ranks = max(o.rank for o in ops) + 1
    virtual = max(o.virtual for o in ops) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, max(o.end for o in ops) * 0.35), 0.6 * ranks + 1.2))
    for op in ops:
        light = 0.78 if op.kind == "F" else 0.45
        color = colorsys.hls_to_rgb(_hue(op.micro_batch) / 360, light, 0.65)
        ax.barh(op.rank, op.end - op.start, left=op.start, color=color, edgecolor="#333", linewidth=0.5)
        ax.text((op.start + op.end) / 2, op.rank, _label(op, virtual), ha="center", va="center", fontsize=7,
                color="black" if op.kind == "F" else "white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_schedule(ops: list[ScheduledOp], title: str, path: str | Path) -> Path:
    """Write the picture; the format follows the suffix (.svg or .png)."""
    path = Path(path)
    full_title = f"{title} — bubble {bubble_fraction(ops):.1%}"
    if path.suffix.lower() == ".png":
        render_png(ops, full_title, path)
    elif path.suffix.lower() == ".svg":
        path.write_text(render_svg(ops, full_title))
    else:
        raise ValueError(f"{path}: choose a .svg or .png file name")
    return path
