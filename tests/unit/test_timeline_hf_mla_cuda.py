"""DeepSeek-V2 / V3 under the Trainer on CUDA: SDPA over MLA's q/k heads (qk_nope + qk_rope, 192) and narrower
value heads (128) runs the memory-efficient kernel (``attention.sdpa_backend``: flash needs one head dim; cuDNN
takes no head above 128 at torch 2.11's bundled cuDNN), followed op by op from PyTorch's source in fp32 and
16 bits (``timeline/mem_efficient.py``, ``mem_efficient_half.py``). From source, no GPU trace: each size below is
computed by hand from the lines the modules cite (``attention.cu``, ``attention_backward.cu``,
``mem_eff_attention/kernel_forward.h``, ``kernel_backward.h``, ``kernels/cutlassF.h``, ``cutlassB.h``).
"""

from __future__ import annotations

import json

import pytest

from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.gemm_4bit_rule import CudaArch
from memplan.costmodel.timeline import mem_efficient_half
from memplan.costmodel.timeline.events import ALLOC
from memplan.costmodel.timeline.hf_support import hf_supported
from memplan.costmodel.timeline.hf_trainer import hf_kernel, hf_plan_run
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

QK, V = 192, 128  # DeepSeek-V3 and V2-Lite: qk_nope 128 + qk_rope 64, v_head_dim 128


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
@pytest.mark.parametrize("heads", [128, 16])  # V3, V2-Lite
def test_sdpa_runs_the_memory_efficient_kernel_over_mla_heads(dtype: str, capability: tuple, heads: int) -> None:
    """Causal, training, no mask, torch 2.11: flash's ``check_head_dim_size_flash`` wants q, k and v of one
    head dim; ``check_head_dim_size_mem_efficient`` takes q = k and an aligned v; cuDNN (first on sm90 at
    2.11's bundled cuDNN) declines heads above 128."""
    kernel = sdpa_backend(
        "cuda", dtype, QK, heads, heads, enable_gqa=False, capability=capability, torch_version=(2, 11), v_head_dim=V
    )
    assert kernel == "efficient"
    # one head dim of 192 in 16 bits: flash (so the unequal value dim is what moves MLA off it)
    same = sdpa_backend("cuda", "bf16", QK, heads, heads, enable_gqa=False, capability=capability)
    assert same == "flash"


def _sdpa_allocs(plan: Plan, workload: TrainingWorkload) -> list[tuple[str, int]]:
    """Layer 0's SDPA allocations in a two-layer DeepSeek-V2-Lite's run on CUDA: (what, bytes), first step."""
    model = load_model("deepseek-v2-lite").model_copy(update={"num_layers": 2})
    assert hf_supported(model, plan, workload) is None
    assert hf_kernel(model, plan, "cuda") == "efficient"
    events = [e for e in hf_plan_run(model, workload, plan).events if e.op == ALLOC]
    prefix = "model.layers.0.self_attn.sdpa_efficient."
    return [(e.tag.removeprefix(prefix), e.size) for e in events if e.tag.startswith(prefix)]


B, S, H = 2, 100, 16  # 2 x 16 = 32 (batch, head) blocks: the keys split in two (ceil(100 / 64), under 200 / 32)
ROWS = B * H * S * 4  # delta: (B, nH, M) fp32
LSE = B * H * 128 * 4  # (B, nH, ceil(100 / kAlignLSE 32) * 32) fp32


