"""The op-level run of ``transformers.Trainer`` (``costmodel/timeline/hf_trainer.py``) against the real
Trainer on CPU (fp32, bf16, and ``bf16=True`` over fp32): the peak of live storages over three steps,
counted by ``StorageTracker`` (tests/accuracy/hf_steps.py's harness), equal to the byte on every case.

The tracker takes each storage's Python object to watch it go, which holds a second reference to the
storage: ``InputBuffer::accumulate`` then sums every second gradient out of place (without the tracker
the engine adds in place: torch.profiler shows one ``aten::add`` instead of the backward's extra one on a
norm-shaped graph). The run is compared with that flag set (``inplace_accumulate=False``); where it
moves the peak the case says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)

from memplan.costmodel.timeline.hf_trainer import hf_kernel  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

STEPS = 3


def _case(name: str, **fields) -> hf_steps.Case:
    return hf_steps.Case(f"hfrun-{name}", loop="trainer", **fields)


SMALL = dict(hf_steps.BASE_SMALL)
CASES = [
    _case("fp32-mha"),
    _case("fp32-gqa", kv_heads=2),
    _case("fp32-ckpt", checkpointing=True),
    _case("fp32-tied", tied=True),
    _case("bf16-mha", **SMALL, dtype="bfloat16"),
    _case("bf16-gqa-ckpt", **{**SMALL, "kv_heads": 1}, dtype="bfloat16", checkpointing=True),
    _case("bf16-tied-ckpt", **SMALL, tied=True, dtype="bfloat16", checkpointing=True),
    _case("layers-fp32", **hf_steps.LAYERS),
    _case("layers-fp32-ckpt", **hf_steps.LAYERS, checkpointing=True),
    _case("mistral-fp32-ckpt", arch="mistral", kv_heads=2, checkpointing=True, layers=4, batch=4),
    _case("qwen2-fp32-gqa", arch="qwen2", kv_heads=2),
    _case("qwen2-bf16-tied", **{**SMALL, "kv_heads": 1}, arch="qwen2", tied=True, dtype="bfloat16"),
    # bf16=True: accelerate's autocast over the fp32 model
    _case("autocast", **SMALL, autocast=True),
    _case("autocast-layers-gqa", **hf_steps.LAYERS_SMALL, autocast=True),
    _case("autocast-gqa-ckpt", **{**SMALL, "kv_heads": 1}, autocast=True, checkpointing=True),
    _case("autocast-vocab-tied", **hf_steps.VOCAB_SMALL, tied=True, autocast=True),
    _case("qwen2-autocast-ckpt", arch="qwen2", kv_heads=2, autocast=True, checkpointing=True, ffn=344, vocab=4000),
]


def predict(case: hf_steps.Case, inplace_accumulate: bool = False, ga: int = 1, dp: int = 1) -> int:
    """The run's peak for the case's config.json, workload and precision, on CPU's kernels, with
    ``ga`` micro-batches per optimizer step, on one of ``dp`` ranks (DDP)."""
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, dp=dp)
    return hf_predict(case, plan, ga=ga, inplace_accumulate=inplace_accumulate).peak()[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


GA_CASES = [
    (_case("ga2"), 2),
    (_case("ga3-bf16-ckpt", **SMALL, dtype="bfloat16", checkpointing=True), 3),
    (_case("ga2-autocast-tied", **SMALL, tied=True, autocast=True), 2),
]


@pytest.mark.parametrize(("case", "ga"), GA_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_with_gradient_accumulation(case: hf_steps.Case, ga: int) -> None:
    """``gradient_accumulation_steps``: the update's batches together, ``.grad`` added into."""
    import ga_log

    measured = ga_log.measure(case, ga, steps=STEPS)
    predicted = predict(case, ga=ga)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_each_case_is_a_trainer_case() -> None:
    assert all(c.loop == "trainer" and c.device == "cpu" for c in CASES)
    assert len({dataclasses.astuple(c)[1:] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("precision", "kv_heads", "kernel"),
    [("bf16", 2, "flash"), ("bf16-mixed", 4, "flash"), ("fp32", 2, "math"), ("fp32", 4, "efficient")],
)
def test_cuda_kernel(precision: str, kv_heads: int, kernel: str) -> None:
    """On CUDA the run takes the bundled trainer's kernel rule (flash in 16-bit; fp32 with GQA: the
    math path; fp32 without: the memory-efficient kernel, mem_efficient.py); CPU's own flash."""
    case = _case("kernel", kv_heads=kv_heads)
    model = model_from_data(case.hf_config(), "kernel/config.json", "kernel")
    plan = Plan(precision=precision)
    assert hf_kernel(model, plan, "cuda") == kernel
    assert hf_kernel(model, plan, "cpu") == "cpu_flash"


def test_cuda_run_holds_cublas_workspaces_and_flash_tensors() -> None:
    """The CUDA run differs from the CPU one by what CUDA allocates: cuBLAS's two workspaces,
    flash's philox seeds, the sum-to-weight workspace (not checked on a GPU against transformers)."""
    case = _case("cuda", **SMALL, dtype="bfloat16")
    plan = Plan(precision="bf16")
    tags = {e.tag for e in hf_predict(case, plan, kernel="flash").events}
    assert {"cublas_workspace.forward", "cublas_workspace.backward"} <= tags
    assert any(t.endswith("philox_seed") for t in tags) and any(t.endswith("reduce_workspace") for t in tags)
    cpu_tags = {e.tag for e in hf_predict(case, plan).events}
    assert not any("cublas" in t or "philox" in t or "reduce_workspace" in t for t in cpu_tags)


LLAMA1B = str(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")


@pytest.mark.parametrize(
    "args",
    [
        [LLAMA1B, "--runtime", "hf", "--precision", "bf16", "--seq-len", "2048", "--micro-batch", "2"],
        [LLAMA1B, "--runtime", "hf", "--precision", "bf16-mixed", "--recompute", "full", "--global-batch", "8"],
        [LLAMA1B, "--runtime", "hf", "--precision", "bf16", "--finetune", "lora", "--recompute", "full"],
        [LLAMA1B, "--runtime", "hf", "--precision", "bf16-mixed", "--finetune", "qlora", "--seq-len", "2048"],
        # 1024 tokens: the kernel bitsandbytes picks on the default profile's GPU (test_timeline_quant_gpu.py)
        [
            LLAMA1B,
            "--runtime",
            "hf",
            "--precision",
            "bf16",
            "--finetune",
            "qlora",
            "--seq-len",
            "512",
            "--micro-batch",
            "2",
        ],
    ],
)
def test_estimate_answers_an_hf_cuda_plan_op_level(capsys, args: list[str]) -> None:
    """``memplan estimate --runtime hf`` on CUDA: the Trainer's run replayed, its allocated peak reported."""
    memory = _estimate(capsys, args)
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    peak = memory["peak"]
    assert peak["reserved_detail"]["timeline"] == "hf"
    assert peak["allocated"] == peak["reserved_detail"]["timeline_allocated"]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        # compute capability 8.9: MLA's memory-efficient backward blocks not followed (hf_support.mla_cuda_ok)
        (["deepseek-v2-lite", "--runtime", "hf", "--gpu", "l40s"], "MLA attention on CUDA"),
        ([LLAMA1B, "--runtime", "hf", "--dp", "2", "--zero", "1"], "ZeRO over more than one rank"),
        ([LLAMA1B, "--runtime", "hf", "--tp", "2"], "more than one rank"),
        (
            [
                LLAMA1B,
                "--runtime",
                "hf",
                "--finetune",
                "qlora",
                "--seq-len",
                "512",
                "--micro-batch",
                "2",
                "--gpu",
                "mi300x",
            ],
            "1536 tokens",  # a ROCm profile: no compute capability or SMs for bitsandbytes' CUDA rule
        ),
        # eager attention over MLA (the dense and MoE families' is the run's: test_timeline_hf_eager.py)
        (["deepseek-v2-lite", "--runtime", "hf", "--attention", "eager"], "eager attention"),
        # accumulation under hf-loop is followed now (test_timeline_hf_loop_families.py); its ranks are not
        ([LLAMA1B, "--runtime", "hf-loop", "--dp", "2", "--zero", "3"], "more than one rank under the hf-loop"),
    ],
)
def test_an_hf_plan_the_run_does_not_model_says_so(capsys, args: list[str], reason: str) -> None:
    memory = _estimate(capsys, args)
    assert memory["model"] == "phase" and reason in memory["model_reason"]


