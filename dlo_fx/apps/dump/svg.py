"""Render a `timeline.Prediction` as a standalone SVG (no dependencies).

One lane each for compute, H2D and AllGather; a bar per block per lane (``<rect
class="bar" data-lane=... data-block=...>``, with a ``<title>`` tooltip); stalls are red
bars in the compute lane, grey ones compute outside every block. A block keeps one
colour on every lane, so its copy, gather and compute line up by eye. The wrap-around
prefetches (the next call's first blocks) are drawn faded. A block the device budget
keeps resident (``device_budget``) computes in dark grey bars labelled ``R<n>`` (``<rect
class="resident-block" data-resident-block=n>``, n numbered as in the budget plan) and
has a marker on the copy lane where it would have been copied (``class="resident-marker"``):
it is never copied.
"""

from __future__ import annotations

import colorsys
import math
import textwrap
from xml.sax.saxutils import escape

from .record import GraphDump
from .timeline import Prediction, Timing

WIDTH = 1100
LEFT = 110
RIGHT = 24
TOP = 78
LANE_H = 34
LANE_GAP = 10
STALL = "#d62728"
RESIDENT = "#bbbbbb"
RESIDENT_BLOCK = "#8a8a8a"
LANES = (("compute", "compute"), ("h2d", "H2D copy"), ("allgather", "AllGather"))


SUBTITLE_CHARS = 170
"""A subtitle line longer than this wraps (11 px sans-serif across the picture's width)."""


def _colour(block: int) -> str:
    """A hex colour (an SVG viewer outside a browser may not read ``hsl()``: black bars)."""
    hue = 35 + (block * 137.508) % 290  # golden angle: neighbours differ; red is for stalls
    r, g, b = colorsys.hls_to_rgb(hue / 360, 0.66, 0.50)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _ms(seconds: float) -> str:
    """``"12.3 ms"``; seconds from 1,000 ms (``"9.58 s"``), microseconds below 0.01 ms."""
    ms = seconds * 1e3
    if ms >= 1000:
        return f"{seconds:.3g} s"
    return f"{ms:.3g} ms" if ms >= 0.01 else f"{seconds * 1e6:.3g} us"


def resident_runs(blocks) -> str:
    """``"R0-R3, R7"``: the resident blocks, consecutive ones as a range."""
    out, items, i = [], sorted(blocks), 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(f"R{items[i]}" if i == j else f"R{items[i]}-R{items[j]}")
        i = j + 1
    return ", ".join(out)


def _ticks(total: float) -> list[float]:
    if total <= 0:
        return [0.0]
    mag = 10 ** math.floor(math.log10(total / 8))
    for step in (mag, 2 * mag, 5 * mag, 10 * mag):
        if total / step <= 10:
            break
    n = int(total / step) + 1
    return [i * step for i in range(n)]


