"""4-bit bases where CUDA's ``gemm_4bit`` picks its kernel by the GPU (5 to 1536 tokens), on a known GPU.

bitsandbytes 0.50.2's ``_gemm_4bit_use_custom_cuda`` (``backends/cuda/ops.py``) decides between its fused
kernel and dequantize + ``F.linear`` by (M, N, K, dtype) and the GPU's SMs and compute capability
(``_gpu_dispatch_props``). ``memplan.costmodel.gemm_4bit_rule`` writes it out; the tests below hold it
against the installed bitsandbytes' own function, executed from its source with ``_gpu_dispatch_props``
answering for each bundled GPU profile (the CUDA module itself needs a CUDA torch to import). Then the
op-level runs (the bundled trainer's ``timeline/quant.py``, the Trainer's ``timeline/hf_bnb.py``) follow
the path the rule picks, and the estimate answers these plans from them on H100 and H200 profiles.

No GPU ran these plans (the one QLoRA trace, h200_a_qlora8b, is at 16,384 tokens: the fallback; it is
replayed in tests/unit/test_timeline_qlora.py). The fused kernel allocates its output alone
(``_gemm_4bit_kernel_impl``), which is what a CPU count of the custom op sees too: the comparison with
the bundled trainer on CPU at these token counts is tests/unit/test_timeline_quant_variants.py's
(``timeline_peaks.steady_peaks`` sets the fallback's CUDA-only temporaries apart).
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import types
from pathlib import Path

import pytest

from memplan.costmodel.gemm_4bit_rule import CudaArch, use_custom_cuda
from memplan.costmodel.quant import DEQUANTIZE, FUSED, cuda_arch, gemm_4bit_kernel
from memplan.costmodel.timeline.events import ALLOC
from memplan.specs.loader import profile_names
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA3_8B = {"q": (4096, 4096), "k/v": (1024, 4096), "o": (4096, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}
BOUNDARY_M = (1, 4, 5, 6, 7, 8, 16, 17, 32, 33, 48, 49, 64, 65, 512, 513, 1536, 1537)


def _bnb_rule():
    """bitsandbytes' ``_gemm_4bit_use_custom_cuda`` compiled from the installed source, undecorated
    (``functools.cache``), with ``_gpu_dispatch_props`` and ``torch``'s dtypes given by the caller."""
    spec = importlib.util.find_spec("bitsandbytes")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "backends" / "cuda" / "ops.py"
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_gemm_4bit_use_custom_cuda"]
    fn.decorator_list = []
    namespace: dict = {"torch": types.SimpleNamespace(float32="fp32", float16="fp16", bfloat16="bf16")}
    namespace["_GEMM_4BIT_CUSTOM_FLOOR_M"] = 4
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def bnb():
    return _bnb_rule()


def _source_says(bnb: dict, arch: CudaArch, dtype: str, m: int, n: int, k: int) -> bool:
    bnb["_gpu_dispatch_props"] = lambda _index: (arch.sms, arch.major, arch.minor)
    return bnb["_gemm_4bit_use_custom_cuda"](0, dtype, m, n, k)


def _profiles() -> dict[str, CudaArch]:
    from memplan.specs.resolve import _gpu

    out = {}
    for name in profile_names("gpus"):
        arch = cuda_arch(_gpu(name)[0])
        if arch is not None:
            out[name] = arch
    return out


def test_every_bundled_nvidia_profile_carries_what_bitsandbytes_reads():
    """Each NVIDIA profile has its compute capability and SM count (sources in the YAML); the AMD one
    has neither (bitsandbytes' ROCm rule reads the gfx architecture: not followed)."""
    archs = _profiles()
    assert set(archs) == {"a100-40gb", "a100-80gb", "b200", "h100-pcie", "h100-sxm", "h200", "l40s", "rtx-4090"}
    assert archs["h100-sxm"] == archs["h200"] == CudaArch(132, 9, 0)


def test_the_rule_is_bitsandbytes_own_on_every_bundled_gpu_at_llama3_8b_shapes(bnb):
    """Every M from 5 to 1536, every 8B linear, bf16 and fp32, every bundled NVIDIA profile."""
    for (name, arch), dtype, (n, k) in itertools.product(_profiles().items(), ("bf16", "fp32"), LLAMA3_8B.values()):
        for m in range(5, 1537):
            assert use_custom_cuda(m, n, k, dtype, arch) == _source_says(bnb, arch, dtype, m, n, k), (name, m, n, k)


# every branch's architectures, with SM counts either side of the shapes' wave thresholds
ARCHS = [
    CudaArch(s, *cc)
    for cc in [(6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0), (12, 1)]
    for s in (20, 46, 58, 84, 132)
]
SHAPES = [(n, k) for n in (128, 512, 1024, 2560, 3072, 4096, 8192, 12800) for k in (256, 1024, 2048, 3072, 4096, 12288)]
M_GRID = (
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    16,
    17,
    23,
    24,
    32,
    33,
    48,
    49,
    64,
    65,
    96,
    97,
    128,
    129,
    192,
    193,
    256,
    257,
    320,
    321,
    384,
    385,
    512,
    513,
    1536,
)