def test_the_default_precision_is_the_trainers_recipe():
    """A fine-tuning plan given no precision runs transformers' Trainer (``hf``) in its usual recipe,
    ``bf16`` (a bfloat16 model under ``bf16=True``), which the hf run follows; ``bf16-master`` (the
    plan's default elsewhere) given explicitly keeps fp32 masters the plain Trainer does not: the hf
    run declines it and says which precisions it follows."""
    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.specs.resolve import resolve_job

    for finetune in ("lora", "qlora"):
        job = resolve_job("llama3-8b", None, dict(finetune=finetune), False)
        assert job.runtime == "hf" and job.plan.precision == "bf16"
        assert hf_supported(job.model, job.plan, job.workload, job.runtime) is None
    job = resolve_job("llama3-8b", None, dict(finetune="lora", precision="bf16-master"), False)
    assert job.runtime == "hf" and job.plan.precision == "bf16-master"
    why = hf_supported(job.model, job.plan, job.workload, job.runtime)
    assert why is not None and "DeepSpeed's" in why and "--precision bf16" in why
    loop = resolve_job("llama3-8b", None, dict(runtime="hf-loop"), False)
    assert loop.plan.precision == "bf16"
    bundled = resolve_job("llama3-8b", None, dict(finetune="lora", runtime="memplan"), False)
    assert bundled.plan.precision == "bf16-master"


def test_a_4bit_base_is_followed_where_every_linear_dequantizes():
    """bitsandbytes' CUDA ``gemm_4bit`` dequantizes and calls ``F.linear`` over 1536 rows, and over
    512 for weights of 4 Mi elements or more (``costmodel.quant.gemm_4bit_kernel``): llama3-8b's
    smallest, k_proj and v_proj, have 4 Mi, so 1024 tokens are followed and 512 are not."""
    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.specs.resolve import resolve_job

    def why(seq_len: int) -> str | None:
        flags = dict(finetune="qlora", precision="bf16", seq_len=seq_len, micro_batch=1)
        job = resolve_job("llama3-8b", None, flags, False)
        return hf_supported(job.model, job.plan, job.workload, job.runtime)

    assert why(1024) is None and why(1537) is None
    assert "fused kernel" in why(512)
