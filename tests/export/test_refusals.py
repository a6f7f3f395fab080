"""A plan a target cannot express is refused, naming the field and what would be lost.

Never a silently different config: each case is a plan value the target's format (or the
code memplan writes for it) cannot say, and the error must name the plan field at fault.
"""

from __future__ import annotations

import pytest

from memplan.errors import MemplanError
from memplan.export import export

L8 = "llama3-8b"
BASE = dict(gpus=8, zero=3, precision="bf16-mixed")

CASES = [
    # target, model, flags, opts, field, words in the reason
    ("deepspeed", L8, dict(gpus=8, pp=2), {}, "plan.pp", "PipelineModule"),
    ("deepspeed", L8, dict(gpus=8, tp=2), {}, "plan.tp", "AutoTP"),
    ("deepspeed", L8, dict(gpus=8, cp=2, seq_len=4096), {}, "plan.cp", "Ulysses"),
    ("deepspeed", "mixtral-8x7b", dict(gpus=8, ep=2), {}, "plan.ep", "expert"),
    ("deepspeed", L8, dict(gpus=8, precision="fp8"), {}, "plan.precision", "Transformer Engine"),
    ("deepspeed", L8, dict(gpus=8, precision="bf16", zero=0), {}, "plan.precision", "ZeRO stage >= 1"),
    ("deepspeed", L8, dict(gpus=8, recompute="selective"), {}, "plan.recompute", "whole decoder layers"),
    ("deepspeed", L8, dict(gpus=8, recompute="selective-op"), {}, "plan.recompute", "whole decoder layers"),
    ("deepspeed", L8, dict(gpus=8, recompute="full", recompute_layers=8), {}, "plan.recompute_layers", "every"),
    ("deepspeed", L8, dict(gpus=8, zero=2, offload_optimizer="cpu", optimizer="sgd"), {}, "plan.offload_optimizer",
     "CPU"),
    ("deepspeed", L8, dict(gpus=8, zero=2, offload_optimizer="nvme"), {}, "--nvme-path", "NVMe"),
    ("accelerate", L8, dict(BASE, pp=2), {}, "plan.pp", "pipeline"),
    ("accelerate", "mixtral-8x7b", dict(BASE, ep=2), {}, "plan.ep", "expert"),
    ("accelerate", L8, dict(BASE, tp=2), {}, "plan.tp", "tp_plan"),
    ("accelerate", L8, dict(BASE, zero=1), {}, "plan.zero", "ZeRO-2"),
    ("accelerate", L8, dict(BASE, precision="bf16-master"), {}, "plan.precision", "fp32 sharded"),
    ("accelerate", L8, dict(BASE, recompute="selective"), {}, "plan.recompute", "whole decoder layers"),
    ("accelerate", L8, dict(BASE, recompute="selective-op"), {}, "plan.recompute", "whole decoder layers"),
    ("accelerate", L8, dict(BASE, recompute="full", recompute_layers=4), {}, "plan.recompute_layers", "every"),
    ("accelerate", L8, dict(BASE, offload_params="nvme", offload_optimizer="nvme"), {}, "plan.offload_params", "CPU"),
    ("accelerate", L8, dict(BASE, offload_optimizer="cpu"), {}, "plan.offload_params", "together"),
    ("torchtitan", L8, dict(BASE, zero=1), {}, "plan.zero", "DDP"),
    ("torchtitan", L8, dict(BASE, zero=0, tp=2), {}, "plan.zero", "1-D"),
    ("torchtitan", L8, dict(BASE, zero=0, cp=2, dp=4, gpus=None), {}, "plan.zero", "context"),
    ("torchtitan", L8, dict(BASE, precision="bf16-master"), {}, "plan.precision", "master"),
    ("torchtitan", L8, dict(BASE, dp=1, gpus=2, tp=2, zero=2), {}, "plan.precision", "fully_shard"),
    ("torchtitan", L8, dict(BASE, recompute="selective"), {}, "plan.recompute", "per-op SAC"),
    ("torchtitan", L8, dict(BASE, recompute="full", recompute_layers=3), {"form": "toml"}, "plan.recompute_layers",
     "divides"),
    ("torchtitan", L8, dict(BASE, recompute="full", recompute_layers=4), {}, "plan.recompute_layers", "legacy TOML"),
    ("torchtitan", L8, dict(BASE, attention="eager"), {}, "plan.attention", "SDPA"),
    ("torchtitan", L8, dict(BASE, optimizer="sgd"), {}, "plan.optimizer", "AdamW"),
    ("torchtitan", L8, dict(BASE, offload_optimizer="cpu"), {}, "plan.offload_params", "together"),
    ("torchtitan", "mixtral-8x7b", dict(BASE, gpus=16, tp=2, ep=2), {"model": "m:x"}, "plan.ep", "efsdp"),
    ("torchtitan", L8, dict(BASE, tp=2), {"form": "toml"}, "plan.sequence_parallel", "always applies"),
    ("torchtitan", "mistral-7b", dict(BASE), {}, "model", "no torchtitan model flavor"),
    ("torchtitan", L8, dict(BASE), {"model": "llama3"}, "--torchtitan-model", "NAME:FLAVOR"),
    ("megatron", L8, dict(gpus=8, zero=3, offload_params="cpu"), {}, "plan.offload_params", "parameters"),
    ("megatron", L8, dict(gpus=8, zero=1, offload_optimizer="nvme"), {}, "plan.offload_optimizer", "CPU only"),
    ("megatron", L8, dict(gpus=8, precision="bf16-mixed"), {}, "plan.precision", "autocast"),
    ("megatron", L8, dict(gpus=8, precision="bf16"), {}, "plan.precision", "16-bit-only"),
    ("megatron", L8, dict(gpus=8, optimizer="adamw-8bit"), {}, "plan.optimizer", "adam"),
    ("megatron", L8, dict(gpus=8, pp=2, pp_schedule="gpipe"), {}, "plan.pp_schedule", "1F1B"),
    (
        "megatron", L8, dict(gpus=8, pp=2, pp_schedule="interleaved", virtual_stages=2, recompute="full",
                             recompute_layers=2, global_batch=16), {}, "plan.recompute_layers", "virtual chunk",
    ),
    ("fsdp2", L8, dict(BASE, pp=2), {}, "plan.pp", "pipeline"),
    ("fsdp2", L8, dict(BASE, cp=2), {}, "plan.cp", "context"),
    ("fsdp2", "mixtral-8x7b", dict(BASE, ep=2), {}, "plan.ep", "expert"),
    ("fsdp2", L8, dict(BASE, tp=2, sequence_parallel=True), {}, "plan.sequence_parallel", "replicated"),
    ("fsdp2", L8, dict(BASE, recompute="selective"), {}, "plan.recompute", "whole layers"),
    ("fsdp2", L8, dict(BASE, recompute="selective-op"), {}, "plan.recompute", "whole layers"),
    ("megatron", L8, dict(gpus=8, recompute="selective-op"), {}, "plan.recompute", "attention core"),
    ("fsdp2", L8, dict(BASE, precision="bf16-master"), {}, "plan.precision", "master"),
    ("fsdp2", L8, dict(BASE, optimizer="adamw-8bit"), {}, "plan.optimizer", "bitsandbytes"),
    ("fsdp2", "gpt3-175b", dict(BASE), {}, "model.architecture", "gpt2"),
    ("fsdp2", "mixtral-8x7b", dict(BASE, tp=2), {}, "plan.tp", "dense Llama-family"),
    ("fsdp2", L8, dict(BASE, tp=2, zero=1), {}, "plan.zero", "DTensor"),
    ("fsdp2", L8, dict(BASE, offload_optimizer="cpu"), {}, "plan.offload_params", "together"),
]  # fmt: skip


