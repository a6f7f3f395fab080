"""Whether a change leaves the product's output unchanged: the sha256 of ``memplan estimate --format json``
over varied plans and of ``memplan tune --format json`` under each runtime (a tool, not a test).

For a change meant to alter no figure (code deleted, a module split): run it before and after, and compare.
The plans cover each runtime (the bundled trainer, transformers' Trainer, the hand-written loop, megatron),
both models (op-level runs and the phase model: MoE, context and expert parallelism, fp8, inference, the
pipelines and offload the runs decline) and the fine-tuning modes. A refused plan is hashed too (its one
stderr line). The tune's study name, which holds the time, is left out of its hash. Some 5 minutes on an idle
core (used 2026-11-29 for the phase model's dead code, docs/cost-model.md, "What the op-level run does not
reach yet").

    python benchmarks/output_guard.py --save before.txt      # on the base commit
    python benchmarks/output_guard.py --compare before.txt   # after the change: exit 1 on a difference
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

H100, H200 = "--gpu h100-sxm", "--gpu h200"
RUNTIMES = ("memplan", "hf", "hf-loop", "megatron")
PLANS = f"""
llama3-8b {H100}
llama3-8b {H100} --dp 8 --zero 3 --recompute full
llama3-8b {H100} --dp 8 --zero 3 --recompute selective --micro-batch 2
llama3-8b {H200} --dp 4 --zero 2 --precision bf16
llama3-8b {H100} --dp 2 --zero 0 --recompute full
llama3-8b {H100} --dp 4 --zero 1 --precision bf16-mixed
llama3-8b {H100} --tp 4 --sequence-parallel --dp 2 --zero 3
llama3-8b {H100} --pp 4 --dp 2 --zero 1 --micro-batch 1 --global-batch 32
llama3-8b {H100} --pp 4 --dp 2 --zero 3 --pp-schedule interleaved --virtual-stages 2 --global-batch 32
llama3-8b {H100} --pp 2 --pp-schedule gpipe --global-batch 8
llama3-8b {H100} --dp 8 --zero 3 --offload-params cpu --offload-optimizer cpu
llama3-8b {H100} --offload-optimizer cpu --zero 1 --dp 2
llama3-8b {H100} --offload-activations cpu --dp 2 --zero 1
llama3-8b {H100} --precision fp8 --dp 8 --zero 3
llama3-8b {H100} --precision fp8 --dp 8 --zero 3 --fp8-all-gather
llama3-8b {H100} --precision fp8 --runtime megatron --tp 2 --fp8-recipe delayed
llama3-8b {H100} --cp 2 --dp 4 --zero 3 --seq-len 16384
llama3-8b {H100} --runtime megatron --tp 4 --sequence-parallel --pp 2 --global-batch 16
llama3-8b {H100} --runtime megatron --recompute selective --dp 8 --zero 1
llama3-8b {H100} --runtime hf --dp 2 --zero 3 --recompute full
llama3-8b {H100} --runtime hf-loop --recompute full --precision bf16
llama3-8b {H100} --finetune lora --lora-targets all-linear
llama3-8b {H100} --finetune qlora --runtime hf --recompute full
llama3-8b {H100} --finetune lora --runtime memplan --recompute full
llama3-8b {H100} --finetune qlora --runtime memplan
llama3-8b {H100} --finetune lora --quant int8 --runtime hf
llama3-8b {H100} --optimizer paged-adamw-8bit --runtime hf
llama3-8b {H100} --optimizer sgd --precision fp32 --recompute full
llama3-8b {H100} --optimizer adafactor --precision fp16-master --dp 2 --zero 2
llama3-8b {H100} --attention eager --precision bf16 --recompute selective-op
llama3-8b {H100} --attention triton --recompute-layers 8 --recompute full
llama3-8b {H100} --device cpu --precision fp32 --seq-len 512
llama3-8b {H100} --inference --batch 8 --context 4096
llama3-70b {H100} --inference --batch 16 --tp 8 --kv-dtype fp8 --block-size 16
llama3-8b {H100} --inference --batch 4 --prefill-chunk 2048
mixtral-8x7b {H100} --dp 8 --zero 3 --ep 8 --recompute full
mixtral-8x7b {H100} --dp 8 --zero 3 --recompute full
mixtral-8x7b {H100} --offload-activations cpu --micro-batch 2
qwen3-30b-a3b {H200} --dp 8 --zero 3 --ep 4 --runtime megatron --tp 2 --sequence-parallel
deepseek-v2-lite {H100} --runtime hf --recompute full --precision bf16
deepseek-v2-lite {H200} --pp 3 --dp 2 --ep 2 --zero 1 --runtime megatron --global-batch 12 --recompute full
llama4-scout {H200} --dp 8 --zero 3 --recompute full
gpt3-175b --gpu a100-80gb --tp 8 --pp 8 --dp 4 --zero 1 --runtime megatron --global-batch 256 --recompute full
gemma2-9b {H100} --runtime hf --recompute full --precision bf16
phi3-mini --gpu a100-40gb --runtime hf-loop --finetune lora --precision bf16 --lora-targets qkv_proj,o_proj
qwen2.5-7b --gpu l40s --finetune qlora --runtime hf-loop --recompute full
olmo2-7b {H100} --dp 2 --zero 1 --offload-activations cpu
llama3-70b {H100} --dp 64 --zero 3 --recompute full
llama3-70b --gpu mi300x --dp 8 --zero 3 --recompute full --allocator expandable
mixtral-8x7b {H100} --pp 4 --dp 2 --zero 3 --pp-schedule interleaved --virtual-stages 2 --global-batch 16
llama3-8b {H100} --precision fp8 --offload-activations cpu
llama3-8b {H100} --finetune lora --precision fp8 --runtime megatron
qwen3-8b {H100} --dp 4 --zero 3 --recompute selective --micro-batch 2 --seq-len 4096
"""
TUNES = [
    *(
        f"llama3-8b --gpus 8 {H100} --runtime {rt} --trials 30 --seed 1"
        for rt in ("memplan", "hf", "hf-loop", "megatron")
    ),
    f"llama3-8b --gpus 4 {H100} --finetune lora --trials 20 --seed 2",
]


def _digest(args: list[str], workdir: Path | None = None) -> str:
    """The exit code and the sha256 (16 hex digits) of the command's stdout and stderr."""
    memplan = Path(sys.executable).with_name("memplan")
    extra = ["--workdir", str(workdir)] if workdir else []
    out = subprocess.run([str(memplan), *args, "--format", "json", *extra], capture_output=True, text=True)
    text = "\n".join(line for line in (out.stdout + out.stderr).splitlines() if '"study": ' not in line)
    return f"{out.returncode} {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def lines() -> list[str]:
    """One line a command: its digest and the command."""
    out = [f"{_digest(['estimate', *plan.split()])} estimate {plan}" for plan in PLANS.strip().splitlines()]
    workdir = Path(tempfile.gettempdir()) / "memplan-output-guard"  # one path: the output may name it
    for tune in TUNES:
        shutil.rmtree(workdir, ignore_errors=True)  # a new study each time
        out.append(f"{_digest(['tune', *tune.split()], workdir)} tune {tune}")
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the digests here")
    what.add_argument("--compare", type=Path, help="compare with digests saved before")
    args = parser.parse_args()
    now = lines()
    if args.save:
        args.save.write_text("\n".join(now) + "\n")
        return 0
    before = args.compare.read_text().splitlines()
    changed = [f"- {b}\n+ {a}" for b, a in zip(before, now, strict=True) if a != b]
    print("\n".join(changed) or f"unchanged: {len(now)} commands")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
