"""A self-contained HTML page of one or more runs: inline SVG and a few lines of JavaScript, no
network. Hovering shows the event's tensor, allocated and reserved bytes and each category."""

from __future__ import annotations

import html
import json

from memplan.viz.series import Panel
from memplan.viz.style import CACHED_FREE, LIMIT, PHASE_BANDS, RESERVED, color, gib, nice, peak_text

W, H = 1000, 380
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 28, 30


def _scale(panel: Panel) -> tuple[float, float]:
    top = max([*panel.reserved, panel.peak.allocated, panel.limit or 0, 1]) * 1.08
    span = max(panel.events - 1, 1)
    return (W - LEFT - RIGHT) / span, (H - TOP - BOTTOM) / top


def _ticks(top: float) -> list[int]:
    """Round tick values (1, 2 or 5 x 10^k GiB apart), at most six, up to ``top`` bytes."""
    gib_top = top / 2**30
    step = next(m * 10**k for k in range(-2, 6) for m in (1, 2, 5) if gib_top / (m * 10**k) <= 6)
    count = int(gib_top // step)
    return [int(i * step * 2**30) for i in range(count + 1)]


def _xs(sx: float, xs: list[int]) -> list[str]:
    """Event indices as SVG x coordinates (formatted once per panel: every polygon shares them)."""
    return [f"{LEFT + x * sx:.1f}" for x in xs]


def _ys(sy: float, ys: list[int]) -> list[str]:
    """Bytes as SVG y coordinates."""
    return [f"{H - BOTTOM - y * sy:.1f}" for y in ys]


def _points(xs: list[str], ys: list[str]) -> str:
    return " ".join(f"{x},{y}" for x, y in zip(xs, ys, strict=True))


def _svg(panel: Panel, k: int, place: str = "") -> str:
    """The chart of ``panel``; ``place``: attributes that position it inside another SVG
    (``figure.render_svg``)."""
    sx, sy = _scale(panel)
    at = f"{place} " if place else ""
    parts = [f'<svg id="chart{k}" class="chart" {at}viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg">']
    for span in panel.phases:
        x0, x1 = LEFT + span.start * sx, LEFT + max(span.end - 1, span.start) * sx
        parts.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 0.5):.1f}" height="{H - TOP - BOTTOM}" '
                     f'fill="{PHASE_BANDS.get(span.name, "#ffffff")}"><title>{span.name}</title></rect>')  # fmt: skip
        if x1 - x0 > 40:
            parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{TOP + 12}" class="phase">{span.name}</text>')
    # each stack's top is the next one's base: coordinates are formatted once and reused
    xs = _xs(sx, panel.x)
    back = xs[::-1]
    base = [0] * len(panel.x)
    base_ys = _ys(sy, base)
    for i, cat in enumerate(panel.categories):
        top = [b + v for b, v in zip(base, panel.stacks[cat], strict=True)]
        top_ys = _ys(sy, top)
        points = _points(xs, top_ys) + " " + _points(back, base_ys[::-1])
        parts.append(f'<polygon points="{points}" fill="{color(cat, i)}" stroke="none"><title>{nice(cat)}</title>'
                     "</polygon>")  # fmt: skip
        base, base_ys = top, top_ys
    reserved = _points(xs, _ys(sy, panel.reserved))
    cached = reserved + " " + _points(back, base_ys[::-1])
    parts.append(f'<polygon points="{cached}" fill="{CACHED_FREE}" opacity="0.7"><title>cached but free</title>'
                 "</polygon>")  # fmt: skip
    parts.append(f'<polyline points="{reserved}" fill="none" stroke="{RESERVED}" stroke-width="1.2"/>')
    if panel.limit:
        y = H - BOTTOM - panel.limit * sy
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="{LIMIT}" '
                     f'stroke-dasharray="6 4"/><text x="{W - RIGHT - 4}" y="{y + 13:.1f}" class="limit">'
                     f"{html.escape(panel.limit_label)}</text>")  # fmt: skip
    for value in _ticks((H - TOP - BOTTOM) / sy):
        y = H - BOTTOM - value * sy
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="tick">{gib(int(value))}</text>'
                     f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')  # fmt: skip
    p = panel.peak
    if p.event >= 0:
        px, py = LEFT + p.event * sx, H - BOTTOM - p.allocated * sy
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" class="peak"/>'
                     f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#000"/>'
                     f'<text x="{min(px + 6, W - 300):.1f}" y="{max(py - 6, TOP + 26):.1f}" class="peaktag">'
                     f"peak {gib(p.allocated)} ({html.escape(p.phase)})</text>")  # fmt: skip
    parts.append(
        f'<line id="cursor{k}" x1="0" x2="0" y1="{TOP}" y2="{H - BOTTOM}" class="cursor" visibility="hidden"/>'
    )
    parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 8}" class="axis">allocator events (alloc and free) '
                 f"in order, {panel.events:,} in all</text></svg>")  # fmt: skip
    return "".join(parts)


