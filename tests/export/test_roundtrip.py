"""Every export reads back to the plan it was written from (memplan.export.*.parse).

For each target, a range of plans it can express: the fields its own keys carry (the module's
``CARRIES``) must come back equal to the job's, and the notes must say how to set what the
format leaves to the training code.
"""

from __future__ import annotations

import pytest

from memplan.export import TARGETS, fields, parse, render
from memplan.export.common import finetune_fields
from memplan.export.megatron import parse_model

L8 = "llama3-8b"
L70 = "llama3-70b"
MIX = "mixtral-8x7b"
TRAIN = dict(seq_len=4096, micro_batch=2, global_batch=64)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

CASES = [
    # DeepSpeed: every ZeRO stage, precision and offload the JSON carries
    ("deepspeed", L8, dict(gpus=8, zero=0, precision="fp32", **TRAIN), {}),
    ("deepspeed", L8, dict(gpus=8, zero=1, precision="bf16-master", seq_len=2048, micro_batch=1, global_batch=256), {}),
    ("deepspeed", L8, dict(gpus=16, zero=2, precision="fp16-master", recompute="full", **TRAIN), {}),
    ("deepspeed", L8, dict(gpus=8, zero=3, precision="bf16", offload_params="cpu", offload_optimizer="cpu"), {}),
    ("deepspeed", L8, dict(gpus=8, zero=3, precision="bf16-mixed", offload_optimizer="nvme"), {"nvme_path": "/nvme"}),
    ("deepspeed", L8, dict(gpus=8, zero=2, optimizer="sgd", precision="bf16-master", **TRAIN), {}),
    # Accelerate FSDP2
    ("accelerate", L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="full", **TRAIN), {}),
    ("accelerate", L8, dict(gpus=8, zero=2, precision="fp32"), {}),
    ("accelerate", L8, dict(gpus=16, zero=3, offload_params="cpu", offload_optimizer="cpu", precision="bf16-mixed"),
     {}),
    ("accelerate", L8, dict(gpus=16, cp=2, zero=3, precision="bf16-mixed", seq_len=8192), {}),
    # torchtitan, both forms
    *[
        ("torchtitan", model, flags, {"form": form})
        for form in ("python", "toml")
        for model, flags in [
            (L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="full", **TRAIN)),
            (L8, dict(gpus=8, zero=0, precision="fp32", **TRAIN)),
            (L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="selective-op", **TRAIN)),
            (L8, dict(gpus=16, tp=2, sequence_parallel=True, zero=2, precision="bf16")),
            (L8, dict(gpus=16, cp=2, zero=3, precision="bf16-mixed", seq_len=8192)),
            (L8, dict(gpus=8, zero=3, precision="bf16-mixed", offload_params="cpu", offload_optimizer="cpu")),
            (
                L70,
                dict(gpus=64, tp=8, sequence_parallel=True, pp=4, pp_schedule="interleaved", virtual_stages=2, zero=2,
                     precision="bf16-mixed", recompute="full", seq_len=8192, global_batch=512),
            ),
            (L70, dict(gpus=64, tp=8, sequence_parallel=True, pp=4, pp_schedule="gpipe", zero=3, global_batch=64,
                       precision="bf16")),
        ]
    ],
    ("torchtitan", L8, dict(gpus=8, pp=2, zero=3, recompute="full", recompute_layers=4, global_batch=16,
                          precision="bf16-mixed"), {"form": "toml"}),
    ("torchtitan", "qwen3-30b-a3b", dict(gpus=16, tp=2, sequence_parallel=True, ep=4, zero=3, precision="bf16-mixed"),
     {"form": "toml", "model": "qwen3:30B-A3B"}),
    # Megatron-LM
    (
        "megatron",
        L70,
        dict(gpus=64, tp=8, sequence_parallel=True, pp=4, pp_schedule="interleaved", virtual_stages=2, zero=1,
             precision="bf16-master", recompute="selective", seq_len=8192, global_batch=512),
        {},
    ),
    ("megatron", L8, dict(gpus=8, zero=0, precision="fp32", optimizer="sgd", attention="eager", **TRAIN), {}),
    ("megatron", L8, dict(gpus=8, zero=2, precision="fp16-master", recompute="full"), {}),
    ("megatron", L8, dict(gpus=8, zero=3, precision="fp8", cp=2, seq_len=8192), {}),
    ("megatron", L8, dict(gpus=8, zero=1, offload_optimizer="cpu", pp=2, recompute="full", recompute_layers=4), {}),
    ("megatron", MIX, dict(gpus=16, tp=2, ep=4, zero=1, global_batch=64), {"gradient_clipping": 0.5}),
    # plain PyTorch FSDP2 / DTensor
    ("fsdp2", L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="full", **TRAIN), {}),
    ("fsdp2", L8, dict(gpus=16, tp=2, zero=2, precision="bf16", recompute="full", recompute_layers=8), {}),
    ("fsdp2", L8, dict(gpus=8, zero=0, precision="fp32", attention="eager"), {}),
    ("fsdp2", L8, dict(gpus=8, zero=1, optimizer="adafactor", precision="bf16-mixed"), {}),
    ("fsdp2", L8, dict(gpus=8, zero=3, offload_params="cpu", offload_optimizer="cpu", optimizer="sgd",
                       precision="fp32"), {}),
    # fine-tuning stacks (the full grid is tests/export/test_finetune_exports.py)
    ("hf-trainer", L8, dict(gpus=1, finetune="qlora", lora_targets=("all-linear",), precision="bf16-mixed",
                            recompute="full"), {}),
    ("hf-trainer", L8, dict(gpus=8, zero=3, finetune="lora", precision="bf16-mixed", **TRAIN), {}),
    ("axolotl", L8, dict(gpus=1, finetune="qlora", quant="fp4", lora_rank=32, precision="bf16", recompute="full"), {}),
    ("axolotl", L8, dict(gpus=8, zero=2, finetune="lora", modules_to_save=("lm_head",), precision="bf16-master"), {}),
    # LoRA on an MoE model's attention linears (the plans estimate answers from the Trainer's op-level run)
    ("hf-trainer", MIX, dict(gpus=1, finetune="lora", lora_targets=ATTN, precision="bf16", recompute="full"), {}),
    ("axolotl", "qwen3-30b-a3b", dict(gpus=1, finetune="lora", lora_targets=ATTN, precision="bf16", lora_rank=32,
                                      modules_to_save=("lm_head",)), {}),
]  # fmt: skip


