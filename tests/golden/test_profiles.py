"""Model profiles (profiles/models/*.yaml): they load, agree with the config.json fixtures, and say their count."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from memplan.costmodel.params import total_params
from memplan.specs.hf import hf_model_fields
from memplan.specs.model import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = ROOT / "profiles" / "models"
HF_DIR = ROOT / "tests" / "data" / "hf"
PROFILES = sorted(PROFILES_DIR.glob("*.yaml"))
WITH_FIXTURE = [path for path in PROFILES if (HF_DIR / f"{path.stem}.json").exists()]

EXPECTED_PROFILES = {
    "gpt3-175b",
    "llama2-7b",
    "llama3-8b",
    "llama3-70b",
    "llama3.1-405b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-30b-a3b",
    # issue 18: one real size per newly read family, each with a config.json fixture of the same name
    "qwen3-8b",
    "gemma2-9b",
    "gemma3-12b",
    "phi3-mini",
    "phi4",
    "deepseek-v2-lite",
    "deepseek-v3",
    "olmo2-7b",
    "llama4-scout",
}

# Profiles with no fixture, as transformers config dicts (config.json fields) to build them from.
TRANSFORMERS_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3.1-405b": {
        "model_type": "llama",
        "hidden_size": 16384,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 53248,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "qwen2.5-72b": {
        "model_type": "qwen2",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 29568,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # GPT-3 has GPT-2's layout (the paper's alternating sparse attention holds no parameters).
    "gpt3-175b": {
        "model_type": "gpt2",
        "n_embd": 12288,
        "n_layer": 96,
        "n_head": 96,
        "n_positions": 2048,
        "vocab_size": 50257,
        "activation_function": "gelu",
        "tie_word_embeddings": True,
    },
}


def load_profile(path: Path) -> ModelSpec:
    return ModelSpec.model_validate(yaml.safe_load(path.read_text()))


def profile(name: str) -> ModelSpec:
    return load_profile(PROFILES_DIR / f"{name}.yaml")


def stated_count(path: Path) -> int:
    """The first number (with thousands separators) in the comment on the profile's first line."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name}: no comment on the first line"
    match = re.search(r"\d{1,3}(?:,\d{3})+", first)
    assert match, f"{path.name}: the first-line comment states no parameter count"
    return int(match.group().replace(",", ""))


def test_profiles_present() -> None:
    assert {path.stem for path in PROFILES} >= EXPECTED_PROFILES


@pytest.mark.parametrize("name", sorted(EXPECTED_PROFILES - set(TRANSFORMERS_CONFIGS)))
def test_expected_profile_has_a_fixture(name: str) -> None:
    """Every profile but GPT-3, Llama-3.1-405B and Qwen2.5-72B (built from TRANSFORMERS_CONFIGS) is its config.json."""
    assert (HF_DIR / f"{name}.json").exists()


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_loads(path: Path) -> None:
    spec = load_profile(path)
    assert spec.name == path.stem
    assert spec.source


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_comment_states_the_count(path: Path) -> None:
    assert stated_count(path) == total_params(load_profile(path))


@pytest.mark.parametrize("path", WITH_FIXTURE, ids=lambda path: path.stem)
def test_profile_matches_fixture(path: Path) -> None:
    spec = load_profile(path)
    fixture = ModelSpec(name=spec.name, **hf_model_fields(json.loads((HF_DIR / f"{path.stem}.json").read_text())))
    assert total_params(spec) == total_params(fixture)
    # Every other field agrees too: the profile is the config.json, written out.
    assert spec.model_dump(exclude={"source"}) == fixture.model_dump(exclude={"source"})


def test_llama31_405b() -> None:
    assert total_params(profile("llama3.1-405b")) == 405_853_388_800


def test_gpt3_175b() -> None:
    count = total_params(profile("gpt3-175b"))
    # 96 x (4h^2 + 4h attention, 8h^2 + 5h MLP, 4h two LayerNorms) + 50257h tied tokens + 2048h positions
    # + 2h final LayerNorm with h = 12288: 174,604,259,328, which the paper rounds to 175B (0.23% under).
    assert count == 174_604_259_328
    assert abs(count - 175e9) / 175e9 < 0.005


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_CONFIGS))
def test_profile_matches_transformers(name: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(TRANSFORMERS_CONFIGS[name])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == total_params(profile(name))
