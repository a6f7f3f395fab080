"""The HTML page: its hover script run (in Node against a stand-in DOM, where Node is installed)
and the page opened in a real headless browser (marked ``browser``; skipped where none is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memplan.specs.resolve import resolve_job
from memplan.viz.html import render_html
from memplan.viz.predicted import predicted_panel, predicted_track

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "firefox")

# a stand-in for what the page's script touches of the DOM; then one hover over the chart's middle
FAKE_DOM = """
const handlers = [], elements = {};
const element = (id) => elements[id] || (elements[id] = { id, style: {}, attrs: {}, textContent: "",
  setAttribute(k, v) { this.attrs[k] = v; } });
const svg = { addEventListener: (kind, fn) => handlers.push([kind, fn]),
  getBoundingClientRect: () => ({ left: 0, width: 1000 }) };
globalThis.document = { querySelectorAll: () => [svg], getElementById: element };
"""
HOVER = """
const move = handlers.find(([kind]) => kind === "mousemove")[1];
move({ clientX: __X__, pageX: 10, pageY: 10 });
console.log(JSON.stringify({ tip: elements.tip.textContent, display: elements.tip.style.display,
  cursor: elements.cursor0.attrs.visibility }));
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    job = resolve_job("llama3-8b", None, dict(dp=8, zero=3, precision="bf16-mixed", seq_len=2048), inference=False)
    track, which = predicted_track(job)
    panel = predicted_panel(track, job, which, overhead=0)
    path = tmp_path_factory.mktemp("html") / "timeline.html"
    path.write_text(render_html([panel]))
    return path


def test_the_hover_script_names_the_tensor_and_its_bytes(page, tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed")
    script = re.search(r"<script>(.*)</script>", page.read_text(), re.S).group(1)
    data = json.loads(re.search(r"const DATA = (\[.*?\]);", script, re.S).group(1))
    x = data[0]["left"] + data[0]["x"][len(data[0]["x"]) // 2] * data[0]["sx"]
    path = tmp_path / "hover.js"
    path.write_text(FAKE_DOM + script + HOVER.replace("__X__", f"{x:.3f}"))
    proc = subprocess.run([node, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["display"] == "block" and shown["cursor"] == "visible"
    assert re.search(r"^event \d+: [+-] \S+", shown["tip"]) and "allocated " in shown["tip"]
    assert "GiB" in shown["tip"] and "reserved " in shown["tip"]


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.mark.browser
def test_the_page_opens_in_a_headless_browser_with_no_console_errors(page, tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is not None:
        with sync_playwright() as p:
            try:
                browser = p.chromium.launch(executable_path=_browser())
            except Exception as err:  # playwright without a browser it can start
                pytest.skip(f"no browser playwright can start: {err}")
            tab = browser.new_page()
            errors: list[str] = []
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.as_uri())
            tab.hover("#chart0")
            assert tab.is_visible("#tip")
            assert "peak " in tab.inner_text("#peak-label0")
            browser.close()
        assert errors == []
        return
    browser = _browser()
    if browser is None or "firefox" in browser:
        pytest.skip("no headless Chromium and no playwright installed")
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    label = re.search(r'id="peak-label0"[^>]*>([^<]*)<', proc.stdout)
    assert label is not None and label.group(1).startswith("peak ") and "GiB" in label.group(1)
    # Chromium logs every console message (error, warning, log) and every uncaught exception as a
    # CONSOLE line at one level; the page writes nothing to the console, so none may appear
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
