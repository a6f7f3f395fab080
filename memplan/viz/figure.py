"""The timeline as a standalone SVG (standard library only) or a PNG (Pillow, the ``viz`` extra).

Both draw what the HTML page draws (``html._svg``: phase bands, the categories stacked, cached but
free memory, the reserved line, the allocator's limit, the peak), with the title, the legend and
the peak's label that the page writes around its chart, one panel under the other. The SVG is the
page's own chart markup with its styles inlined; the PNG rasterises the same coordinates
(``html._scale``, ``html._ticks``) with Pillow at twice the size and scales it down, which
antialiases the edges. Pillow is imported only for a ``.png``: matplotlib, which drew these
before, took 0.4-0.7 s to import on a 2-core machine, above the 0.5 s a picture may add to a cold
estimate (docs/accuracy.md).
"""

from __future__ import annotations

import html
import textwrap
from pathlib import Path

from memplan.errors import MemplanError
from memplan.viz.html import BOTTOM, LEFT, RIGHT, TOP, H, W, _scale, _svg, _ticks
from memplan.viz.output import EXTRA_HINT
from memplan.viz.series import Panel
from memplan.viz.style import CACHED_FREE, LIMIT, PHASE_BANDS, RESERVED, color, gib, nice, peak_text

TITLE_H = 26  # the panel's title above its chart
LEGEND_ROW = 20
LEGEND_CHARS = 6.6  # a 12 px sans-serif character's mean width, to lay out the legend in SVG
PEAK_WRAP = 150  # characters per line of the peak's label
PEAK_LINE = 16
FONT = "system-ui, DejaVu Sans, Helvetica, Arial, sans-serif"

# the page's chart styles (html.CSS) that the standalone SVG needs, inlined
SVG_STYLE = f"""
text {{ font-family: {FONT}; fill: #222; }}
.phase {{ font-size: 11px; fill: #666; text-anchor: middle; }}
.tick {{ font-size: 10px; fill: #555; text-anchor: end; }}
.axis {{ font-size: 11px; fill: #555; text-anchor: middle; }}
.limit {{ font-size: 11px; fill: {LIMIT}; text-anchor: end; }}
.grid {{ stroke: #e5e5e5; stroke-width: 0.5; }}
.peak {{ stroke: #000; stroke-dasharray: 2 3; }}
.peaktag {{ font-size: 12px; font-weight: 600; }}
.cursor {{ visibility: hidden; }}
.title {{ font-size: 14px; font-weight: 600; }}
.legend, .peak-label {{ font-size: 12px; }}
"""


def _legend_items(panel: Panel) -> list[tuple[str, str, bool]]:
    """(colour, label, drawn as a line) of each legend entry, in the page's order."""
    items = [(color(c, i), nice(c), False) for i, c in enumerate(panel.categories)]
    return [*items, (CACHED_FREE, "cached but free", False), (RESERVED, "reserved", True)]


def _legend_rows(panel: Panel, width_of) -> list[list[tuple[float, str, str, bool]]]:  # noqa: ANN001
    """The legend's entries laid out left to right, wrapped at the chart's width: rows of
    (x, colour, label, line)."""
    rows: list[list[tuple[float, str, str, bool]]] = [[]]
    x = LEFT
    for fill, label, line in _legend_items(panel):
        w = 16 + width_of(label) + 14
        if rows[-1] and x + w > W - RIGHT:
            rows.append([])
            x = LEFT
        rows[-1].append((x, fill, label, line))
        x += w
    return rows


def _peak_lines(panel: Panel) -> list[str]:
    return textwrap.wrap(peak_text(panel), PEAK_WRAP) or [""]


def _panel_height(panel: Panel, legend_rows: int) -> int:
    return TITLE_H + H + legend_rows * LEGEND_ROW + len(_peak_lines(panel)) * PEAK_LINE + 12


