"""``memplan check`` end to end: exit codes (0 within budget, 1 over or regressed, 2 bad input),
JUnit XML, Markdown, the baseline, and one-line errors located in the budgets file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from memplan.cli.app import run

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "budgets.yaml"
CLI = "command line"

FSDP = {
    "name": "llama3-8b-fsdp",
    "model": "llama3-8b",
    "gpu": "h100-sxm",
    "gpus": 8,
    "workload": {"seq_len": 4096, "micro_batch": 2, "global_batch": 64},
    "plan": {"zero": 3, "recompute": "full", "precision": "bf16-mixed"},
    "budget": {"fits": True, "headroom": "10%"},
}
TIGHT = {
    "name": "llama3-8b-ddp",
    "model": "llama3-8b",
    "gpus": 8,
    "plan": {"zero": 0},
    "budget": "40GiB",  # ZeRO-0 keeps 16 bytes per parameter on every GPU: far over
}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def budgets(tmp_path: Path, *entries: dict, name: str = "budgets.yaml", **top: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**top, "entries": list(entries)}, sort_keys=False))
    return path


def memplan(capsys, *args: object) -> tuple[int, str, str]:
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def check_json(capsys, *args: object) -> tuple[int, dict]:
    code, out, err = memplan(capsys, "check", *args, "--format", "json")
    assert code in (0, 1), err
    return code, json.loads(out)


def error(capsys, *args: object) -> str:
    code, out, err = memplan(capsys, *args)
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("memplan: error: "), err
    return err.removeprefix("memplan: error: ").rstrip("\n")


def test_the_documented_example_passes(capsys):
    code, report = check_json(capsys, EXAMPLE)
    assert code == 0, report
    assert report["passed"] and all(e["status"] == "pass" for e in report["entries"])
    assert {e["metric"] for e in report["entries"]} == {"reserved", "allocated"}


def test_exit_code_1_and_reports_when_an_entry_is_over_budget(tmp_path, capsys):
    path = budgets(tmp_path, FSDP, TIGHT)
    junit, summary = tmp_path / "out" / "junit.xml", tmp_path / "out" / "summary.md"
    code, out, err = memplan(capsys, "check", path, "--junit", junit, "--markdown", summary)
    assert code == 1, err
    assert "llama3-8b-ddp" in out and "exceeds the budget" in out
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "1", "0")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["llama3-8b-fsdp"].find("failure") is None
    failure = cases["llama3-8b-ddp"].find("failure")
    assert failure.get("type") == "over-budget" and "exceeds the budget 40.00 GiB" in failure.get("message")
    text = summary.read_text()
    assert text.startswith("### memplan check: ❌")
    assert "| llama3-8b-ddp |" in text and "❌ over budget" in text


def _tight_card(tmp_path: Path, capsys) -> str:
    """A GPU profile whose capacity leaves a LoRA plan of Llama-3 8B half its tight band of
    headroom (as tests/unit/test_capacity_margin.py builds one): it fits, but tightly."""
    lora = ["llama3-8b", "--gpu", "h200", "--gpus", "1", "--finetune", "lora", "--seq-len", "4096"]
    code, out, err = memplan(capsys, "estimate", *lora, "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    card = yaml.safe_load((ROOT / "profiles" / "gpus" / "h200.yaml").read_text())
    need = d["memory"]["peak"]["reserved"] + d["memory"]["overhead"]
    card.update(name="card", torch_capacity_bytes=need + d["fits_margin"]["band_bytes"] // 2)
    card["torch_capacity_spread_bytes"] = 0
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump(card))
    return str(path)


def _junit_counts(path: Path) -> tuple[dict[str, int], list[tuple[str, str | None, str | None]]]:
    """The report read as a JUnit consumer reads it, with the standard library alone: each suite's
    declared totals, summed, and each case's outcome from its children (no child: passed)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    declared = {k: sum(int(s.get(k)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = []
    for case in (c for s in suites for c in s.findall("testcase")):
        assert case.get("classname") and case.get("name") and float(case.get("time")) >= 0
        node = case.find("failure") if case.find("failure") is not None else case.find("error")
        cases.append((case.get("name"), None if node is None else node.tag, None if node is None else node.get("type")))
    return declared, cases


