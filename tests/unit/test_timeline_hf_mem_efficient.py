"""SDPA's memory-efficient (CUTLASS) kernel on CUDA under transformers' runtimes, at every head dim (issue 28):
16 bits over heads of 128 or less (the register-resident forward kernels, the ``kOutputInRF`` backward kernels) and
fp32 without GQA, unmasked. From PyTorch's source (``timeline/mem_efficient.py``, ``mem_efficient_half.py``), not
run on a GPU: each byte figure below is worked by hand from the lines those modules cite (``kernels/cutlassF.h``,
``cutlassB.h``, ``kernel_forward.h``, ``kernel_backward.h``, ``attention.cu``, ``attention_backward.cu``), never by
calling the function under test for the expected value. The rest of the run (masks, casts, projections, the loop's
cache) is held against the CPU run, which equals the real Trainer on CPU (tests/unit/test_timeline_hf.py,
test_timeline_hf_sliding.py). No torch needed: the runs are memplan's.
"""

from __future__ import annotations

import pytest
from estimate_json import estimate_memory as _estimate

from memplan.costmodel.quant import CudaArch
from memplan.costmodel.timeline import mem_efficient, mem_efficient_half
from memplan.costmodel.timeline.cpu import cpu_view
from memplan.costmodel.timeline.events import ALLOC, FREE, Category
from memplan.costmodel.timeline.hf_families import family_config
from memplan.costmodel.timeline.hf_loop import hf_loop_run
from memplan.costmodel.timeline.hf_support import hf_supported
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_kernel, hf_plan_run, hf_run
from memplan.specs.loader import load_model, model_from_data
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