def _legend(panel: Panel) -> str:
    items = [f'<span><i style="background:{color(c, i)}"></i>{nice(c)}</span>' for i, c in enumerate(panel.categories)]
    items.append(f'<span><i style="background:{CACHED_FREE}"></i>cached but free</span>')
    items.append(f'<span><i style="background:{RESERVED};height:2px"></i>reserved</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def _data(panel: Panel) -> dict:
    sx, sy = _scale(panel)
    return {"x": panel.x, "cats": panel.categories, "stacks": [panel.stacks[c] for c in panel.categories],
            "reserved": panel.reserved, "labels": panel.labels, "sx": sx, "left": LEFT, "width": W}  # fmt: skip


SCRIPT = """
const GiB = 1024 ** 3;
const fmt = (n) => (n / GiB).toFixed(2) + " GiB";
document.querySelectorAll("svg.chart").forEach((svg, k) => {
  const d = DATA[k], tip = document.getElementById("tip"), cursor = document.getElementById("cursor" + k);
  svg.addEventListener("mousemove", (ev) => {
    const box = svg.getBoundingClientRect();
    const vx = (ev.clientX - box.left) * d.width / box.width;
    const event = (vx - d.left) / d.sx;
    let lo = 0, hi = d.x.length - 1;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (d.x[mid] < event) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(d.x[lo - 1] - event) < Math.abs(d.x[lo] - event)) lo -= 1;
    let total = 0; const rows = [];
    d.cats.forEach((c, j) => {
      const v = d.stacks[j][lo]; total += v;
      if (v) rows.push(c.replace(/_/g, " ") + ": " + fmt(v));
    });
    tip.textContent = "event " + d.x[lo] + ": " + d.labels[lo] + "\\nallocated " + fmt(total) + ", reserved "
      + fmt(d.reserved[lo]) + "\\n" + rows.join("\\n");
    tip.style.display = "block"; tip.style.left = (ev.pageX + 12) + "px"; tip.style.top = (ev.pageY + 12) + "px";
    const cx = d.left + d.x[lo] * d.sx;
    cursor.setAttribute("x1", cx); cursor.setAttribute("x2", cx); cursor.setAttribute("visibility", "visible");
  });
  svg.addEventListener("mouseleave", () => {
    tip.style.display = "none"; cursor.setAttribute("visibility", "hidden");
  });
});
"""

CSS = """
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
.chart { width: 100%; max-width: 1100px; height: auto; display: block; }
.phase { font-size: 11px; fill: #666; text-anchor: middle; }
.tick { font-size: 10px; fill: #555; text-anchor: end; }
.axis { font-size: 11px; fill: #555; text-anchor: middle; }
.limit { font-size: 11px; fill: #d62728; text-anchor: end; }
.grid { stroke: #e5e5e5; stroke-width: 0.5; }
.peak { stroke: #000; stroke-dasharray: 2 3; }
.peaktag { font-size: 12px; font-weight: 600; }
.cursor { stroke: #333; stroke-width: 0.6; }
.legend span { margin-right: 14px; white-space: nowrap; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 10px; margin-right: 4px; vertical-align: middle; }
.peak-label { font-size: 13px; margin: 4px 0 18px; }
#tip { position: absolute; display: none; white-space: pre; background: #fff; border: 1px solid #999;
       padding: 6px 8px; font: 12px ui-monospace, monospace; pointer-events: none; }
"""


def render_html(panels: list[Panel]) -> str:
    """The page: for each panel its title, chart, legend and peak label, then the hover script."""
    body = []
    for k, panel in enumerate(panels):
        body.append(f"<h2>{html.escape(panel.title)}</h2>{_svg(panel, k)}{_legend(panel)}"
                    f'<p class="peak-label" id="peak-label{k}">{html.escape(peak_text(panel))}</p>')  # fmt: skip
    data = json.dumps([_data(p) for p in panels], separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(panels[0].title if panels else "memplan timeline")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body>{''.join(body)}<div id=\"tip\"></div>"
            f"<script>const DATA = {data};{SCRIPT}</script></body></html>\n")  # fmt: skip