def render_svg(panels: list[Panel]) -> str:
    """One standalone SVG document: each panel's title, chart, legend and peak label."""
    parts, y = [], 0
    for k, panel in enumerate(panels):
        rows = _legend_rows(panel, lambda s: len(s) * LEGEND_CHARS)
        parts.append(f'<text x="{LEFT}" y="{y + 18}" class="title">{html.escape(panel.title)}</text>')
        parts.append(_svg(panel, k, f'x="0" y="{y + TITLE_H}" width="{W}" height="{H}"'))
        ly = y + TITLE_H + H
        for r, row in enumerate(rows):
            base = ly + r * LEGEND_ROW + 14
            for x, fill, label, line in row:
                box = (f'<rect x="{x}" y="{base - 5}" width="12" height="2" fill="{fill}"/>' if line else
                       f'<rect x="{x}" y="{base - 10}" width="12" height="10" fill="{fill}"/>')  # fmt: skip
                parts.append(f'{box}<text x="{x + 16}" y="{base}" class="legend">{html.escape(label)}</text>')
        py = ly + len(rows) * LEGEND_ROW
        for i, line in enumerate(_peak_lines(panel)):
            parts.append(f'<text x="{LEFT}" y="{py + (i + 1) * PEAK_LINE}" class="peak-label">'
                         f"{html.escape(line)}</text>")  # fmt: skip
        y += _panel_height(panel, len(rows))
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y}" viewBox="0 0 {W} {y}">'
    return f'{head}<style>{SVG_STYLE}</style><rect width="{W}" height="{y}" fill="#fff"/>{"".join(parts)}</svg>\n'


def _pillow():
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:  # check_output tells first; this covers a direct caller
        raise MemplanError(f"png needs Pillow, in the viz extra: {EXTRA_HINT}", source="--timeline") from None
    return Image, ImageDraw, ImageFont


class _Canvas:
    """Pillow's drawing at ``scale`` times the SVG's coordinates, with SVG's text anchors."""

    ANCHOR = {"start": "ls", "middle": "ms", "end": "rs"}

    def __init__(self, image_draw, font_module, scale: int, fonts: dict | None = None) -> None:  # noqa: ANN001
        """``fonts``: another canvas's loaded faces, by size (loading one parses the font)."""
        self.d, self.s, self._font_module = image_draw, scale, font_module
        self._fonts = {} if fonts is None else fonts

    def font(self, size: float):  # noqa: ANN201 - a Pillow font
        if size not in self._fonts:
            try:  # Pillow >= 10.1 with FreeType: its scalable default face
                self._fonts[size] = self._font_module.load_default(size=size * self.s)
            except TypeError:  # older Pillow: the fixed bitmap face
                self._fonts[size] = self._font_module.load_default()
        return self._fonts[size]

    def pts(self, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(x * self.s, y * self.s) for x, y in points]

    def rect(self, x0: float, y0: float, x1: float, y1: float, fill: str) -> None:
        self.d.rectangle(self.pts([(x0, y0), (x1, y1)]), fill=fill)

    def polygon(self, points: list[tuple[float, float]], fill) -> None:  # noqa: ANN001 - str or RGBA
        self.d.polygon(self.pts(points), fill=fill)

    def line(self, points: list[tuple[float, float]], fill: str, width: float) -> None:
        self.d.line(self.pts(points), fill=fill, width=max(1, round(width * self.s)), joint="curve")

    def dashed(self, p0: tuple[float, float], p1: tuple[float, float], fill: str, width: float,
               dash: float, gap: float) -> None:  # fmt: skip
        (x0, y0), (x1, y1) = p0, p1
        length = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5
        t = 0.0
        while t < length:
            a, b = t / length, min(t + dash, length) / length
            self.line([(x0 + a * (x1 - x0), y0 + a * (y1 - y0)), (x0 + b * (x1 - x0), y0 + b * (y1 - y0))], fill, width)
            t += dash + gap

    def text(self, x: float, y: float, s: str, size: float, fill: str = "#222", anchor: str = "start") -> None:
        self.d.text((x * self.s, y * self.s), s, fill=fill, font=self.font(size), anchor=self.ANCHOR[anchor])

    def width(self, s: str, size: float) -> float:
        return self.d.textlength(s, font=self.font(size)) / self.s


def _rgba(hex_color: str, alpha: float) -> tuple[int, int, int, int]:
    h = hex_color.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16), round(alpha * 255)


