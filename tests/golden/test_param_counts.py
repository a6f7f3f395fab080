"""Parameter counts of real config.json files (tests/data/hf), checked two ways.

1. Against the counts the model makers publish (no torch needed).
2. Against transformers' own model, built from the same config.json on the meta device (no weights,
   no memory), for every fixture, and for small config.jsons that leave fields out (so the readers in
   memplan/specs/hf.py must fill in the transformers class defaults).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memplan.costmodel.params import total_params
from memplan.specs.hf import hf_model_fields
from memplan.specs.model import ModelSpec

HF_DIR = Path(__file__).resolve().parents[1] / "data" / "hf"
FIXTURES = sorted(path.stem for path in HF_DIR.glob("*.json"))

EXPECTED_FIXTURES = {
    "gpt2",  # openai-community/gpt2
    "llama2-7b",  # meta-llama/Llama-2-7b-hf
    "llama3-8b",  # meta-llama/Meta-Llama-3-8B
    "llama3-70b",  # meta-llama/Meta-Llama-3-70B
    "mistral-7b",  # mistralai/Mistral-7B-v0.1
    "mixtral-8x7b",  # mistralai/Mixtral-8x7B-v0.1
    "pythia-1b",  # EleutherAI/pythia-1b
    "qwen2-moe-a2.7b",  # Qwen/Qwen1.5-MoE-A2.7B
    "qwen2.5-0.5b",  # Qwen/Qwen2.5-0.5B (tied embeddings)
    "qwen2.5-7b",  # Qwen/Qwen2.5-7B
    "qwen3-30b-a3b",  # Qwen/Qwen3-30B-A3B
}

# Counts published by the model makers (model cards, safetensors metadata).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
}

# What transformers builds from the fixtures (the published figures above included); pinned so that a
# changed fixture or reader shows up even without torch.
TRANSFORMERS_COUNTS = {
    **PUBLISHED,
    "gpt2": 124_439_808,
    "pythia-1b": 1_011_781_632,
    "qwen2-moe-a2.7b": 14_315_784_192,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-30b-a3b": 30_532_122_624,
}


def load_config(name: str) -> dict[str, Any]:
    return json.loads((HF_DIR / f"{name}.json").read_text())


def spec_from_config(name: str, cfg: dict[str, Any]) -> ModelSpec:
    return ModelSpec(name=name, **hf_model_fields(cfg))


def transformers_param_count(cfg: dict[str, Any]) -> int:
    """Build the class ``architectures[0]`` names (else the auto class) on the meta device; count its parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    architectures = cfg.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if model_class is not None:
            model = model_class(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    # parameters() yields a tied weight once, as total_params counts it.
    return sum(p.numel() for p in model.parameters())


def test_fixtures_present() -> None:
    assert EXPECTED_FIXTURES <= set(FIXTURES)
    assert set(TRANSFORMERS_COUNTS) == EXPECTED_FIXTURES


@pytest.mark.parametrize(("name", "count"), sorted(PUBLISHED.items()))
def test_published_count(name: str, count: int) -> None:
    assert total_params(spec_from_config(name, load_config(name))) == count


@pytest.mark.parametrize(("name", "count"), sorted(TRANSFORMERS_COUNTS.items()))
def test_pinned_count(name: str, count: int) -> None:
    assert total_params(spec_from_config(name, load_config(name))) == count


@pytest.mark.parametrize("name", FIXTURES)
def test_matches_transformers(name: str) -> None:
    cfg = load_config(name)
    assert transformers_param_count(cfg) == total_params(spec_from_config(name, cfg))


def test_tied_embeddings_counted_once() -> None:
    spec = spec_from_config("qwen2.5-0.5b", load_config("qwen2.5-0.5b"))
    assert spec.tied_embeddings
    untied = spec.model_copy(update={"tied_embeddings": False})
    assert total_params(untied) - total_params(spec) == spec.vocab_size * spec.hidden_size


_SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 512,
    "vocab_size": 1000,
}

# Small config.jsons that leave out fields; the readers must fill in what the transformers config class
# would (num_key_value_heads differs by class: Mistral 8, Qwen2 32, Qwen2-MoE 16, Qwen3-MoE 4).
OMITTED_FIELDS = {
    "llama": {"model_type": "llama", **_SMALL},
    "llama-biases": {"model_type": "llama", **_SMALL, "attention_bias": True, "mlp_bias": True},
    "llama-head-dim": {"model_type": "llama", **_SMALL, "head_dim": 64, "num_key_value_heads": 2},
    "mistral": {"model_type": "mistral", **_SMALL, "num_attention_heads": 16},
    "mistral-head-dim": {"model_type": "mistral", **_SMALL, "head_dim": 64},
    "qwen2": {"model_type": "qwen2", **_SMALL, "hidden_size": 512, "num_attention_heads": 64},
    "qwen2-null-kv": {"model_type": "qwen2", **_SMALL, "num_key_value_heads": None, "tie_word_embeddings": True},
    "mixtral": {"model_type": "mixtral", **_SMALL},
    "qwen2-moe": {"model_type": "qwen2_moe", **_SMALL, "num_attention_heads": 32},
    "qwen2-moe-sparse": {
        "model_type": "qwen2_moe",
        **_SMALL,
        "num_key_value_heads": 8,
        "qkv_bias": False,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [0],
        "shared_expert_intermediate_size": 128,
    },
    "qwen3-moe": {"model_type": "qwen3_moe", **_SMALL},
    "qwen3-moe-sparse": {
        "model_type": "qwen3_moe",
        **_SMALL,
        "attention_bias": True,
        "head_dim": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [1],
    },
    "gpt2": {"model_type": "gpt2"},
    "gpt2-untied": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 300,
        "tie_word_embeddings": False,
    },
    "gpt-neox": {"model_type": "gpt_neox", **_SMALL},
    "gpt-neox-no-bias": {"model_type": "gpt_neox", **_SMALL, "attention_bias": False, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", sorted(OMITTED_FIELDS))
def test_omitted_fields_mean_transformers_defaults(case: str) -> None:
    cfg = OMITTED_FIELDS[case]
    assert transformers_param_count(cfg) == total_params(spec_from_config(case, cfg))