B, HEADS = 2, 4
LLAMA = {  # as many KV heads as query heads: transformers passes SDPA no enable_gqa, repeats nothing
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "intermediate_size": 344,
    "vocab_size": 2000,
    "max_position_embeddings": 256,
}
MISTRAL = {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_key_value_heads": 2}
A100, H100, L40S = CudaArch(108, 8, 0), CudaArch(132, 9, 0), CudaArch(142, 8, 9)


# ---- the kernels' figures, from the source by hand ----------------------------------------------------------------


@pytest.mark.parametrize(("head", "accumulator"), [(32, False), (64, False), (96, False), (128, False), (256, True)])
def test_the_16_bit_forward_keeps_its_output_in_registers_up_to_128(head: int, accumulator: bool) -> None:
    """``dispatch_cutlassF_bf16_sm80``: 64x64_rf (kMaxK 64), 64x128_rf (128): ``kSingleValueIteration = kMaxK <=
    kKeysPerBlock`` = ``kKeepOutputInRF``, so no ``output_accum``; 32x128_gmem over 128 needs one."""
    assert mem_efficient_half.output_accumulator(head, head) is accumulator
    assert mem_efficient_half.output_accumulator(192, 128) is True  # MLA's pair: maxK 192


@pytest.mark.parametrize(
    ("max_k", "kernel"),
    [(32, (32, 64, 64)), (64, (64, 64, 64)), (96, (128, 128, 128)), (128, (128, 128, 128)), (192, (65536, 128, 64))],
)
def test_the_16_bit_backward_kernel_by_head_dim(max_k: int, kernel: tuple) -> None:
    """``dispatch_cutlassB_bf16_sm80`` on 8.0 / 9.0 (the ``128x64_k96`` kernel only on 8.6 / 8.9): 64x64_k32,
    64x64_k64, 128x128_k128 (kPreload), then 128x64_k65536; (kMaxK, kBlockSizeI, kBlockSizeJ)."""
    assert mem_efficient_half.backward_kernel(max_k) == kernel


# dQ's GradQTempStorage: a 16-byte lock header and kBlockSizeI x kBlockSizeJ fp32, in floats
TILE_64 = (16 + 64 * 64 * 4) // 4  # 4,100
TILE_128 = (16 + 128 * 128 * 4) // 4  # 16,388
TILE_128x64 = (16 + 128 * 64 * 4) // 4  # 8,196


@pytest.mark.parametrize(
    ("b", "heads", "s", "head", "expected"),
    [
        # 64x64, kOutputInRF: no gK / gV; dQ ceil(100 / 64) = 2 row blocks x ceil(32 / 64) = 1 column: 8,200 floats
        (2, 4, 100, 32, 2 * 4 * 8_200 * 4),
        # Phi-3-mini (32 heads of 96) at 4,096 tokens: 128x128, 32 row blocks x 1 column x 16,388 floats
        (1, 32, 4096, 96, 32 * 32 * TILE_128 * 4),
        (2, 4, 100, 128, 2 * 4 * TILE_128 * 4),  # one 128-row block, one 128-column block
        (1, 32, 4096, 64, 32 * 64 * TILE_64 * 4),  # 64x64: 64 row blocks
        (1, 256, 4096, 128, 256 * 32 * TILE_128 * 4),  # 256 (batch, head) blocks: the splits stage nothing here
        (1, 1, 4096, 128, 32 * TILE_128 * 4),  # 64 splits of the keys, the same bytes a head
    ],
)
def test_the_16_bit_workspace_up_to_128_is_dq_s_tiles_alone(b: int, heads: int, s: int, head: int, expected: int):
    """``kOutputInRF`` makes ``kNeedsAccumGradK / V`` false: ``workspace_elements_gk / gv`` are 0 whatever
    ``num_splits_key`` is; ``workspace_elements_gq = ceil(M / kBlockSizeI) * ceil(K / kBlockSizeJ) *
    sizeof(GradQTempStorage) / 4``, aligned to 4 floats (each count above is), per (batch, head)."""
    assert mem_efficient_half.workspace_bytes(b, heads, s, head, head) == expected


@pytest.mark.parametrize(
    ("s", "head", "expected"),
    [
        (100, 32, 2 * 4 * 2 * TILE_64 * 4),  # 64x64_k32: 2 row blocks x 1 column
        (100, 64, 2 * 4 * 2 * TILE_64 * 4),  # 64x64_k64
        (100, 96, 2 * 4 * 1 * 2 * TILE_128x64 * 4),  # 128x64_k128: 1 row block x ceil(96 / 64) = 2 columns
        (4096, 128, 2 * 4 * 32 * 2 * TILE_128x64 * 4),  # 32 row blocks x 2 columns
    ],
)
def test_the_fp32_workspace_without_gqa(s: int, head: int, expected: int) -> None:
    """``dispatch_cutlassB_f32_sm80``: 64x64_k32, 64x64_k64, 128x64_k128, 128x64_k65536; in fp32 ``output_accum_t
    == output_t``, so dQ's tiles alone (``kNeedsAccumGradQ`` by ``kEnableSplitKeys``), b 2, 4 heads."""
    assert mem_efficient.workspace_bytes(B, HEADS, s, head) == expected


# ---- the runs ------------------------------------------------------------------------------------------------------


def _model(config: dict, **update):
    model = model_from_data(config, "w/config.json", "w")
    return type(model)(**{**model.model_dump(), **update}) if update else model


def _run(model, seq: int, precision: str, device: str = "cuda", gpu: CudaArch | None = None, loop: bool = False):
    runtime = "hf-loop" if loop else "hf"
    plan, workload = Plan(precision=precision), TrainingWorkload(seq_len=seq, micro_batch=B)
    assert hf_supported(model, plan, workload, runtime, gpu, device) is None
    d, kernel = hf_dims(model, workload, plan, runtime), hf_kernel(model, plan, device, runtime)
    if loop:
        return hf_loop_run(d, model.tied_embeddings, kernel, steps=2)
    return hf_run(d, model.tied_embeddings, kernel, steps=2, arch=model.architecture, extra=family_config(model))


def _sdpa(timeline, layer: int = 0) -> list[tuple[str, int]]:
    """Layer ``layer``'s memory-efficient allocations of the first step: (what, bytes)."""
    prefix = f"model.layers.{layer}.self_attn.sdpa_efficient."
    allocs = [(e.tag.removeprefix(prefix), e.size) for e in timeline.events if e.op == ALLOC and prefix in e.tag]
    return allocs[: [i for i, (what, _) in enumerate(allocs) if what == "out"][1]]  # up to the next step's output


def test_fp32_without_gqa_runs_the_memory_efficient_kernel() -> None:
    """Llama in fp32 over 4 KV heads of 32 (b 2, s 100): the output and the log-sum-exp (4 heads x 128 rows, padded
    to ``kAlignLSE`` 32); backward dq, dk, dv, the delta's product (out's size), sum and copy (b, heads, s) fp32,
    and the 64x64_k32 kernel's workspace (2 row blocks x 4,100 floats a head)."""
    timeline = _run(_model(LLAMA), 100, "fp32")
    qkv, rows = B * 100 * HEADS * 32 * 4, B * HEADS * 100 * 4
    assert _sdpa(timeline) == [
        ("out", qkv), ("lse", B * HEADS * 128 * 4), ("dq", qkv), ("dk", qkv), ("dv", qkv),
        ("delta_product", qkv), ("delta_sum", rows), ("delta", rows), ("grad_q_workspace", B * HEADS * 2 * TILE_64 * 4),
    ]  # fmt: skip


def test_a_masked_bf16_layer_on_an_a100_runs_the_register_resident_kernels() -> None:
    """Mistral past its window in bf16 on 8.0 (cuDNN not first): the window's bias saved beside the 64x64 kernels'
    tensors, no fp32 output accumulator (64x64_rf), the kernel-computed delta (b, heads, s) fp32, dQ's 2 x 4,100
    floats a head and no gK / gV staging."""
    model = _model(MISTRAL, attention_pattern=("sliding",), sliding_window=64)
    timeline = _run(model, 128, "bf16", gpu=A100)
    qkv = B * 128 * HEADS * 32 * 2
    assert _sdpa(timeline) == [
        ("out", qkv), ("lse", B * HEADS * 128 * 4), ("dq", qkv), ("dk", qkv), ("dv", qkv),
        ("delta", B * HEADS * 128 * 4), ("grad_q_workspace", B * HEADS * 2 * TILE_64 * 4),
    ]  # fmt: skip
    bias = [e for e in timeline.events if e.op == ALLOC and e.tag.endswith("layers.0.self_attn.mask_float")]
    assert {e.size for e in bias} == {B * 128 * 128 * 2}


def test_mla_over_heads_of_128_in_bf16_runs_the_128x128_kernel() -> None:
    """DeepSeek-V2-Lite with q/k heads of 64 + 64 and v of 64 (b 2, s 100, 16 heads): the 64x128_rf forward (no
    accumulator), the 128x128_k128 backward: dQ 1 row block x 1 column of 16,388 floats a head, no gK / gV."""
    model = load_model("deepseek-v2-lite").model_copy(update={"num_layers": 2})
    model = model.model_copy(update={"mla": model.mla.model_copy(update={"qk_nope_head_dim": 64, "v_head_dim": 64})})
    plan, workload = Plan(precision="bf16"), TrainingWorkload(seq_len=100, micro_batch=B)
    assert hf_supported(model, plan, workload) is None
    allocs = _sdpa(hf_plan_run(model, workload, plan))
    q, v, heads = B * 100 * 16 * 128 * 2, B * 100 * 16 * 64 * 2, 16
    assert allocs == [
        ("out", v), ("lse", B * heads * 128 * 4), ("dq", q), ("dk", q), ("dv", v),
        ("delta", B * heads * 100 * 4), ("grad_q_workspace", B * heads * TILE_128 * 4),
    ]  # fmt: skip


def _outside_sdpa(timeline) -> tuple[list, list]:
    """The forward's and backward's allocations in order and their frees as a multiset, SDPA's own left out: the
    kernels differ there (CPU's flash log-sum-exp, the order each node releases its saves), nowhere else. (The
    optimizer is not attention's: the loop's ``AdamW(foreach=True)`` keeps its ``step`` counters on the host under
    CUDA, ``hf_loop.optimizer_step``.)"""
    optimizer = (Category.OPTIMIZER_STATES, Category.OPTIMIZER_TEMP)
    events = [
        (e.op, e.size, e.tag)
        for e in timeline.events
        if e.op in (ALLOC, FREE) and ".sdpa" not in e.tag and e.category not in optimizer
    ]
    return [e for e in events if e[0] == ALLOC], sorted(e for e in events if e[0] == FREE)


@pytest.mark.parametrize(
    ("config", "precision", "gpu", "loop", "update"),
    [
        (LLAMA, "fp32", H100, False, {}),
        (LLAMA, "fp32", H100, True, {}),  # the hand-written loop: its DynamicCache's copies of k and v
        (MISTRAL, "bf16", A100, False, {"attention_pattern": ("sliding",), "sliding_window": 64}),
        (MISTRAL, "fp32", A100, False, {"attention_pattern": ("sliding",), "sliding_window": 64}),
    ],
)
def test_everything_else_in_the_run_is_the_cpu_runs(config, precision, gpu, loop, update) -> None:
    """The CUDA run seen as CPU sees it (``cpu.cpu_view``: cuBLAS's workspaces and the kernels' temporaries out),
    SDPA's own tensors aside, allocates and frees what the CPU run does: the masks (bool grid, float bias and its
    scalars), ``repeat_kv``'s copies, the casts, the projections and their gradients, the loop's cache."""
    model = _model(config, **update)
    cuda = cpu_view(_run(model, 128, precision, gpu=gpu, loop=loop))
    cpu = _run(model, 128, precision, device="cpu", loop=loop)
    assert _outside_sdpa(cuda) == _outside_sdpa(cpu)


PHI3 = {**LLAMA, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "sliding_window": 64}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_phi3_s_heads_merge_is_a_view_of_the_kernel_s_output(precision: str) -> None:
    """Phi-3 past its window (A100): RoPE's ``cat`` leaves q heads-major and CPU's flash output follows it, so
    ``attn_output.transpose(1, 2).contiguous()`` copies there (``merge_heads``, saved by o_proj); the memory-efficient
    kernel writes ``res = at::empty({B, M, num_heads, Kv})``, token-major whatever q is, so on CUDA the same line is
    a view: one (b, s, h) copy a layer and step less, everything else the CPU run's."""
    model = _model(PHI3)
    cuda = _outside_sdpa(cpu_view(_run(model, 128, precision, gpu=A100)))
    cpu = _outside_sdpa(_run(model, 128, precision, device="cpu"))
    copy = B * 128 * 128 * (4 if precision == "fp32" else 2)
    merges = [e for e in cpu[0] if e[2].endswith("self_attn.merge_heads")]
    assert len(merges) == 2 * 2 and {e[1] for e in merges} == {copy}  # 2 layers x 2 steps
    assert cuda == tuple([e for e in x if not e[2].endswith("self_attn.merge_heads")] for x in cpu)


# ---- what the estimate answers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["hf", "hf-loop"])
def test_fp32_llama2_without_gqa_is_answered_by_the_run(capsys, runtime: str) -> None:
    """Llama 2 7B (32 heads, 32 KV heads) in fp32: the memory-efficient kernel, op-level on the default H100 and on
    an A100; on an L40S (8.9, its shared memory not checked) the phase model, saying why."""
    args = ["llama2-7b", "--runtime", runtime, "--precision", "fp32", "--seq-len", "1024"]
    for gpu in ([], ["--gpu", "a100-80gb"]):
        memory = _estimate(capsys, [*args, *gpu])
        assert memory["model"] == "op-level" and memory["model_reason"] is None
    memory = _estimate(capsys, [*args, "--gpu", "l40s"])
    assert memory["model"] == "phase"
    assert memory["model_reason"].startswith("fp32 SDPA on the memory-efficient kernel outside compute capability")


def test_phi3_past_its_window_in_bf16_is_answered_on_an_a100(capsys) -> None:
    """Phi-3-mini (96-wide heads, its 2,047-token window reached at 4,096): on an A100 the masked layers run the
    16-bit memory-efficient kernel (128x128 blocks), op-level; on an H100 cuDNN, still the phase model's."""
    args = ["phi3-mini", "--runtime", "hf", "--precision", "bf16", "--seq-len", "4096"]
    memory = _estimate(capsys, [*args, "--gpu", "a100-80gb"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    memory = _estimate(capsys, args)
    assert memory["model"] == "phase" and "takes the mask to its cudnn kernel" in memory["model_reason"]