def _chart(c: _Canvas, panel: Panel, top: float) -> None:
    """``html._svg``'s chart, drawn at vertical offset ``top``."""
    sx, sy = _scale(panel)
    bottom = top + H - BOTTOM

    def y(v: float) -> float:
        return bottom - v * sy

    for span in panel.phases:
        x0, x1 = LEFT + span.start * sx, LEFT + max(span.end - 1, span.start) * sx
        c.rect(x0, top + TOP, x0 + max(x1 - x0, 0.5), bottom, PHASE_BANDS.get(span.name, "#ffffff"))
        if x1 - x0 > 40:
            c.text((x0 + x1) / 2, top + TOP + 12, span.name, 11, "#666", "middle")
    xs = [LEFT + x * sx for x in panel.x]
    base = [0] * len(panel.x)
    for i, cat in enumerate(panel.categories):
        stack_top = [b + v for b, v in zip(base, panel.stacks[cat], strict=True)]
        outline = [*zip(xs, map(y, stack_top), strict=True), *zip(xs[::-1], map(y, base[::-1]), strict=True)]
        c.polygon(outline, color(cat, i))
        base = stack_top
    reserved = list(zip(xs, map(y, panel.reserved), strict=True))
    c.polygon([*reserved, *zip(xs[::-1], map(y, base[::-1]), strict=True)], _rgba(CACHED_FREE, 0.7))
    for value in _ticks((H - TOP - BOTTOM) / sy):
        c.line([(LEFT, y(value)), (W - RIGHT, y(value))], "#e5e5e5", 0.5)
        c.text(LEFT - 6, y(value) + 4, gib(int(value)), 10, "#555", "end")
    if len(reserved) > 1:
        c.line(reserved, RESERVED, 1.2)
    if panel.limit:
        c.dashed((LEFT, y(panel.limit)), (W - RIGHT, y(panel.limit)), LIMIT, 1, 6, 4)
        c.text(W - RIGHT - 4, y(panel.limit) + 13, panel.limit_label, 11, LIMIT, "end")
    p = panel.peak
    if p.event >= 0:
        px, py = LEFT + p.event * sx, y(p.allocated)
        c.dashed((px, top + TOP), (px, bottom), "#000", 1, 2, 3)
        c.d.ellipse(c.pts([(px - 4, py - 4), (px + 4, py + 4)]), fill="#000")
        c.text(min(px + 6, W - 300), max(py - 6, top + TOP + 26), f"peak {gib(p.allocated)} ({p.phase})", 12)
    c.text((LEFT + W - RIGHT) / 2, top + H - 8, f"allocator events (alloc and free) in order, {panel.events:,} in all",
           11, "#555", "middle")  # fmt: skip


def render_png(panels: list[Panel], path: Path, scale: int = 2) -> None:
    """The SVG's picture as a PNG, drawn at ``scale`` x and scaled down (antialiasing)."""
    Image, ImageDraw, ImageFont = _pillow()
    probe = _Canvas(ImageDraw.Draw(Image.new("RGB", (1, 1))), ImageFont, scale)
    layouts = [_legend_rows(panel, lambda s: probe.width(s, 12)) for panel in panels]
    height = sum(_panel_height(panel, len(rows)) for panel, rows in zip(panels, layouts, strict=True))
    image = Image.new("RGB", (W * scale, max(height, 1) * scale), "#ffffff")
    c = _Canvas(ImageDraw.Draw(image, "RGBA"), ImageFont, scale, probe._fonts)
    top = 0
    for panel, rows in zip(panels, layouts, strict=True):
        c.text(LEFT, top + 18, panel.title, 14)
        _chart(c, panel, top + TITLE_H)
        ly = top + TITLE_H + H
        for r, row in enumerate(rows):
            base = ly + r * LEGEND_ROW + 14
            for x, fill, label, line in row:
                if line:
                    c.rect(x, base - 5, x + 12, base - 3, fill)
                else:
                    c.rect(x, base - 10, x + 12, base, fill)
                c.text(x + 16, base, label, 12)
        py = ly + len(rows) * LEGEND_ROW
        for i, line in enumerate(_peak_lines(panel)):
            c.text(LEFT, py + (i + 1) * PEAK_LINE, line, 12)
        top += _panel_height(panel, len(rows))
    # a box filter over each scale x scale block (``reduce``) antialiases as well as a Lanczos
    # resize here, at a quarter of its cost; zlib level 3 writes it in half the default's time
    image.reduce(scale).save(path, format="PNG", compress_level=3)


def render_figure(panels: list[Panel], path: Path, kind: str) -> None:
    """One panel under the other, written as ``kind`` (svg or png)."""
    if kind == "svg":
        path.write_text(render_svg(panels), encoding="utf-8")
    else:
        render_png(panels, path)
