"""What the config.json readers of issue 18 put in a ModelSpec beyond its parameter count.

Counts are checked against transformers in tests/golden/test_param_counts.py; here: the attention pattern,
windows, MLA cache width, norms, fused projections, multimodal text_config, and the one-line errors for values
memplan cannot model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memplan.costmodel.params import layer_norm_params, moe_buffer_elements, norm_params, total_params
from memplan.errors import MemplanError
from memplan.specs.hf import hf_model_fields
from memplan.specs.loader import load_model, model_from_data
from memplan.specs.model import ModelSpec

HF_DIR = Path(__file__).resolve().parents[1] / "data" / "hf"


def config(name: str) -> dict[str, Any]:
    return json.loads((HF_DIR / f"{name}.json").read_text())


def spec(name: str, **changes: Any) -> ModelSpec:
    return ModelSpec(name=name, **hf_model_fields({**config(name), **changes}))


def test_gemma2_alternates_sliding_and_full_with_soft_capping() -> None:
    model = spec("gemma2-9b")
    assert model.attention_pattern == ("sliding", "full")
    assert [model.attention_window(i) for i in range(3)] == [4096, None, 4096]
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (50.0, 30.0)
    assert model.layer_norms == "sandwich" and model.norms_per_layer == 4
    assert layer_norm_params(model) == 4 * norm_params(model)
    assert model.activation == "gelu_tanh" and model.tied_embeddings and model.head_size == 256


def test_gemma3_multimodal_reads_text_config_five_sliding_per_full() -> None:
    model = load_model(str(HF_DIR / "gemma3-12b.json"))
    kinds = model.layer_attention_kinds
    assert (kinds.count("sliding"), kinds.count("full")) == (40, 8) and kinds[5] == "full"
    assert model.sliding_window == 1024 and model.qk_norm and model.qk_norm_scope == "head"
    assert model.attn_logit_softcapping is None
    assert "text model only" in (model.source or "") and "gemma3-12b.json" in (model.source or "")


def test_explicit_layer_types_that_do_not_repeat_are_kept_whole() -> None:
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"] + ["full_attention"] * 22
    model = spec("gemma3-1b", layer_types=types)
    assert model.layer_attention_kinds == tuple(
        {"sliding_attention": "sliding", "full_attention": "full"}[t] for t in types
    )


def test_qwen3_sliding_only_with_use_sliding_window() -> None:
    assert spec("qwen3-8b").attention_pattern == ()
    types = ["sliding_attention"] * 36
    assert spec("qwen3-8b", layer_types=types).attention_pattern == ()  # no window: transformers attends fully
    model = spec("qwen3-8b", use_sliding_window=True, sliding_window=4096, max_window_layers=30)
    assert model.layer_attention_kinds == ("full",) * 30 + ("sliding",) * 6


def test_phi3_fused_projections_and_window() -> None:
    mini = spec("phi3-mini")
    assert mini.fused_qkv and mini.fused_gate_up
    assert mini.layer_attention_kinds == ("sliding",) * 32 and mini.attention_window(31) == 2047
    assert spec("phi4").attention_pattern == () and spec("phi4").kv_heads == 10
    assert spec("phi4", partial_rotary_factor=0.75).partial_rotary_factor == 0.75
    unfused = mini.model_copy(update={"fused_qkv": False, "fused_gate_up": False})
    assert total_params(unfused) == total_params(mini)


def test_deepseek_mla_cache_width_and_shapes() -> None:
    v3 = spec("deepseek-v3")
    assert v3.mla is not None and v3.mla.q_lora_rank == 1536
    assert v3.kv_cache_width == 512 + 64  # the latent and the shared RoPE key, not 2 x 128 x 192
    assert (v3.head_size, v3.v_head_size, v3.attn_out_size) == (192, 128, 128 * 128)
    assert v3.moe is not None and v3.moe.dense_layers == (0, 1, 2) and v3.num_moe_layers == 58
    assert v3.moe.router_score_bias and moe_buffer_elements(v3) == 58 * 256
    assert v3.num_mtp_layers == 1 and v3.checkpoint_quantization == "fp8"
    lite = spec("deepseek-v2-lite")
    assert lite.mla is not None and lite.mla.q_lora_rank is None and lite.num_moe_layers == 26
    assert lite.moe is not None and lite.moe.shared_ffn_size == 2 * 1408 and moe_buffer_elements(lite) == 0


def test_olmo2_post_norms_and_full_width_qk_norm() -> None:
    model = spec("olmo2-7b")
    assert model.layer_norms == "post" and model.norms_per_layer == 2
    assert model.qk_norm and model.qk_norm_scope == "full"


def test_llama4_chunked_rope_layers_full_nope_layers() -> None:
    model = load_model(str(HF_DIR / "llama4-scout.json"))
    assert model.attention_pattern == ("chunked", "chunked", "chunked", "full")
    assert model.attention_window(0) == 8192 and model.attention_window(3) is None
    assert [model.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert model.qk_norm and not model.qk_norm_weight
    assert model.moe is not None and model.num_moe_layers == 48 and model.moe.num_shared_experts == 1
    assert model.moe.shared_ffn_size == 8192 and model.ffn_size == 16384


def test_llama4_moe_layers_list_and_interleave_step() -> None:
    text = config("llama4-scout")["text_config"]
    step2 = ModelSpec(name="m", **hf_model_fields({**text, "interleave_moe_layer_step": 2}))
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    listed = ModelSpec(name="m", **hf_model_fields({**text, "moe_layers": [0, 5]}))
    assert [i for i in range(48) if listed.is_moe_layer(i)] == [0, 5]


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "qwen2.5-7b", "gpt2"])
def test_existing_families_keep_the_defaults(name: str) -> None:
    model = spec(name)
    assert model.layer_attention_kinds == ("full",) * model.num_layers
    assert model.kv_cache_width == 2 * model.kv_size and model.norms_per_layer == 2
    assert model.mla is None and not model.fused_qkv and model.checkpoint_quantization is None


# ---------------------------------------------------------------------------------------------
# values memplan cannot model: a MemplanError naming the config.json key


@pytest.mark.parametrize(
    ("name", "changes", "field", "reason"),
    [
        ("gemma2-9b", {"layer_types": ["global"] * 42}, "layer_types", "unknown attention kind 'global'"),
        ("gemma2-9b", {"hidden_activation": "swiglu"}, "hidden_activation", "Input should be"),
        ("gemma2-9b", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "bidirectional"),
        ("qwen3-8b", {"layer_types": ["full_attention"] * 3}, "layer_types", "36 attention kinds"),
        ("phi4", {"attention_bias": True}, "attention_bias", "without biases"),
        ("deepseek-v2-lite", {"moe_layer_freq": 2}, "moe_layer_freq", "only 1"),
        ("deepseek-v2-lite", {"mlp_bias": True}, "mlp_bias", "not modelled"),
        ("deepseek-v3", {"kv_lora_rank": 0}, "kv_lora_rank", "greater than 0"),
        ("deepseek-v3", {"n_routed_experts": 4}, "num_experts_per_tok", "exceeds num_experts"),
        ("olmo2-7b", {"hidden_act": "tanhshrink"}, "hidden_act", "Input should be"),
    ],
)
def test_unmodelled_values_name_the_key(name: str, changes: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(MemplanError) as info:
        model_from_data({**config(name), **changes}, "config.json", name)
    assert info.value.field == field and reason in info.value.reason


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"layer_types": ["sliding_attention"] * 48}, "text_config.layer_types", "unknown attention kind"),
        ({"no_rope_layers": [1, 0]}, "text_config.no_rope_layers", "48 flags"),
        ({"moe_layers": [48]}, "text_config.moe_layers", "outside"),
        ({"num_local_experts": 1}, "text_config.num_local_experts", "greater than 1"),
        ({"attention_chunk_size": None}, "text_config.attention_chunk_size", "chunk size"),
    ],
)
def test_multimodal_errors_name_the_text_config_key(changes: dict[str, Any], field: str, reason: str) -> None:
    cfg = config("llama4-scout")
    cfg = {**cfg, "text_config": {**cfg["text_config"], **changes}}
    with pytest.raises(MemplanError) as info:
        model_from_data(cfg, "config.json", "llama4")
    assert info.value.field == field and reason in info.value.reason


def test_specs_import_no_torch() -> None:
    code = "import sys, memplan.specs.hf, memplan.costmodel.params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