def test_the_junit_report_counts_as_a_junit_reader_counts_it(tmp_path, capsys):
    """A pass, an entry over its budget and a fit within the tight band with ``tight: false``: the
    totals the report declares are the cases it holds, and each failure carries its status as type."""
    tight = {
        "name": "lora-tight",
        "model": "llama3-8b",
        "gpu": _tight_card(tmp_path, capsys),
        "gpus": 1,
        "workload": {"seq_len": 4096},
        "plan": {"finetune": "lora"},
        "budget": {"fits": True, "tight": False},
    }
    junit = tmp_path / "junit.xml"
    code, _, err = memplan(capsys, "check", budgets(tmp_path, FSDP, TIGHT, tight), "--junit", junit)
    assert code == 1, err
    declared, cases = _junit_counts(junit)
    assert declared == {"tests": 3, "failures": 2, "errors": 0, "skipped": 0}
    assert len(cases) == declared["tests"]
    assert sum(1 for _, tag, _ in cases if tag == "failure") == declared["failures"]
    assert sum(1 for _, tag, _ in cases if tag == "error") == declared["errors"]
    assert sorted(cases) == [
        ("llama3-8b-ddp", "failure", "over-budget"),
        ("llama3-8b-fsdp", None, None),
        ("lora-tight", "failure", "tight"),
    ]


def test_json_and_markdown_formats(tmp_path, capsys):
    path = budgets(tmp_path, FSDP)
    code, report = check_json(capsys, path)
    entry = report["entries"][0]
    assert code == 0 and entry["status"] == "pass"
    assert entry["limit_bytes"] == entry["capacity_bytes"] - int(entry["capacity_bytes"] * 0.1)
    assert entry["headroom_bytes"] == entry["limit_bytes"] - entry["value_bytes"]
    code, out, _ = memplan(capsys, "check", path, "--format", "markdown")
    assert code == 0 and out.startswith("### memplan check: ✅")


def test_baseline_regression_is_detected(tmp_path, capsys):
    path = budgets(tmp_path, FSDP, threshold="2%")
    base = tmp_path / "baseline.json"
    code, _, err = memplan(capsys, "check", path, "--baseline", base, "--update-baseline")
    assert code == 0, err
    accepted = json.loads(base.read_text())
    value = accepted["entries"]["llama3-8b-fsdp"]["bytes"]
    assert accepted["entries"]["llama3-8b-fsdp"]["metric"] == "reserved"
    # the same numbers again: no change
    code, report = check_json(capsys, path, "--baseline", base)
    assert code == 0 and report["entries"][0]["change_bytes"] == 0
    # the accepted number was 5% lower: today's is a 5% regression, beyond 2%
    accepted["entries"]["llama3-8b-fsdp"]["bytes"] = int(value / 1.05)
    base.write_text(json.dumps(accepted))
    code, report = check_json(capsys, path, "--baseline", base)
    entry = report["entries"][0]
    assert code == 1 and entry["status"] == "regressed"
    assert entry["change_pct"] == pytest.approx(5.0, abs=0.01)
    # within a 10% threshold it passes; a size threshold works too
    assert check_json(capsys, budgets(tmp_path, FSDP, threshold="10%"), "--baseline", base)[0] == 0
    assert check_json(capsys, budgets(tmp_path, FSDP, threshold="4GiB"), "--baseline", base)[0] == 0
    assert check_json(capsys, budgets(tmp_path, FSDP, threshold="512MiB"), "--baseline", base)[0] == 1
    # an improvement never fails
    accepted["entries"]["llama3-8b-fsdp"]["bytes"] = value * 2
    base.write_text(json.dumps(accepted))
    code, report = check_json(capsys, path, "--baseline", base)
    assert code == 0 and report["entries"][0]["change_bytes"] == -value