@pytest.mark.parametrize(("target", "model", "flags", "opts"), CASES)
def test_export_reads_back_to_the_same_plan(make_job, target, model, flags, opts):
    job = make_job(model, **flags)
    exported = render(job, target, **opts)
    back = parse(target, exported.text, job.model.num_layers)
    assert set(back) == set(TARGETS[target].CARRIES)
    # the fine-tuning stacks write the mode in one form (a quantized base reads back as qlora)
    want = finetune_fields(job) if target in ("hf-trainer", "axolotl") else fields(job)
    assert {k: want[k] for k in back} == back


def test_every_target_has_a_case():
    assert {c[0] for c in CASES} == set(TARGETS)


@pytest.mark.parametrize("model", [L8, L70, MIX, "qwen3-30b-a3b", "qwen2.5-7b"])
def test_megatron_network_arguments_build_the_same_model(make_job, model):
    job = make_job(model, gpus=8, zero=1)
    got = parse_model(render(job, "megatron").text)
    m = job.model
    want = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_size": m.ffn_size,
        "num_attention_heads": m.num_attention_heads,
        "kv_heads": m.kv_heads,
        "max_position_embeddings": m.max_position_embeddings,
        "norm": m.norm,
        "mlp": m.mlp,
        "tied_embeddings": m.tied_embeddings,
        "qkv_bias": m.qkv_bias,
    }
    assert got == want


def test_deepspeed_notes_say_how_to_set_what_the_json_leaves_to_code(make_job):
    job = make_job(L8, gpus=8, zero=3, recompute="full", attention="eager", precision="bf16-master")
    notes = " ".join(render(job, "deepspeed").notes)
    assert "gradient_checkpointing_enable" in notes  # recomputation for HF models
    assert "torch.optim.AdamW" in notes
    assert "attn_implementation='eager'" in notes
    offload = make_job(L8, gpus=8, zero=3, offload_optimizer="cpu", precision="bf16-master")
    assert "DeepSpeedCPUAdam" in " ".join(render(offload, "deepspeed").notes)


def test_accelerate_notes_carry_the_batch_the_yaml_cannot(make_job):
    job = make_job(L8, gpus=8, zero=3, precision="bf16-mixed", seq_len=4096, micro_batch=2, global_batch=64)
    notes = " ".join(render(job, "accelerate").notes)
    assert "gradient_accumulation_steps=4" in notes
    assert "2 sequences of 4096 tokens" in notes


def test_notes_are_in_the_file_where_the_format_has_comments(make_job):
    job = make_job(L8, gpus=8, zero=3, precision="bf16-mixed")
    for target in ("accelerate", "torchtitan", "fsdp2"):
        exported = render(job, target)
        assert exported.notes
        for note in exported.notes:
            assert note.split()[0] in exported.text
