"""The hand-written loop (``--runtime hf-loop``) past its sliding window on CUDA (issue 28): the loop's
``DynamicSlidingWindowLayer`` caches (``hf_loop.py``) under the Trainer's masked SDPA on the memory-efficient kernel
(``hf_sliding.cuda_masked_sdpa``), where ``hf_support.sliding_cuda_ok`` follows the Trainer's. From PyTorch's and
transformers' source, **not run on a GPU**. Held by the CPU run of the same loop, which equals the real loop on CPU
(tests/unit/test_timeline_hf_loop_peft_families.py): outside SDPA's own tensors the CUDA run allocates and frees what
the CPU run does (as tests/unit/test_timeline_hf_mem_efficient.py holds the Trainer's), and by ``hf_support``'s line
between what the run follows on CUDA and what stays on the phase model. No torch needed: the runs are memplan's.
"""

from __future__ import annotations

import pytest
from estimate_json import estimate_memory as _estimate

from memplan.costmodel.quant import CudaArch
from memplan.costmodel.timeline.cpu import cpu_view
from memplan.costmodel.timeline.events import ALLOC, FREE, MARK, Category
from memplan.costmodel.timeline.hf_loop import hf_loop_plan_run
from memplan.costmodel.timeline.hf_sliding import cuda_saved_mask_bytes
from memplan.costmodel.timeline.hf_support import hf_supported, sliding_cuda_ok
from memplan.specs.loader import model_from_data
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

B, SEQ = 2, 128  # past every window below (64)
A100, H100, B200 = CudaArch(108, 8, 0), CudaArch(132, 9, 0), CudaArch(148, 10, 0)  # (SMs, major, minor)
DIMS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
DIMS |= dict(intermediate_size=344, vocab_size=2000, max_position_embeddings=256)
CONFIGS = {
    # memplan reads no window from a Mistral config.json's default: the spec states it (_model)
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **DIMS, "sliding_window": 64},
    "qwen2": {  # layer 0 full, layer 1 sliding (max_window_layers)
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **DIMS,
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 1,
    },
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **DIMS, "sliding_window": 64},
    "gemma3": {  # 256-wide heads: five sliding layers and a full one
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **DIMS,
        "num_hidden_layers": 6,
        "head_dim": 256,
        "sliding_window": 64,
        "query_pre_attn_scalar": 256,
    },
}
LORA = dict(precision="bf16", finetune="lora", lora_targets=("q_proj", "v_proj"))
QLORA = dict(precision="bf16", finetune="qlora", quant="nf4", lora_targets=("q_proj", "v_proj"))
PHI3_TARGETS = dict(lora_targets=("qkv_proj",))  # Phi-3's fused projection (PEFT's names)


def _model(family: str):
    model = model_from_data(CONFIGS[family], "w/config.json", "w")
    if family == "mistral":
        model = type(model)(**{**model.model_dump(), "attention_pattern": ("sliding",), "sliding_window": 64})
    return model


def _workload() -> TrainingWorkload:
    return TrainingWorkload(seq_len=SEQ, micro_batch=B)


def _runs(family: str, plan: Plan, gpu: CudaArch):
    """The loop's run on CUDA (as the estimate composes it: ``hf_loop_plan_run``) and on CPU, both followed."""
    model = _model(family)
    for device in ("cuda", "cpu"):
        assert hf_supported(model, plan, _workload(), "hf-loop", gpu, device) is None, device
    cuda = hf_loop_plan_run(model, _workload(), plan, gpu, "cuda")
    return model, cuda, hf_loop_plan_run(model, _workload(), plan, gpu, "cpu")


def _layer(events: list) -> int:
    """The decoder layer of the last of ``events`` that names one."""
    tag = next(e.tag for e in reversed(events) if e.tag.startswith("model.layers."))
    return int(tag.split(".")[2])


def _leaf(tag: str) -> str:
    return tag.rsplit(".", 1)[-1]