@pytest.mark.parametrize(("target", "model", "flags", "opts", "field", "reason"), CASES)
def test_inexpressible_plan_is_refused(make_job, target, model, flags, opts, field, reason):
    job = make_job(model, **{k: v for k, v in flags.items() if v is not None})
    with pytest.raises(MemplanError) as err:
        export(job, target, **opts)
    assert err.value.field == field
    assert reason in err.value.reason
    if field.startswith("plan."):
        assert f"{target} cannot express" in err.value.reason


@pytest.mark.parametrize("target", ["deepspeed", "accelerate", "torchtitan", "megatron", "fsdp2"])
def test_inference_workloads_are_refused(target):
    from memplan.specs.resolve import resolve_job

    job = resolve_job("llama3-8b", None, {"batch": 8}, inference=True)
    with pytest.raises(MemplanError) as err:
        export(job, target)
    assert err.value.field == "workload.kind"


def test_an_option_a_target_does_not_take_is_refused(make_job):
    job = make_job(L8, **BASE)
    with pytest.raises(MemplanError) as err:
        export(job, "accelerate", gradient_clipping=1.0)
    assert err.value.field == "--gradient-clipping"
    with pytest.raises(MemplanError) as err:
        export(job, "pytorch")
    assert err.value.field == "--to"