def test_the_rule_is_bitsandbytes_own_on_every_branch(bnb):
    """Architectures from sm61 to sm121 (each ``is_sm*`` branch and the fallback tiers), small and large
    weights, short, square and tall K, fp16 too (sm75's MMA kernel takes fp16 only), at the tiers' edges."""
    for arch, dtype, (n, k), m in itertools.product(ARCHS, ("bf16", "fp16", "fp32"), SHAPES, M_GRID):
        assert use_custom_cuda(m, n, k, dtype, arch) == _source_says(bnb, arch, dtype, m, n, k), (arch, dtype, m, n, k)


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200", "h100-pcie", "a100-80gb", "l40s", "b200"])
def test_gemm_4bit_kernel_gives_a_path_for_every_token_count_on_a_known_gpu(gpu, bnb):
    """With the GPU known no token count is left undecided: the fallback over 1536 rows, the fused
    kernel at most 4, bitsandbytes' rule between (8B's shapes at the boundaries)."""
    arch = _profiles()[gpu]
    for (n, k), m in itertools.product(LLAMA3_8B.values(), BOUNDARY_M):
        path = gemm_4bit_kernel(m, n, k, 2, arch)
        if m > 1536:
            assert path == DEQUANTIZE
        elif m <= 4:
            assert path == FUSED
        else:
            assert path == (FUSED if _source_says(bnb, arch, "bf16", m, n, k) else DEQUANTIZE)


def test_on_h100_and_h200_llama3_8b_fuses_only_a_few_rows():
    """Read off the sm90 branch (132 SMs, ``n_blocks = ceil(N / 64)``): q and o (n_blocks 64, K = N), k
    and v (16): fused under 8 rows (M = 5 to 7: ``M < 8``, K == N at n_blocks * 5 < 396 is the
    ``lt_60pct_wave`` side, not refused), the fallback from 8 (n_blocks < 66 = sms // 2); gate and up
    (224 >= 132: ``M <= 32``); down (64, K > N at under 3/4 wave: refused from M = 6 on)."""
    arch = CudaArch(132, 9, 0)
    want = {"q": 7, "k/v": 7, "o": 7, "gate/up": 32, "down": 5}  # the last M fused
    for name, (n, k) in LLAMA3_8B.items():
        fused = [m for m in range(5, 1537) if gemm_4bit_kernel(m, n, k, 2, arch) == FUSED]
        assert fused == list(range(5, want[name] + 1)), name


def test_without_a_gpu_only_what_holds_on_every_gpu_is_decided():
    """No profile (or one without SMs and compute capability): None where the GPU decides."""
    assert gemm_4bit_kernel(512, 4096, 4096, 2) is None
    assert gemm_4bit_kernel(513, 4096, 4096, 2) == DEQUANTIZE
    assert gemm_4bit_kernel(7, 4096, 4096, 4) == FUSED and gemm_4bit_kernel(8, 4096, 4096, 4) == DEQUANTIZE


# a model whose linears take different paths on one GPU: on sm90 at 16 rows q, o and down dequantize
# (n_blocks 32 < 66 = 132 // 2), k and v (a small weight at a quarter wave: M <= 32) and gate and up
# (n_blocks 128 >= 66, K < N: M <= 16) run the fused kernel; on an A100 (sm80, 108 SMs) down alone
# dequantizes (``K >= N * 3 and n_blocks * 4 > num_sms``: 32 * 4 > 108), the rest fuse (under half a wave)
MID = ModelSpec(
    name="mid", hidden_size=2048, num_layers=2, num_attention_heads=16, num_kv_heads=4, ffn_size=8192, vocab_size=512
)
QLORA = dict(finetune="qlora", quant="nf4", lora_rank=8, lora_targets=("all-linear",), precision="bf16")
STEPS = 3  # trainer_run / hf_plan_run: a warm-up step and two steady ones


def _linears(model: ModelSpec) -> list[tuple[int, int]]:
    """One decoder layer's linears (N, K), as both trainers call them: q, k, v, o, gate, up, down."""
    h = model.hidden_size
    return [(model.q_size, h), (model.kv_size, h), (model.kv_size, h), (h, model.q_size)] + [
        (model.ffn_size, h),
        (model.ffn_size, h),
        (h, model.ffn_size),
    ]


