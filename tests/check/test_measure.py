"""``memplan check --measure`` on a CPU: the bundled trainer measures a small model's rank, and an
entry it cannot measure fails (exit 1), never passes."""

from __future__ import annotations

import json

import pytest
import yaml

from memplan.cli.app import run

TINY = {
    "name": "tiny-llama",
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "ffn_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
ENTRY = {
    "name": "tiny-zero3",
    "model": "tiny.yaml",
    "gpus": 2,
    "workload": {"seq_len": 64, "micro_batch": 2, "global_batch": 8},
    "plan": {"zero": 3, "precision": "fp32"},
    "budget": "64MiB",
}


def test_measured_entries(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    unmeasurable = dict(ENTRY, name="tiny-reserved", metric="reserved")  # reserved: a CUDA figure
    path = tmp_path / "budgets.yaml"
    path.write_text(yaml.safe_dump({"metric": "allocated", "entries": [ENTRY, unmeasurable]}))
    code = run(["check", str(path), "--measure", "--device", "cpu", "--format", "json", "--timeout", "120"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    measured, failed = report["entries"]
    assert measured["measured"] and measured["status"] == "pass"
    # the trainer's rank holds parameters, gradients, AdamW states and activations: MiBs, not bytes
    assert 2**20 < measured["value_bytes"] < 64 * 2**20
    run(["check", str(path), "--device", "cpu", "--format", "json"])  # the estimate of the same CPU run
    estimated = json.loads(capsys.readouterr().out)["entries"][0]["value_bytes"]
    assert measured["value_bytes"] == pytest.approx(estimated, rel=0.02)  # the memplan runtime's accuracy
    assert failed["status"] == "error" and failed["value_bytes"] is None
    assert "CUDA" in failed["reason"]