def test_megatron_refuses_a_model_it_cannot_build(make_job, tiny_model):
    alibi = tiny_model(position_embedding="alibi")
    with pytest.raises(MemplanError) as err:
        export(make_job(alibi, gpus=8, zero=1), "megatron")
    assert err.value.field == "model.position_embedding"
    geglu = tiny_model(activation="gelu")
    with pytest.raises(MemplanError) as err:
        export(make_job(geglu, gpus=8, zero=1), "megatron")
    assert err.value.field == "model.activation"


@pytest.mark.parametrize(
    ("model", "field", "what"),
    [
        ("deepseek-v3", "model.mla", "multi-head latent attention"),
        ("deepseek-v2-lite", "model.mla", "multi-head latent attention"),
        ("phi3-mini", "model.attention_pattern", "sliding attention layers"),
        ("llama4-scout", "model.attention_pattern", "chunked attention layers"),
        ("olmo2-7b", "model.layer_norms", "post norms"),
    ],
)
def test_megatron_refuses_what_its_model_flags_cannot_build(make_job, model, field, what):
    """Issue 18: a family feature Megatron's flags (as memplan writes them) cannot express is refused by name."""
    with pytest.raises(MemplanError) as err:
        export(make_job(model, gpus=8, zero=1, precision="bf16-master"), "megatron")
    assert err.value.field == field
    assert what in err.value.reason and "megatron cannot express" in err.value.reason


def test_megatron_builds_qwen3_with_its_qk_norms(make_job):
    assert "--qk-layernorm" in export(make_job("qwen3-8b", gpus=8, zero=1, precision="bf16-master"), "megatron")


@pytest.mark.parametrize("model", ["qwen3-8b", "gemma3-12b", "phi4", "deepseek-v2-lite", "olmo2-7b", "llama4-scout"])
def test_transformers_exports_take_the_new_families(make_job, model):
    """Accelerate's FSDP wraps the family's own transformers decoder layer; fsdp2 shards its decoders and
    loads the model with SDPA."""
    from memplan.export import render
    from memplan.export.common import HF_LAYER_CLASS

    job = make_job(model, gpus=8, zero=3, precision="bf16-mixed")
    assert f"fsdp_transformer_layer_cls_to_wrap: {HF_LAYER_CLASS[job.model.architecture]}" in export(job, "accelerate")
    assert "attn_implementation='sdpa'" in " ".join(render(job, "fsdp2").notes)


def test_soft_capped_attention_exports_eager(make_job):
    """Gemma 2: transformers' SDPA path refuses soft-capped scores, so the exports load it eagerly (as the
    estimate counts it)."""
    from memplan.export import render

    job = make_job("gemma2-9b", gpus=8, zero=3, precision="bf16-mixed")
    assert "attn_implementation='eager'" in " ".join(render(job, "fsdp2").notes)
    assert "attn_implementation: eager" in export(job, "hf-trainer")
