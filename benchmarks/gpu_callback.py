"""``MemplanCallback`` on real ``transformers.Trainer`` runs: what it predicts against what CUDA measures.

    python benchmarks/gpu_callback.py --prepare DIR                  # random models saved once
    python benchmarks/gpu_callback.py --case NAME --models DIR --out OUT.json [--snapshot S.pickle] [--cpu-tiny]

Issue 28 asks for the callback on a few Trainer runs on a GPU, with what it measured committed in
docs/accuracy-gpu.md. Each case is one process: the model loaded the way fine-tuners load it
(``from_pretrained`` of a random model saved locally: no hub here; a 4-bit or 8-bit base through
``BitsAndBytesConfig``, then ``prepare_model_for_kbit_training``), PEFT LoRA where the case says,
``TrainingArguments`` as the usual recipes set them (``bf16=True``, gradient checkpointing, the
default fused AdamW), synthetic tokens, and ``MemplanCallback`` in ``callbacks``: it estimates at
``on_train_begin`` (``--runtime hf``, the GPU NVML detects) and compares with
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over steps 2-3. ``OUT.json`` gets
the comparison, the estimate's model (``op-level`` or ``phase``), its plan and the versions.

Each process has its own caching allocator, so cases can share one GPU side by side: memory is
exact, step times are not reported. ``--cpu-tiny`` rehearses a case on the CPU with a tiny model
of the same family (the dry run: the Trainer, PEFT and the callback run, the allocator does not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# the models: a family's config fields (full size; --cpu-tiny shrinks them)
MODELS = {
    "llama1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6,
    ),
}  # fmt: skip
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=1000)  # fmt: skip

# name: (model, load dtype, quantization, LoRA rank, TrainingArguments fields, micro-batch, seq)
CASES = {
    "llama1b-full-bf16": ("llama1b", "bfloat16", None, None, dict(), 2, 2048),
    "llama1b-full-fp32-bf16true-ckpt": ("llama1b", "float32", None, None,
                                        dict(bf16=True, gradient_checkpointing=True), 2, 2048),
    "llama1b-lora-bf16-ckpt": ("llama1b", "bfloat16", None, 16, dict(bf16=True, gradient_checkpointing=True), 2, 4096),
    "llama1b-qlora-nf4-dq": ("llama1b", "bfloat16", "nf4", 16, dict(bf16=True, gradient_checkpointing=True), 2, 4096),
    "llama1b-lora-int8": ("llama1b", "bfloat16", "int8", 16, dict(bf16=True, gradient_checkpointing=True), 2, 2048),
    "qwen3-0.6b-full-bf16-ckpt": ("qwen3-0.6b", "bfloat16", None, None, dict(gradient_checkpointing=True), 2, 4096),
}  # fmt: skip


def _config(name: str, tiny: bool):
    import transformers

    fields = dict(MODELS[name])
    if tiny:
        fields.update(TINY)
    return transformers.AutoConfig.for_model(**fields)


def prepare(folder: Path, tiny: bool = False, only: list[str] | None = None) -> None:
    """Save each model (or those in ``only``) once, random, in bf16 (a checkpoint's usual dtype)."""
    import torch
    import transformers

    for name in only or MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(name, tiny), torch_dtype=torch.bfloat16)
        model.save_pretrained(folder / name)
        del model


def _load(folder: Path, model_name: str, dtype: str, quant: str | None, cuda: bool):
    import torch
    import transformers

    kwargs: dict = {"dtype": getattr(torch, dtype), "attn_implementation": "sdpa"}
    if quant is not None:
        q = (
            dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                 bnb_4bit_compute_dtype=torch.bfloat16)
            if quant == "nf4"
            else dict(load_in_8bit=True)
        )  # fmt: skip
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(**q)
        kwargs["device_map"] = {"": 0} if cuda else {"": "cpu"}
    return transformers.AutoModelForCausalLM.from_pretrained(folder / model_name, **kwargs)


def run_case(name: str, folder: Path, out: Path, tiny: bool, snapshot: Path | None = None) -> dict:
    import torch
    import transformers

    from memplan.integrations.transformers import MemplanCallback

    model_name, dtype, quant, rank, fields, b, s = CASES[name]
    if tiny:
        b, s = 2, 64
    cuda = torch.cuda.is_available() and not tiny
    model = _load(folder, model_name, dtype, quant, cuda)
    if quant is not None:
        import peft

        model = peft.prepare_model_for_kbit_training(model)
    if rank is not None:
        import peft

        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.05,
                                 task_type="CAUSAL_LM")  # fmt: skip
        model = peft.get_peft_model(model, config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, vocab, (4 * b, s), generator=gen)]
    callback = MemplanCallback(seq_len=s, snapshot=snapshot if cuda else None)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=b, max_steps=4, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, use_cpu=not cuda, **fields,
        )  # fmt: skip
        transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    result, c = callback.result, callback.comparison
    doc = {
        "case": name, "model": model_name, "load_dtype": dtype, "quant": quant, "lora_rank": rank,
        "training_args": fields, "micro_batch": b, "seq_len": s, "seconds": time.perf_counter() - start,
        "estimate_seconds": callback.seconds,
        "memory_model": result.memory.model if result else None,
        "plan": result.plan if result else None,
        "gpu": (result.gpu or {}).get("name") if result else None,
        "comparison": c.model_dump() if c else None,
        "allocated_error": c.allocated_error if c else None,
        "reserved_error": c.reserved_error if c else None,
        "versions": _versions(),
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=1, default=str))
    return doc


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    v = {"torch": torch.__version__, "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for pkg in ("transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            v[pkg] = None
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", type=Path)
    p.add_argument("--case", choices=sorted(CASES))
    p.add_argument("--models", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--cpu-tiny", action="store_true")
    p.add_argument("--only", help="--prepare: these models only (comma-separated)")
    p.add_argument("--snapshot", type=Path, help="CUDA: the measured steps' allocator snapshot, for memplan explain")
    a = p.parse_args(argv)
    if a.prepare:
        prepare(a.prepare, a.cpu_tiny, a.only.split(",") if a.only else None)
        return 0
    if not (a.case and a.models and a.out):
        p.error("--case, --models and --out go together")
    doc = run_case(a.case, a.models, a.out, a.cpu_tiny, a.snapshot)
    c = doc["comparison"]
    print(f"{a.case}: {doc['memory_model']}: {c}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