# The unmasked layers' kernel on CUDA in fp32 with GQA (SDPA's math path, already followed without a window:
# tests/unit/test_timeline_hf.py): its own causal mask, its heads' merge, v's gradient made contiguous
FULL_LAYER_MATH = ("mask_ones", "mask_tril", "mask_neg_inf", "mask_zero", "mask", "merge_heads", "grad_contiguous")
# bitsandbytes' CPU backend dequantizes each 4-bit weight (absmax, then the weight) where CUDA's gemm_4bit runs its
# own path (hf_bnb.py, the same without a window)
CPU_DEQUANT = ("absmax", "absmax_dequant", "weight_dequant")
# save_on_cpu's contiguous copies of transposed saves before the host copy (act_offload.STAGING), which cpu_view
# takes out of the CUDA run as CUDA's copy temporaries (cpu.cuda_temporaries)
OFFLOAD_STAGING = ("pack_staging",)


def _outside_sdpa(timeline, model) -> tuple[list, list]:
    """The steps' allocations in order and their frees as a multiset, leaving out what the kernels make differently:
    SDPA's own tensors (CPU's flash log-sum-exp against the memory-efficient kernel's), the optimizer (AdamW's
    ``step`` on the host under CUDA), the window tensors (:func:`test_each_sliding_cache_layer_copies_its_window_tensor_
    to_the_gpu_at_its_first_update`), a masked layer's heads merge (a view of the memory-efficient output, a copy of
    CPU's flash one over Phi-3's heads-major q: test_timeline_hf_mem_efficient.py), the full layers' unmasked kernel
    (``FULL_LAYER_MATH``), a 4-bit base's CPU dequantization (``CPU_DEQUANT``) and activation offload's staging
    copies (``OFFLOAD_STAGING``)."""
    full = {i for i, kind in enumerate(model.layer_attention_kinds) if kind != "sliding"}
    start = next(i for i, e in enumerate(timeline.events) if e.op == MARK and e.tag == "build")
    kept = []
    for e in timeline.events[start:]:
        if e.op not in (ALLOC, FREE) or ".sdpa" in e.tag:
            continue
        if e.category in (Category.OPTIMIZER_STATES, Category.OPTIMIZER_TEMP):
            continue
        leaf = _leaf(e.tag)
        in_full = any(f"layers.{i}.self_attn." in e.tag for i in full)
        if leaf in ("sliding_window_tensor", "merge_heads") and not in_full:
            continue
        if (in_full and leaf in FULL_LAYER_MATH) or leaf in CPU_DEQUANT + OFFLOAD_STAGING:
            continue
        kept.append((e.op, e.size, e.tag))
    return [e for e in kept if e[0] == ALLOC], sorted(e for e in kept if e[0] == FREE)


CASES = [
    ("mistral", dict(precision="fp32"), H100),
    ("mistral", dict(precision="bf16"), A100),  # 8.0: cuDNN not first, the 16-bit kernel
    ("mistral", dict(precision="bf16", autocast=True), A100),  # the plan's autocast: fp32 values' cache copy
    ("mistral", dict(precision="fp32", recompute="full"), H100),  # checkpointing: no cache, the Trainer's mask
    ("mistral", QLORA, H100),  # no autocast: the 4-bit base's fp32 stream, memory-efficient on 9.0 too
    ("qwen2", dict(precision="fp32"), H100),  # a full layer beside the sliding one
    ("qwen2", LORA, A100),
    ("phi3", dict(precision="bf16"), A100),
    ("phi3", {**LORA, **PHI3_TARGETS}, A100),
    ("phi3", {**QLORA, **PHI3_TARGETS}, H100),
    ("gemma3", dict(precision="bf16"), H100),  # 256-wide heads: past cuDNN's 128 on every GPU
    ("gemma3", dict(precision="bf16", autocast=True), A100),
    ("gemma3", LORA, H100),
    ("gemma3", QLORA, A100),
    ("mistral", dict(precision="bf16", offload_activations="cpu"), A100),  # save_on_cpu: the biases to the host
    ("qwen2", dict(precision="fp32", offload_activations="cpu"), H100),
    ("gemma3", {**LORA, "offload_activations": "cpu"}, H100),
]


