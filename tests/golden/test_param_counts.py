"""Parameter counts of real config.json files (tests/data/hf), checked two ways.

1. Against the counts the model makers publish (no torch needed).
2. Against transformers' own model, built from the same config.json on the meta device (no weights,
   no memory), for every fixture, and for small config.jsons that leave fields out (so the readers in
   memplan/specs/hf.py must fill in the transformers class defaults).

Multimodal config.jsons (Gemma3ForConditionalGeneration, Llama4ForConditionalGeneration) are compared with
their text model only (Gemma3ForCausalLM / Llama4ForCausalLM built from text_config): memplan plans the
language model and counts no vision tower or projector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memplan.costmodel.params import active_params, total_params
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
    "qwen3-8b",  # Qwen/Qwen3-8B
    "gemma2-9b",  # google/gemma-2-9b
    "gemma3-1b",  # google/gemma-3-1b-it (Gemma3ForCausalLM, model_type gemma3_text)
    "gemma3-12b",  # google/gemma-3-12b-it (multimodal Gemma3ForConditionalGeneration; text model counted)
    "phi3-mini",  # microsoft/Phi-3-mini-4k-instruct
    "phi4",  # microsoft/phi-4
    "deepseek-v2-lite",  # deepseek-ai/DeepSeek-V2-Lite
    "deepseek-v3",  # deepseek-ai/DeepSeek-V3
    "olmo2-7b",  # allenai/OLMo-2-1124-7B
    "llama4-scout",  # meta-llama/Llama-4-Scout-17B-16E (multimodal; text model counted)
}

# Counts published by the model makers (model cards, safetensors metadata).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    # Gemma 2 report, table 2: 917,504,000 embedding + 8,324,201,984 non-embedding parameters.
    "gemma2-9b": 9_241_705_984,
}

# Counts the makers publish rounded, as (figure, half a unit of its last digit): the exact count must round to it.
# DeepSeek-V3: 671B is the main model; the Hugging Face repository's 685B adds the multi-token-prediction module
# (num_nextn_predict_layers: 1, about 14B), which transformers does not build and memplan does not count. Its
# "37B activated" is not checked: top-8 of 256 experts plus the embedding and LM head give 37.55B here.
# Llama-4-Scout's "109B total" includes the vision tower (not counted); its "17B active" is the text model's.
ROUNDED = {
    "deepseek-v3": (671e9, 0.5e9),  # DeepSeek-V3 technical report: 671B total
    "deepseek-v2-lite": (15.7e9, 0.05e9),  # DeepSeek-V2-Lite model card: 15.7B total
    "qwen3-8b": (8.2e9, 0.05e9),  # Qwen3-8B model card: 8.2B (6.95B non-embedding)
    "phi3-mini": (3.8e9, 0.05e9),  # Phi-3 technical report: 3.8B
    "gemma3-1b": (1e9, 0.05e9),  # Gemma 3 report: 1B
}
ROUNDED_ACTIVE = {
    "llama4-scout": (17e9, 0.5e9),  # Llama 4 model card: 17B active (16 experts, top-1, one shared expert)
}
# Not checked: DeepSeek-V2-Lite's "2.4B activated" (2.66B here, with the embedding and LM head, 2 x 102400 x 2048,
# that transformers holds; the figure's own accounting is not published).

# What transformers builds from the fixtures (the published figures above included); pinned so that a
# changed fixture or reader shows up even without torch.
TRANSFORMERS_COUNTS = {
    **PUBLISHED,
    "gpt2": 124_439_808,
    "pythia-1b": 1_011_781_632,
    "qwen2-moe-a2.7b": 14_315_784_192,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-8b": 8_190_735_360,
    "gemma3-1b": 999_885_952,
    "gemma3-12b": 11_766_034_176,  # text model only
    "phi3-mini": 3_821_079_552,
    "phi4": 14_659_507_200,
    "deepseek-v2-lite": 15_706_484_224,
    "deepseek-v3": 671_026_404_352,  # no MTP module
    "olmo2-7b": 7_298_617_344,
    "llama4-scout": 107_769_861_120,  # text model only
}

# The text model a multimodal class holds; the test builds it from the config's text_config.
TEXT_MODEL_CLASS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
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
    if architectures and architectures[0] in TEXT_MODEL_CLASS:
        # The text model alone (memplan counts no vision tower). Gemma3ForConditionalGeneration ties its LM head
        # by the top-level tie_word_embeddings; Llama4's language model is a Llama4ForCausalLM of text_config.
        if architectures[0].startswith("Gemma3"):
            config.text_config.tie_word_embeddings = config.tie_word_embeddings
        config, model_class = config.text_config, getattr(transformers, TEXT_MODEL_CLASS[architectures[0]])
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


@pytest.mark.parametrize(("name", "published"), sorted(ROUNDED.items()))
def test_rounded_published_count(name: str, published: tuple[float, float]) -> None:
    figure, half_unit = published
    assert abs(total_params(spec_from_config(name, load_config(name))) - figure) <= half_unit


@pytest.mark.parametrize(("name", "published"), sorted(ROUNDED_ACTIVE.items()))
def test_rounded_active_count(name: str, published: tuple[float, float]) -> None:
    """Active = total less the routed experts a token skips."""
    figure, half_unit = published
    assert abs(active_params(spec_from_config(name, load_config(name))) - figure) <= half_unit


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
    # Qwen3: head_dim 128 and 32 KV heads by default
    "qwen3": {"model_type": "qwen3", **_SMALL, "num_attention_heads": 32},
    "qwen3-bias-sliding": {
        "model_type": "qwen3",
        **_SMALL,
        "attention_bias": True,
        "head_dim": 32,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "max_window_layers": 2,
        "sliding_window": 64,
        "tie_word_embeddings": True,
    },
    # Gemma: head_dim 256, 4 KV heads, tied, gelu_tanh, sandwich norms by default
    "gemma2": {"model_type": "gemma2", **_SMALL},
    "gemma2-untied-bias": {
        "model_type": "gemma2",
        **_SMALL,
        "attention_bias": True,
        "head_dim": 32,
        "tie_word_embeddings": False,
        "hidden_activation": "gelu",
    },
    "gemma3-text": {"model_type": "gemma3_text", **_SMALL},
    "gemma3-text-layer-types": {
        "model_type": "gemma3_text",
        **_SMALL,
        "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        "num_key_value_heads": 8,
    },
    "gemma3-multimodal": {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**_SMALL, "model_type": "gemma3_text"},
    },
    "gemma3-multimodal-untied": {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**_SMALL, "head_dim": 32, "sliding_window_pattern": 2},
        "tie_word_embeddings": False,
    },
    "gemma3-multimodal-defaults": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
    # Phi-3: fused qkv_proj / gate_up_proj; pad_token_id 32000 by default needs a vocabulary above it
    "phi3": {"model_type": "phi3", **_SMALL, "pad_token_id": None},
    "phi3-gqa-window": {
        "model_type": "phi3",
        **_SMALL,
        "pad_token_id": None,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 64,
        "partial_rotary_factor": 0.75,
    },
    # DeepSeek-V2: q_lora_rank 1536, kv_lora_rank 512, 64 experts of 1407, 2 shared, all layers MoE by default
    "deepseek-v2": {"model_type": "deepseek_v2", **_SMALL, "num_experts_per_tok": 2},
    "deepseek-v2-lite-like": {
        "model_type": "deepseek_v2",
        **_SMALL,
        "num_experts_per_tok": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "n_routed_experts": 8,
        "n_shared_experts": 0,
        "moe_intermediate_size": 96,
        "first_k_dense_replace": 1,
        "attention_bias": True,
    },
    # DeepSeek-V3: 256 experts of 2048, one shared, the first 3 layers dense by default
    "deepseek-v3": {"model_type": "deepseek_v3", **_SMALL},
    "deepseek-v3-small": {
        "model_type": "deepseek_v3",
        **_SMALL,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 2,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "tie_word_embeddings": True,
    },
    # OLMo 2: post norms, QK norm over the full q / kv width
    "olmo2": {"model_type": "olmo2", **_SMALL},
    "olmo2-gqa-bias": {"model_type": "olmo2", **_SMALL, "num_key_value_heads": 2, "attention_bias": True},
    # Llama 4 text: head_dim 128, 8 KV heads, 16 experts + a shared one on every layer by default
    "llama4-text": {"model_type": "llama4_text", **_SMALL},
    "llama4-text-interleaved": {
        "model_type": "llama4_text",
        **_SMALL,
        "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 640,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "use_qk_norm": False,
        "no_rope_layers": [1, 0, 1, 0],
        "attention_bias": True,
        "head_dim": 32,
    },
    "llama4-text-moe-layers": {
        "model_type": "llama4_text",
        **_SMALL,
        "moe_layers": [0, 3],
        "intermediate_size_mlp": 384,
        "num_local_experts": 4,
        "tie_word_embeddings": True,
    },
    "llama4-multimodal": {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {**_SMALL, "num_local_experts": 4, "interleave_moe_layer_step": 2},
    },
}


@pytest.mark.parametrize("case", sorted(OMITTED_FIELDS))
def test_omitted_fields_mean_transformers_defaults(case: str) -> None:
    cfg = OMITTED_FIELDS[case]
    assert transformers_param_count(cfg) == total_params(spec_from_config(case, cfg))
