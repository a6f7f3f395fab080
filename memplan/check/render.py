"""A check report as JUnit XML (for CI test reports) and as Markdown (for a pull-request comment).

JUnit: one ``<testsuite>`` in a ``<testsuites>`` root, one ``<testcase>`` per entry; an entry
over its budget or regressed is a ``<failure>``, one that could not be evaluated an ``<error>``
(the attributes the Ant JUnit schema, as read by GitHub / GitLab / Jenkins reporters, defines:
name, tests, failures, errors, skipped, time; classname, name, time; message, type).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from memplan.check.evaluate import FAILING, CheckReport, EntryResult
from memplan.units import format_bytes

MARK = {
    "pass": "✅ pass",
    "over-budget": "❌ over budget",
    "regressed": "❌ regressed",
    "tight": "❌ tight",
    "error": "⚠️ error",
}


def _gib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n, "GiB")


def _change(e: EntryResult) -> str:
    if e.change_bytes is None:
        return "new" if e.value_bytes is not None else "-"
    pct = f" ({e.change_pct:+.2f}%)" if e.change_pct is not None else ""
    sign = "+" if e.change_bytes >= 0 else "-"
    return f"{sign}{format_bytes(abs(e.change_bytes), 'GiB')}{pct}"


def junit_xml(report: CheckReport, suite: str = "memplan check") -> str:
    """The report as a JUnit XML document (UTF-8, with declaration)."""
    counts = report.counts()
    failures = sum(counts[s] for s in FAILING)
    attrs = {
        "name": suite,
        "tests": str(len(report.entries)),
        "failures": str(failures),
        "errors": str(counts["error"]),
        "skipped": "0",
        "time": "0",
    }
    root = ET.Element("testsuites", attrs)
    ts = ET.SubElement(root, "testsuite", attrs)
    props = ET.SubElement(ts, "properties")
    ET.SubElement(props, "property", {"name": "budgets", "value": report.source})
    ET.SubElement(props, "property", {"name": "threshold", "value": report.threshold})
    for e in report.entries:
        case = ET.SubElement(ts, "testcase", {"classname": f"memplan.check.{e.model}", "name": e.name, "time": "0"})
        if e.status in FAILING:
            node = ET.SubElement(case, "failure", {"message": e.reason or e.status, "type": e.status})
            node.text = _details(e)
        elif e.status == "error":
            node = ET.SubElement(case, "error", {"message": e.reason or "not evaluated", "type": "not-evaluated"})
            node.text = _details(e)
        out = ET.SubElement(case, "system-out")
        out.text = _details(e)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _details(e: EntryResult) -> str:
    kind = "measured" if e.measured else "estimated"
    return (
        f"{e.model} on {e.gpus} x {e.gpu} ({e.plan}): {kind} {e.metric} {_gib(e.value_bytes)}, "
        f"budget {_gib(e.limit_bytes)} ({e.budget}; capacity {_gib(e.capacity_bytes)}), "
        f"baseline {_gib(e.baseline_bytes)}, change {_change(e)}"
    )


def markdown(report: CheckReport) -> str:
    """A summary table for a pull-request comment; failing entries' reasons under it."""
    counts = report.counts()
    verdict = "✅ all entries within budget" if report.passed else "❌ memory budget check failed"
    lines = [
        f"### memplan check: {verdict}",
        "",
        f"{len(report.entries)} entries from `{report.source}`: {counts['pass']} pass, "
        f"{counts['over-budget']} over budget, {counts['regressed']} regressed, {counts['tight']} tight, "
        f"{counts['error']} not evaluated "
        f"(regression threshold {report.threshold}).",
        "",
        "| entry | model | GPUs | plan | metric | peak | budget | headroom | baseline | change | status |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for e in report.entries:
        metric = e.metric + (" (measured)" if e.measured else "")
        lines.append(
            f"| {e.name} | {e.model} | {e.gpus} x {e.gpu} | {e.plan} | {metric} | {_gib(e.value_bytes)} | "
            f"{_gib(e.limit_bytes)} | {_gib(e.headroom_bytes)} | {_gib(e.baseline_bytes)} | {_change(e)} | "
            f"{MARK[e.status]} |"
        )
    failing = [e for e in report.entries if e.status != "pass"]
    if failing:
        lines += ["", *(f"- **{e.name}**: {e.reason}" for e in failing)]
    lines.append("")
    lines.append("Sizes in GiB (2^30 bytes).")
    return "\n".join(lines) + "\n"