def test_the_16_bit_kernel_allocates_what_its_source_says() -> None:
    """bf16 (V2-Lite's heads of 192 / 128, b 2, s 100). Forward (``_efficient_attention_forward``): ``res``
    (B, M, nH, Kv) bf16, the padded log-sum-exp, then the 32x128_gmem kernel's fp32 ``output_accum`` of res's
    shape (``kNeedsOutputAccumulatorBuffer``). Backward: grad_q, grad_k (192 wide), grad_v (128 wide) in bf16,
    the kernel-computed ``delta`` (``kKernelComputesDelta``: no product, no sum), then the 128x64_k65536
    kernel's workspace per (batch, head): gK 2 splits x 64 x align_up(192, 128) = 32,768 floats, gV 2 x 64 x 128
    = 16,384, dQ ceil(100 / 128) x ceil(192 / 64) = 3 tiles of (16 B + 128 x 64 x 4 B) = 24,588 floats."""
    allocs = _sdpa_allocs(Plan(precision="bf16"), TrainingWorkload(seq_len=S, micro_batch=B))
    q, v = B * S * H * QK * 2, B * S * H * V * 2
    workspace = B * H * (2 * 64 * 256 + 2 * 64 * 128 + 3 * (16 + 128 * 64 * 4) // 4) * 4
    assert workspace == 9_438_720
    assert allocs[:3] == [("out", v), ("lse", LSE), ("output_accum", 2 * v)]
    backward = [a for a in allocs if a[0] in ("dq", "dk", "dv", "delta", "delta_product", "grad_q_workspace")][:5]
    assert backward == [("dq", q), ("dk", q), ("dv", v), ("delta", ROWS), ("grad_q_workspace", workspace)]


def test_bf16_true_autocast_hands_the_kernel_bf16_inputs() -> None:
    """``bf16=True`` over fp32 weights (bf16-mixed): autocast casts SDPA's inputs, so the same bf16 kernel."""
    bf16 = _sdpa_allocs(Plan(precision="bf16"), TrainingWorkload(seq_len=S, micro_batch=B))
    mixed = _sdpa_allocs(Plan(precision="bf16-mixed"), TrainingWorkload(seq_len=S, micro_batch=B))
    assert mixed == bf16


def test_the_fp32_kernel_over_unequal_heads_allocates_what_its_source_says() -> None:
    """fp32: no output accumulator (``output_accum_t == output_t``); delta as ``(grad_out.to(float) *
    out.to(float)).sum(-1).transpose(-2, -1).contiguous()``: the product of out's (value-wide) size, the sum,
    the copy; the fp32 kernel for maxK 192 (128x64_k65536) keeps no gK/gV staging, dQ's 3 tiles alone."""
    allocs = _sdpa_allocs(Plan(precision="fp32"), TrainingWorkload(seq_len=S, micro_batch=B))
    q, v = B * S * H * QK * 4, B * S * H * V * 4
    workspace = B * H * 3 * (16 + 128 * 64 * 4)
    assert allocs[:2] == [("out", v), ("lse", LSE)] and "output_accum" not in dict(allocs)
    names = ("dq", "dk", "dv", "delta_product", "delta_sum", "delta", "grad_q_workspace")
    backward = [a for a in allocs if a[0] in names][:7]
    assert backward == [
        ("dq", q), ("dk", q), ("dv", v), ("delta_product", v), ("delta_sum", ROWS), ("delta", ROWS),
        ("grad_q_workspace", workspace),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("b", "heads", "s", "splits"),
    [
        (2, 16, 100, 2),  # ceil(100 / 64)
        (1, 16, 4096, 12),  # at most 200 / 16
        (1, 128, 4096, 1),  # V3's 128 heads: 200 / 128
        (2, 128, 128, 1),  # a grid of 256 blocks over at most 2 x 64 keys
        (4, 128, 4096, 1),  # 200 / 512 = 0, raised to 1
    ],
)
def test_the_keys_split_as_the_launch_heuristic_says(b: int, heads: int, s: int, splits: int) -> None:
    assert mem_efficient_half.num_splits_key(b, heads, s) == splits


def test_deepseek_v3_s_workspace_by_hand() -> None:
    """V3 (128 heads) at 4096 tokens, one sequence: one split; per head gK 64 x 256, gV 64 x 128, dQ 32 query
    blocks x 3 column tiles of 8,196 floats: 811,392 floats, 3.2 MB a head."""
    assert mem_efficient_half.workspace_bytes(1, 128, 4096, QK, V) == 128 * (16_384 + 8_192 + 32 * 3 * 8_196) * 4


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed", "fp32"])
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_estimate_answers_deepseek_op_level_on_an_h100(capsys, name: str, precision: str) -> None:
    from memplan.cli.app import run

    args = [name, "--runtime", "hf", "--gpu", "h100-sxm", "--precision", precision, "--seq-len", "512"]
    assert run(["estimate", *args, "--format", "json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"


@pytest.mark.parametrize(
    ("arch", "precision", "mla"),
    [
        (CudaArch(142, 8, 9), "bf16", {}),  # an L40S: the 128-row backward kernel's shared memory, not followed
        (CudaArch(148, 10, 0), "fp32", {}),  # a B200
    ],
)
def test_mla_on_cuda_the_run_does_not_follow_says_so(arch: CudaArch | None, precision: str, mla: dict) -> None:
    model = load_model("deepseek-v2-lite")
    model = model.model_copy(update={"mla": model.mla.model_copy(update=mla)})
    plan, workload = Plan(precision=precision), TrainingWorkload(seq_len=512, micro_batch=1)
    why = hf_supported(model, plan, workload, gpu_arch=arch)
    assert why is not None and why.startswith("MLA attention on CUDA"), why
    assert hf_supported(model, plan, workload, device="cpu") is None  # the CPU's math path
