"""What ``MemplanCallback`` adds to a fine-tuning run's start (issue 28: under 0.5 s).

At ``on_train_begin`` the callback reads the live model and ``TrainingArguments``
(``integrations.transformers.trainer_plan``) and estimates the run (``memplan.api.estimate``,
``--runtime hf``). On a GPU that estimate builds and replays transformers' Trainer op by op
(``timeline/hf_trainer.py``); on the CPU the phase model answers. This measures both paths on
full-size models built on PyTorch's meta device (no weights, the live model's config and module
tree): the CPU seconds of ``trainer_plan`` and of the estimate, with the device forced to
``cuda`` for the op-level path. Process CPU time, best of ``--repeat`` after one warm-up call
(imports and profiles loaded, as they are by the time a Trainer starts).

    python benchmarks/bench_callback.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

CASES = {
    # name: (config fields, TrainingArguments fields, PEFT LoRA rank or None, sequence length)
    "llama3-8b-lora-r16-bf16": (
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, vocab_size=128256),
        dict(bf16=True, gradient_checkpointing=True), 16, 4096,
    ),
    "llama3-8b-full-bf16-ckpt": (
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, vocab_size=128256),
        dict(gradient_checkpointing=True), None, 4096,
    ),
    "llama3.2-1b-full-bf16": (
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
        dict(), None, 2048,
    ),
}  # fmt: skip


def _model(fields: dict, rank: int | None):
    import torch
    import transformers

    config = transformers.LlamaConfig(**fields, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16)
    if rank is not None:
        import peft

        lora = peft.LoraConfig(r=rank, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    return model


def _args(fields: dict):
    import tempfile

    import transformers

    return transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, use_cpu=True, report_to=[], **fields
    )


def measure(repeat: int) -> list[tuple[str, str, str, float, float]]:
    """(case, device, memory model, trainer_plan seconds, estimate seconds) per case and device."""
    from memplan.api import estimate
    from memplan.integrations.transformers import trainer_plan

    rows = []
    for name, (fields, arg_fields, rank, seq) in CASES.items():
        model, args = _model(fields, rank), _args(arg_fields)
        for device in ("cpu", "cuda"):
            best_plan = best_estimate = float("inf")
            model_name = ""
            for _ in range(repeat + 1):
                start = time.process_time()
                inputs = trainer_plan(model, args, seq)
                middle = time.process_time()
                result = estimate(
                    inputs["config"], plan=inputs["plan"], workload=inputs["workload"], gpu="h100-sxm",
                    gpus=inputs["gpus"], runtime="hf", device=device,
                )  # fmt: skip
                end = time.process_time()
                best_plan, best_estimate = min(best_plan, middle - start), min(best_estimate, end - middle)
                model_name = result.memory.model
            rows.append((name, device, model_name, best_plan, best_estimate))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| case | device | memory model | trainer_plan | estimate | total |")
    print("|---|---|---|---:|---:|---:|")
    for name, device, model, plan_s, est_s in measure(args.repeat):
        print(f"| {name} | {device} | {model} | {plan_s:.3f} s | {est_s:.3f} s | {plan_s + est_s:.3f} s |")


if __name__ == "__main__":
    main()