def _dequantized(model: ModelSpec, tokens: int, arch: CudaArch) -> list[tuple[int, int]]:
    """The linears of a whole forward whose ``gemm_4bit`` the rule sends to the fallback."""
    layer = [(n, k) for n, k in _linears(model) if gemm_4bit_kernel(tokens, n, k, 2, arch) == DEQUANTIZE]
    return layer * model.num_layers


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "l40s", "b200"])
def test_the_bundled_trainers_run_dequantizes_in_the_forward_where_the_rule_says(gpu):
    """``timeline/quant.py``: each forward's fallback weight (``_dequant_linear_fallback``'s ``B_dq``, in
    bf16) for the linears the rule sends there, none for the fused ones (``_gemm_4bit_kernel_impl``: the
    output alone); the backward dequantizes every weight whatever the forward took."""
    from memplan.costmodel.timeline.quant import FALLBACK_WEIGHT
    from memplan.costmodel.timeline.trainer import trainer_run

    arch, workload = _profiles()[gpu], TrainingWorkload(seq_len=16, micro_batch=1)
    run = trainer_run(MID, workload, Plan(**QLORA), gpu_arch=arch)
    assert run is not None
    got = sorted(e.size for e in run if e.op == ALLOC and e.tag.endswith(f".{FALLBACK_WEIGHT}"))
    assert got == sorted(n * k * 2 for n, k in _dequantized(MID, 16, arch) * STEPS)
    if gpu == "h100-sxm":
        assert len(got) == STEPS * MID.num_layers * 3  # q, o and down
    if gpu == "a100-80gb":
        assert got == [MID.hidden_size * MID.ffn_size * 2] * STEPS * MID.num_layers  # down


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb", "l40s", "b200"])
def test_the_trainers_run_under_hf_dequantizes_in_the_forward_where_the_rule_says(gpu):
    """``timeline/hf_bnb.py`` on CUDA: the fallback's ``absmax_dq + absmax_offset`` (fp32, one per 64
    weights; forward only) for the linears the rule sends there; the fused kernel's output alone."""
    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    arch, workload, plan = _profiles()[gpu], TrainingWorkload(seq_len=16, micro_batch=1), Plan(**QLORA)
    assert hf_supported(MID, plan, workload, "hf") is not None  # the GPU decides here
    assert hf_supported(MID, plan, workload, "hf", arch) is None
    run = hf_plan_run(MID, workload, plan, arch)
    got = sorted(e.size for e in run if e.op == ALLOC and e.tag.endswith("_proj.absmax"))
    assert got == sorted(n * k // 64 * 4 for n, k in _dequantized(MID, 16, arch) * STEPS)


SMALL = ModelSpec(
    name="small-gqa", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_size=128, vocab_size=512
)
STEP_BYTES = 4  # AdamW's step: a host fp32 scalar per trained parameter (counted on CPU, not on the GPU)


def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does_at_a_token_count_the_gpu_decides():
    """24 tokens of bf16 QLoRA: on an H100 every SMALL linear runs the fused kernel (small weights at a
    quarter wave: ``M <= 32``). The run on CPU's kernels (``cuda=False``) against the bundled trainer on
    CPU, as tests/unit/test_timeline_quant_variants.py measures it (the dynamic map set apart, AdamW's
    host ``step`` scalars added: two adapters per linear), within ``timeline_peaks.CPU_BOUND``."""
    pytest.importorskip("bitsandbytes")
    from timeline_peaks import assert_peaks, measured_peaks, steady_peaks, trainer_record

    from memplan.costmodel.timeline.support import supported
    from memplan.costmodel.timeline.trainer import trainer_run

    arch, workload, plan = _profiles()["h100-sxm"], TrainingWorkload(seq_len=24, micro_batch=1), Plan(**QLORA)
    assert supported(SMALL, workload, plan) is not None and supported(SMALL, workload, plan, arch) is None
    assert {gemm_4bit_kernel(24, n, k, 2, arch) for n, k in _linears(SMALL)} == {FUSED}
    run = trainer_run(SMALL, workload, plan, cuda=False, gpu_arch=arch)
    assert run is not None
    step, passes = steady_peaks([e for e in run if not e.tag.endswith("dynamic_map")])
    host = STEP_BYTES * 2 * len(_linears(SMALL)) * SMALL.num_layers
    record = trainer_record(SMALL, workload, plan, math=True)
    assert_peaks("bf16 nf4 24 tokens", (step + host, passes + host), measured_peaks(record))


LLAMA3_8B_QLORA = ["llama3-8b", "--finetune", "qlora", "--precision", "bf16", "--micro-batch", "1", "--format", "json"]


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200"])
@pytest.mark.parametrize("runtime", ["memplan", "hf"])
def test_the_estimate_answers_8b_qlora_at_512_tokens_from_the_op_level_run(capsys, gpu, runtime):
    """``memplan estimate llama3-8b --finetune qlora --micro-batch 1 --seq-len 512``: 512 tokens is where
    every 8B linear's kernel is the GPU's choice (5 to 512 rows past the small-weight path); 1024 tokens
    dequantize on every GPU and were op-level already. With the profile's SMs and compute capability the
    bundled trainer's run and the Trainer's answer."""
    import json

    from memplan.cli.app import run

    code = run(["estimate", *LLAMA3_8B_QLORA, "--seq-len", "512", "--gpu", gpu, "--runtime", runtime])
    out, err = capsys.readouterr()
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["model"] == "op-level", memory.get("model_reason")