def render_svg(dump: GraphDump, prediction: Prediction, timing: Timing, title: str) -> str:
    """The SVG text of ``prediction`` (``title`` heads the picture and its ``<title>``)."""
    gathered = dump.mode == "allgather"
    plot_w = WIDTH - LEFT - RIGHT
    total = prediction.total_s or 1e-9
    x = lambda t: LEFT + t / total * plot_w  # noqa: E731
    call = "steady call (first blocks prefetched by the previous call)" if prediction.steady \
        else "first call"
    subtitle = (f"predicted {call}: {_ms(prediction.total_s)}, stalls "
                f"{_ms(prediction.stall_s)}")
    plan = dump.budget_plan
    kept = list(plan.resident) if plan is not None else []
    if plan is not None:
        subtitle += (f"; device_budget keeps {len(kept)} of {len(plan.block_bytes)} blocks "
                     f"resident (never copied): " + (resident_runs(kept) if kept else "none"))
    lines = textwrap.wrap(subtitle, SUBTITLE_CHARS) or [""]
    top = TOP + 16 * (len(lines) - 1)
    lanes_y = {name: top + i * (LANE_H + LANE_GAP) for i, (name, _) in enumerate(LANES)}
    height = top + len(LANES) * (LANE_H + LANE_GAP) + 56
    height += 18 if dump.budget_plan is not None and dump.budget_plan.resident else 0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title)}. {escape(subtitle)}. {escape(timing.source)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
        *(f'<text x="10" y="{38 + 16 * i}">{escape(line)}</text>'
          for i, line in enumerate(lines)),
        f'<text x="10" y="{54 + 16 * (len(lines) - 1)}" fill="#555">{escape(timing.source)}</text>',
    ]
    for name, label in LANES:
        y = lanes_y[name]
        out.append(f'<rect x="{LEFT}" y="{y}" width="{plot_w}" height="{LANE_H}" fill="#f4f4f4"/>')
        out.append(f'<text x="10" y="{y + LANE_H / 2 + 4}">{label}</text>')
        if name == "allgather" and not gathered:
            out.append(f'<text x="{LEFT + 8}" y="{y + LANE_H / 2 + 4}" fill="#777">'
                       f"none: rank-local mode, every rank holds whole blocks</text>")
    rows = {row.index: row for row in dump.blocks}
    marked: set[int] = set()
    for bar in prediction.bars:
        y = lanes_y[bar.lane]
        x0, x1 = x(bar.start), x(bar.end)
        w = max(x1 - x0, 1.0)
        opacity = ' fill-opacity="0.45"' if bar.wrap else ""
        extra = ""
        if bar.block < 0 and bar.resident_block >= 0:
            g = bar.resident_block
            fill, label, cls = RESIDENT_BLOCK, f"R{g}", "resident-block"
            extra = f' data-resident-block="{g}"'
            what = plan.labels[g] if plan is not None and g < len(plan.labels) else ""
            tip = (f"compute of block {g} ({what}), kept resident by device_budget: "
                   f"{_ms(bar.end - bar.start)}")
            if g not in marked:  # once per block: where its copy would have been
                marked.add(g)
                my = lanes_y["h2d"]
                out.append(
                    f'<path class="resident-marker" data-resident-block="{g}" '
                    f'd="M{x0:.2f},{my + 3} l4,-6 h-8 z" fill="{RESIDENT_BLOCK}"><title>'
                    f"{escape(f'block {g} ({what}) is resident (device_budget): no copy')}"
                    "</title></path>")
        elif bar.block < 0:
            fill, label, cls = RESIDENT, "r", "resident"
            tip = f"compute on resident parameters only: {_ms(bar.end - bar.start)}"
        else:
            row = rows[bar.block]
            fill = STALL if bar.kind == "stall" else _colour(bar.block)
            label = "stall" if bar.kind == "stall" else f"b{bar.block}"
            cls = "stall" if bar.kind == "stall" else "bar"
            what = {"compute": "compute", "stall": "stall waiting for", "h2d": "H2D copy of",
                    "allgather": "AllGather of"}[bar.kind]
            moved = row.shard_bytes if bar.kind == "h2d" else row.slot_bytes
            tip = (f"{what} block {bar.block} (slot {row.slot}, {moved:,} B, "
                   f"{row.fqns[0]} .. {row.fqns[-1]}): {_ms(bar.end - bar.start)}"
                   f"{' - wrap-around prefetch for the next call' if bar.wrap else ''}")
        out.append(
            f'<rect class="{cls}" data-lane="{bar.lane}" '
            f'data-kind="{bar.kind}" data-block="{bar.block}"{extra} x="{x0:.2f}" y="{y + 3}" '
            f'width="{w:.2f}" height="{LANE_H - 6}" fill="{fill}"{opacity} stroke="#333" '
            f'stroke-width="0.4"><title>{escape(tip)}</title></rect>')
        if w >= 7 * len(label) + 4:
            out.append(f'<text x="{x0 + w / 2:.2f}" y="{y + LANE_H / 2 + 4}" '
                       f'text-anchor="middle">{label}</text>')
    axis_y = top + len(LANES) * (LANE_H + LANE_GAP) + 4
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + plot_w}" y2="{axis_y}" '
               f'stroke="#333"/>')
    for t in _ticks(prediction.total_s):
        if t > prediction.total_s * 1.0001:
            break
        out.append(f'<line x1="{x(t):.2f}" y1="{axis_y}" x2="{x(t):.2f}" y2="{axis_y + 4}" '
                   f'stroke="#333"/>')
        out.append(f'<text x="{x(t):.2f}" y="{axis_y + 16}" text-anchor="middle">'
                   f"{_ms(t) if t else '0'}</text>")
    legend_y = axis_y + 36
    out.append(f'<rect x="{LEFT}" y="{legend_y - 10}" width="12" height="12" fill="{STALL}"/>')
    out.append(f'<text x="{LEFT + 18}" y="{legend_y}">stall: compute waits for a block</text>')
    out.append(f'<rect x="{LEFT + 220}" y="{legend_y - 10}" width="12" height="12" '
               f'fill="{RESIDENT}"/>')
    out.append(f'<text x="{LEFT + 238}" y="{legend_y}">r: compute on resident weights only</text>')
    out.append(f'<text x="{LEFT + 450}" y="{legend_y}">bN: graph block N (one colour on every '
               f"lane); faded: wrap-around prefetch for the next call</text>")
    if kept:
        out.append(f'<rect x="{LEFT}" y="{legend_y + 8}" width="12" height="12" '
                   f'fill="{RESIDENT_BLOCK}"/>')
        out.append(f'<text x="{LEFT + 18}" y="{legend_y + 18}">RN: compute of block N of the '
                   "budget plan, kept resident by device_budget (marked on the copy lane: "
                   "never copied)</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
