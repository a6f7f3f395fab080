"""Where a timeline goes: the path checked before any work, then the picture written.

``.html`` (self-contained page) and ``.svg`` (the page's chart as a document), standard library
only; ``.png`` (the same picture through Pillow, the ``viz`` extra); ``.pickle`` / ``.pkl``
(PyTorch's snapshot format, predicted run only).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from memplan.errors import MemplanError

Kind = Literal["html", "svg", "png", "pickle"]
KINDS: dict[str, Kind] = {".html": "html", ".htm": "html", ".svg": "svg", ".png": "png", ".pickle": "pickle",
                          ".pkl": "pickle"}  # fmt: skip
EXTRA_HINT = "pip install 'memplan[viz]'"


def check_output(path: str | Path, field: str = "--timeline", pickle_ok: bool = True) -> tuple[Path, Kind]:
    """The path and what to write there, or one :class:`MemplanError` naming the path and why not:
    a directory, a missing parent folder, an unknown suffix, or ``.png`` without Pillow."""
    out = Path(path)
    source = str(path)
    if out.is_dir():
        raise MemplanError("is a directory; give a file name ending in .html, .svg, .png or .pickle", source=source,
                           field=field)  # fmt: skip
    if not out.parent.is_dir():
        raise MemplanError(f"the folder {out.parent} does not exist", source=source, field=field)
    kind = KINDS.get(out.suffix.lower())
    if kind is None or (kind == "pickle" and not pickle_ok):
        known = ", ".join(s for s, k in KINDS.items() if pickle_ok or k != "pickle")
        raise MemplanError(f"unknown suffix {out.suffix or '(none)'!r}: one of {known}", source=source, field=field)
    if kind == "png" and importlib.util.find_spec("PIL") is None:
        raise MemplanError(f".png needs Pillow, in the viz extra: {EXTRA_HINT}", source=source, field=field)
    return out, kind


def write_panels(panels: list, path: Path, kind: Kind) -> None:
    """Draw ``panels`` (one picture, one panel under the other) to ``path``."""
    if kind == "html":
        from memplan.viz.html import render_html

        path.write_text(render_html(panels), encoding="utf-8")
        return
    if kind in ("svg", "png"):
        from memplan.viz.figure import render_figure

        render_figure(panels, path, kind)
        return
    raise MemplanError("a picture cannot be written as a pickle", source=str(path))


def write_job_timeline(job, path: Path, kind: Kind, device: str = "cuda", title: str | None = None) -> None:
    """The predicted run of ``job``'s most-loaded rank (the one its allocator verdict replays), drawn to
    ``path`` or written as a snapshot: what ``estimate --timeline`` writes, for a plan ``tune``
    recommends or a ``check`` entry."""
    from memplan.viz.predicted import predicted_panel, predicted_track
    from memplan.viz.snapshot import write_snapshot
    from memplan.viz.track import replay_timeline

    if kind == "pickle":
        write_snapshot(predicted_track(job, device)[0], path)
        return
    # a picture shows the limit, which needs the estimate's overhead: its verdict's run is the one drawn
    from memplan.estimation import estimate_with_run

    result, run, which = estimate_with_run(job, with_suggestions=False, device=device)
    track = replay_timeline(run, job.allocator)
    write_panels([predicted_panel(track, job, which, result.memory.overhead, title=title)], path, kind)