def _id(case: tuple) -> str:
    family, fields, gpu = case
    kind = fields.get("finetune", "full") + ("-autocast" if fields.get("autocast") else "")
    kind += "-offload" if fields.get("offload_activations") else ""
    return f"{family}-{fields['precision']}-{kind}-{fields.get('recompute', 'none')}-sm{gpu.major}{gpu.minor}"


@pytest.mark.parametrize(("family", "fields", "gpu"), CASES, ids=[_id(c) for c in CASES])
def test_outside_sdpa_the_cuda_loop_is_the_cpu_loop(family: str, fields: dict, gpu: CudaArch) -> None:
    """The CUDA run seen as CPU sees it (``cpu.cpu_view``: cuBLAS's workspaces and the kernels' temporaries out)
    allocates and frees, outside SDPA's own tensors (:func:`_outside_sdpa`), what the CPU run of the same loop does:
    the cache's copies of k and v, ``repeat_kv``'s copies, the window's masks (bool grid, float mask and its
    scalars), the casts, the projections, the adapters, the gradients. Each sliding layer ran the memory-efficient
    kernel and saved its float bias; no full layer did."""
    model, cuda, cpu = _runs(family, Plan(**fields), gpu)
    assert _outside_sdpa(cpu_view(cuda), model) == _outside_sdpa(cpu, model)
    half = fields["precision"] != "fp32" and "quant" not in fields  # a 4-bit base without autocast: fp32 stream
    bias = cuda_saved_mask_bytes(B, SEQ, 2 if half else 4)
    for i, kind in enumerate(model.layer_attention_kinds):
        attn = [e for e in cuda.events if e.op == ALLOC and f"layers.{i}.self_attn." in e.tag]
        masks = {e.size for e in attn if _leaf(e.tag) == "mask_float"}
        efficient = [e for e in attn if ".sdpa_efficient." in e.tag]
        assert (masks == {bias} and bool(efficient)) if kind == "sliding" else not (masks or efficient), (i, kind)