def test_update_baseline_accepts_a_regression_but_not_a_budget_failure(tmp_path, capsys):
    path = budgets(tmp_path, FSDP, TIGHT)
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"version": 1, "entries": {"llama3-8b-fsdp": {"metric": "reserved", "bytes": 1}}}))
    code, _, _ = memplan(capsys, "check", path, "--baseline", base, "--update-baseline")
    assert code == 1  # TIGHT is over its budget whatever the baseline
    assert json.loads(base.read_text())["entries"]["llama3-8b-fsdp"]["bytes"] > 1


def test_a_baseline_of_another_metric_is_not_compared(tmp_path, capsys):
    path = budgets(tmp_path, FSDP)
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"version": 1, "entries": {"llama3-8b-fsdp": {"metric": "allocated", "bytes": 1}}}))
    code, report = check_json(capsys, path, "--baseline", base)
    assert code == 0 and report["entries"][0]["baseline_bytes"] is None


def test_exit_codes_in_a_real_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}

    def code(*args: object) -> int:
        cmd = [sys.executable, "-m", "memplan.cli", "check", *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60).returncode

    assert code(budgets(tmp_path, FSDP, name="ok.yaml")) == 0
    assert code(budgets(tmp_path, FSDP, TIGHT, name="over.yaml")) == 1
    assert code(tmp_path / "missing.yaml") == 2


BAD = [
    # entries, top-level fields, field, words in the reason
    ([dict(FSDP, model="llama9")], {}, "entries[0].model", "unknown model 'llama9'"),
    ([FSDP, dict(FSDP, name="b", model="gpt5")], {}, "entries[1].model", "unknown model 'gpt5'"),
    ([dict(FSDP, budget="70G")], {}, "entries[0].budget", "80GiB = 80 x 2^30 bytes"),
    ([dict(FSDP, budget="70Gb")], {}, "entries[0].budget", "70Gb"),
    ([dict(FSDP, budget="70")], {}, "entries[0].budget", "80GB = 80 x 10^9"),
    ([dict(FSDP, budget="70GiB/s")], {}, "entries[0].budget", "70GiB/s"),
    ([dict(FSDP, budget={"fits": True, "headroom": "110%"})], {}, "entries[0].budget.headroom", "below 100%"),
    ([dict(FSDP, budget={"fits": True, "headroom": "90GiB"})], {}, "entries[0].budget.headroom", "no memory"),
    ([dict(FSDP, budget={"fits": False})], {}, "entries[0].budget.fits", "fits: true"),
    ([{k: v for k, v in FSDP.items() if k != "budget"}], {}, "entries[0].budget", "required"),
    ([dict(FSDP, bugdet="70GiB")], {}, "entries[0].bugdet", "unknown field"),
    ([dict(FSDP, plan={"tensor_parallel": 2})], {}, "entries[0].plan.tensor_parallel", "unknown field"),
    ([dict(FSDP, plan={"tp": 3})], {}, "entries[0].gpus", "tp x pp x cp = 3"),
    ([dict(FSDP, gpus=24, plan={"tp": 3})], {}, "entries[0].plan.tp", "num_attention_heads"),
    ([dict(FSDP, plan={"zero": 5})], {}, "entries[0].plan.zero", "less than or equal to 3"),
    ([dict(FSDP, workload={"seq_length": 4096})], {}, "entries[0].workload.seq_length", "unknown field"),
    ([dict(FSDP, workload={"kind": "finetune"})], {}, "entries[0].workload.kind", "unknown kind"),
    ([dict(FSDP, workload={"batch": 4})], {}, "entries[0].workload.batch", "not a training field"),
    ([dict(FSDP, workload={"global_batch": 12})], {}, "entries[0].workload.global_batch", "micro_batch x dp"),
    ([dict(FSDP, gpu="h900")], {}, "entries[0].gpu", "unknown GPU 'h900'"),
    ([dict(FSDP, gpus=0)], {}, "entries[0].gpus", "greater than 0"),
    ([dict(FSDP, metric="peak")], {}, "entries[0].metric", "'reserved'"),
    ([FSDP, FSDP], {}, "entries[1].name", "duplicate"),
    ([], {}, "entries", "at least 1"),
    ([FSDP], {"threshold": "2"}, "threshold", "2"),
    ([FSDP], {"threshold": 0.02}, "threshold", "percentage"),
    ([FSDP], {"metrc": "reserved"}, "metrc", "unknown field"),
]


