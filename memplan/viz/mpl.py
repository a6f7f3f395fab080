"""The timeline as an SVG or PNG figure, drawn with matplotlib (the ``viz`` extra).

Imported only when ``--timeline`` asks for ``.svg`` or ``.png``: matplotlib stays off the
estimate path. The Agg backend is chosen explicitly so no display is needed.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from memplan.errors import MemplanError
from memplan.viz.output import EXTRA_HINT
from memplan.viz.series import Panel
from memplan.viz.style import CACHED_FREE, LIMIT, PHASE_BANDS, RESERVED, color, nice, peak_text

GiB = 2**30


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # check_output tells first; this covers a direct caller
        raise MemplanError(f"svg and png need matplotlib, in the viz extra: {EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, panel: Panel) -> None:
    x = panel.x
    for span in panel.phases:
        ax.axvspan(span.start, max(span.end - 1, span.start), color=PHASE_BANDS.get(span.name, "#fff"), lw=0)
        if span.end - span.start > panel.events * 0.04:
            ax.text((span.start + span.end) / 2, 1.0, span.name, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7, color="#666")  # fmt: skip
    stacks = [[v / GiB for v in panel.stacks[c]] for c in panel.categories]
    colors = [color(c, i) for i, c in enumerate(panel.categories)]
    if stacks:
        ax.stackplot(x, stacks, colors=colors, labels=[nice(c) for c in panel.categories], lw=0)
    top = [sum(col) for col in zip(*stacks, strict=True)] if stacks else [0.0] * len(x)
    reserved = [v / GiB for v in panel.reserved]
    ax.fill_between(x, top, reserved, color=CACHED_FREE, alpha=0.7, lw=0, label="cached but free")
    ax.plot(x, reserved, color=RESERVED, lw=0.9, label="reserved")
    if panel.limit:
        ax.axhline(panel.limit / GiB, color=LIMIT, ls="--", lw=1)
        ax.text(panel.events, panel.limit / GiB, panel.limit_label, ha="right", va="bottom", fontsize=7, color=LIMIT)
    p = panel.peak
    if p.event >= 0:
        ax.axvline(p.event, color="#000", ls=":", lw=0.6, alpha=0.5)
        ax.plot([p.event], [p.allocated / GiB], "ko", ms=3)
        ax.text(0.01, 0.96, textwrap.fill(peak_text(panel), 110), transform=ax.transAxes, fontsize=7, va="top",
                bbox={"facecolor": "white", "edgecolor": "#999", "alpha": 0.9, "lw": 0.5})  # fmt: skip
    ax.set_title(panel.title, fontsize=9, loc="left", pad=12)
    ax.set_ylabel("GiB")
    ax.set_xlim(0, max(panel.events - 1, 1))
    ax.set_ylim(0, max([*reserved, p.allocated / GiB, (panel.limit or 0) / GiB, 0.001]) * 1.25)
    ax.set_xlabel("allocator events (alloc and free) in order", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def render_figure(panels: list[Panel], path: Path, kind: str) -> None:
    """One panel under the other, written as ``kind`` (svg or png)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.8 * len(panels)), squeeze=False)
    try:
        for ax, panel in zip(axes[:, 0], panels, strict=True):
            _draw(ax, panel)
        fig.tight_layout()
        fig.savefig(path, format=kind, dpi=110, metadata={"Date": None} if kind == "svg" else None)
    finally:
        plt.close(fig)