def test_each_sliding_cache_layer_copies_its_window_tensor_to_the_gpu_at_its_first_update() -> None:
    """``DynamicSlidingWindowLayer.lazy_initialization``: ``_sliding_window_tensor.to(device)``, an int64 scalar on
    the GPU made right before the layer's first ``cat`` (its keys' copy), one a sliding layer and forward, kept by
    ``out``'s cache to the next forward's return; the host tensor made with the cache is no GPU byte. On CPU the
    same count, all made with the cache (``.to("cpu")`` returns it)."""
    model, cuda, cpu = _runs("gemma3", Plan(precision="bf16"), H100)
    sliding = [i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding"]
    events = [e for e in cuda.events if e.op in (ALLOC, FREE)]
    windows = [k for k, e in enumerate(events) if e.op == ALLOC and _leaf(e.tag) == "sliding_window_tensor"]
    steps = 3  # hf_loop_run's first step and two steady ones
    assert len(windows) == steps * len(sliding) and {events[k].size for k in windows} == {8}
    layers = [_layer(events[:k]) for k in windows]  # the cache's tags are its own: the attention's before it
    assert layers == sliding * steps
    for k in windows:  # allocated right before the keys' copy
        assert (events[k + 1].op, events[k + 1].tag) == (ALLOC, "past_key_values.keys")
    on_cpu = [e for e in cpu.events if e.op == ALLOC and _leaf(e.tag) == "sliding_window_tensor"]
    assert len(on_cpu) == len(windows)
    first = next(k for k, e in enumerate(events) if e.op == FREE and e.tensor == events[windows[0]].tensor)
    forwards = [e for e in cuda.events[: cuda.events.index(events[first])] if e.op == MARK]
    assert [e.tag for e in forwards].count("phase:forward") == 2  # freed as the second forward's out replaces it


@pytest.mark.parametrize(
    ("family", "fields", "gpu", "followed"),
    [
        ("gemma3", dict(precision="bf16"), H100, True),
        ("gemma3", dict(precision="bf16"), A100, True),
        ("gemma3", dict(precision="bf16"), B200, False),  # the backward's blocks by shared memory: 8.0 / 9.0 only
        ("gemma3", QLORA, H100, True),
        ("mistral", dict(precision="bf16"), H100, False),  # cuDNN (32-wide heads, 16 bits, 9.0)
        ("mistral", dict(precision="bf16", autocast=True), H100, False),
        ("mistral", dict(precision="bf16"), A100, True),
        ("mistral", dict(precision="fp32"), H100, True),
        ("mistral", QLORA, H100, True),  # the loop's 4-bit base without autocast: fp32 into SDPA
        ("phi3", {**LORA, **PHI3_TARGETS}, H100, False),
        ("qwen2", LORA, A100, True),
        ("qwen2", dict(precision="fp32"), B200, False),
    ],
)
def test_which_masked_calls_the_loop_follows_on_cuda(family: str, fields: dict, gpu: CudaArch, followed: bool) -> None:
    """The Trainer's line (``sliding_cuda_ok``) read with the loop's precision (no autocast unless the plan asks):
    followed on the memory-efficient kernel on 8.0 / 9.0; cuDNN and other capabilities declined, the reason naming
    the kernel and the loop."""
    model, plan = _model(family), Plan(**fields)
    assert sliding_cuda_ok(model, plan, gpu, "hf-loop") is followed
    reason = hf_supported(model, plan, _workload(), "hf-loop", gpu)
    assert (reason is None) is followed, reason
    if not followed:
        assert "a window the sequence reaches: on CUDA SDPA takes the mask to its" in reason
        assert ("outside compute capability 8.0 / 9.0" in reason) is (gpu is B200)
        assert "under the hand-written loop on CPU" in reason


def test_a_4bit_base_s_masked_layers_differ_between_the_runtimes() -> None:
    """QLoRA over Mistral on an H100: the Trainer's ``bf16=True`` autocast hands SDPA bf16 (cuDNN, declined); the
    loop without autocast the fp32 stream (memory-efficient, followed)."""
    model, plan = _model("mistral"), Plan(**QLORA)
    assert hf_supported(model, plan, _workload(), "hf-loop", H100) is None
    assert "takes the mask to its cudnn kernel" in hf_supported(model, plan, _workload(), "hf", H100)


@pytest.mark.parametrize(
    "args",
    [
        ["gemma3-12b", "--precision", "bf16", "--seq-len", "2048"],  # 40 of 48 layers past the 1,024-token window
        ["gemma3-12b", "--finetune", "lora", "--seq-len", "2048", "--gpu", "a100-80gb"],
        ["mistral-7b", "--precision", "bf16", "--seq-len", "4096", "--gpu", "a100-80gb"],
        ["phi3-mini", "--finetune", "qlora", "--lora-targets", "qkv_proj", "--seq-len", "4096"],  # fp32 stream
    ],
)
def test_estimate_answers_the_loop_past_its_window_op_level(capsys, args: list[str]) -> None:
    memory = _estimate(capsys, [args[0], "--runtime", "hf-loop", *args[1:]])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf-loop"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["mistral-7b", "--precision", "bf16", "--seq-len", "4096"], "takes the mask to its cudnn kernel"),
        (
            ["gemma3-12b", "--precision", "bf16", "--seq-len", "2048", "--gpu", "b200"],
            "takes the mask to its efficient kernel outside compute capability 8.0 / 9.0",
        ),
    ],
)
def test_estimate_declines_the_rest_with_a_reason(capsys, args: list[str], says: str) -> None:
    memory = _estimate(capsys, [args[0], "--runtime", "hf-loop", *args[1:]])
    assert memory["model"] == "phase" and says in memory["model_reason"]
    assert "under the hand-written loop on CPU" in memory["model_reason"]
