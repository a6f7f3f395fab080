"""Jobs for the export tests, built the way ``memplan export`` builds them (resolve_job)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from memplan.specs.resolve import Job, resolve_job

TINY = {
    "name": "tiny-llama",
    "architecture": "llama",
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "ffn_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


@pytest.fixture
def make_job() -> Callable[..., Job]:
    """``make_job("llama3-8b", gpus=8, zero=3)``: a job from a model reference and flag values."""

    def make(model: str, **flags: object) -> Job:
        return resolve_job(model, None, dict(flags))

    return make


@pytest.fixture
def tiny_model(tmp_path: Path) -> Callable[..., str]:
    """A small Llama model YAML (fields overridable); returns its path."""

    def write(**changes: object) -> str:
        path = tmp_path / f"tiny-{len(list(tmp_path.glob('tiny-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump({**TINY, **changes}))
        return str(path)

    return write