@pytest.mark.parametrize(("entries", "top", "field", "reason"), BAD)
def test_bad_budgets_file_is_one_line_exit_2(tmp_path, capsys, entries, top, field, reason):
    path = budgets(tmp_path, *entries, **top)
    message = error(capsys, "check", path)
    assert message.startswith(f"{path}: {field}: "), message
    assert reason in message


def test_bad_files_and_options(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert error(capsys, "check", missing) == f"{missing}: no such file"
    broken = tmp_path / "broken.yaml"
    broken.write_text("entries: [\n")
    assert error(capsys, "check", broken).startswith(f"{broken}: malformed YAML")
    path = budgets(tmp_path, FSDP)
    base = tmp_path / "baseline.json"
    assert (
        error(capsys, "check", path, "--baseline", base) == f"{base}: no such file (create it with --update-baseline)"
    )
    base.write_text("{not json")
    assert error(capsys, "check", path, "--baseline", base).startswith(f"{base}: malformed JSON")
    base.write_text(json.dumps({"version": 1, "entries": {"a": {"metric": "reserved"}}}))
    assert error(capsys, "check", path, "--baseline", base).startswith(f"{base}: entries.a.bytes: ")
    assert error(capsys, "check", path, "--update-baseline").startswith(f"{CLI}: --update-baseline: ")
    assert error(capsys, "check", path, "--format", "xml").startswith(f"{CLI}: --format: ")


def test_a_model_file_error_names_that_file(tmp_path, capsys):
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({"name": "m", "hidden_size": 0, "num_layers": 2, "num_attention_heads": 2,
                                     "ffn_size": 8, "vocab_size": 16}))  # fmt: skip
    path = budgets(tmp_path, dict(FSDP, model="model.yaml"))  # relative to the budgets file
    assert error(capsys, "check", path).startswith(f"{model}: hidden_size: ")


def test_the_workflow_runs_the_example(tmp_path):
    workflow = yaml.safe_load((ROOT / "docs" / "examples" / "memplan-check.yml").read_text())
    steps = workflow["jobs"]["memory-budgets"]["steps"]
    commands = " ".join(s.get("run", "") for s in steps)
    assert "memplan check docs/examples/budgets.yaml --baseline memplan-baseline.json" in commands
    assert "--junit memplan-junit.xml --markdown memplan-summary.md" in commands
    assert "--update-baseline" in commands
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert set(triggers) == {"pull_request", "push"}


def test_entries_are_judged_under_their_allocator(tmp_path, capsys, monkeypatch):
    """An entry's allocator, else --allocator, else PYTORCH_CUDA_ALLOC_CONF; the fits budget is
    the capacity PyTorch sees less what lives outside the allocator."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = budgets(tmp_path, FSDP, dict(FSDP, name="expandable", allocator="expandable"))
    code, report = check_json(capsys, path)
    assert code == 0
    default, expandable = report["entries"]
    assert default["capacity_bytes"] < 80 * 2**30 - 2**30  # 79.18 GiB less context, cuBLAS and NCCL
    assert default["limit_bytes"] == default["capacity_bytes"] - int(default["capacity_bytes"] * 0.1)
    assert expandable["value_bytes"] != default["value_bytes"]  # another allocator, another replay
    code, flagged = check_json(capsys, budgets(tmp_path, FSDP), "--allocator", "expandable")
    assert flagged["entries"][0]["value_bytes"] == expandable["value_bytes"]
