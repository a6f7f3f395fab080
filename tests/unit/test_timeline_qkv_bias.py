"""Qwen2-style q, k, v biases in the op-level run (``costmodel/timeline/qkv_bias.py``): ``addmm`` in
the forward, dX before dW and the bias's sum over tokens in the backward, the biases in every
state mechanism (DDP's buckets, ZeRO-1's partitions, FSDP2's groups, TP's column shards, AdamW's
states, bf16-master's masters, LoRA over a biased base, pipeline chunks), with activation offload,
eager attention and a tied embedding.

No GPU ran a biased plan (tests/data/gpu-traces holds none; no device was lent to this work): each
case is held against the bundled trainer itself, run on CPU under rank simulation and measured the
way tests/validate measures it, as tests/unit/test_timeline_zero1.py does, what only CUDA allocates
left out (cuBLAS's workspaces, the CUDA kernels' scratch: ``test_timeline_zero1.CUDA_ONLY``, the
bias sum's staging buffer and semaphores among them, modelled from ``Reduce.cuh``). In fp32 the
trainer runs under SDPA's math backend, the kernel CUDA takes for fp32 with GQA. Measured
2026-11-27 (torch 2.13.0+cpu): every case below within 224 B of the trainer's peak, for the step
and for the forward and backward alone (at most 0.001%; as in the other CPU comparisons, those few
bytes are not traced to a tensor)."""

from __future__ import annotations

import pytest
from test_timeline_zero1 import CUDA_ONLY, TINY
from timeline_peaks import measured_peaks, steady_peaks, trainer_record

from memplan.costmodel.reserve import plan_run
from memplan.costmodel.timeline.autograd import REDUCE_WORKSPACE_CAP
from memplan.costmodel.timeline.events import ALLOC, Category
from memplan.costmodel.timeline.qkv_bias import column_sum_staging
from memplan.costmodel.timeline.trainer import dims, followed_rank, supported, trainer_run
from memplan.costmodel.timeline.trainer_model import param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

CPU_BOUND = 0.0001  # 0.01% of the trainer's peak, as test_timeline_recompute.py
QWEN = TINY.model_copy(update=dict(name="tiny-qwen2", qkv_bias=True))
TIED_QWEN = QWEN.model_copy(update=dict(name="tiny-qwen2-tied", tied_embeddings=True))
LORA = dict(finetune="lora", lora_rank=8, lora_targets=("all-linear",))
TP2 = dict(tp=2, sequence_parallel=True, dp=2)
V2 = dict(pp=2, pp_schedule="interleaved", virtual_stages=2)

# name: (plan, (micro_batch, global_batch), pipeline rank); the tiny biased model, sequences of 128 tokens
CPU_CASES = {
    "bf16-mixed-selective-op-accum2": (dict(precision="bf16-mixed", recompute="selective-op"), (1, 2), 0),
    "zero3-dp2-bf16-mixed": (dict(precision="bf16-mixed", dp=2, zero=3), (1, None), 0),
    "lora-ddp-dp2-bf16": (dict(LORA, precision="bf16", dp=2), (1, None), 0),
    "bf16": (dict(precision="bf16"), (1, None), 0),
    "fp32": (dict(precision="fp32"), (1, None), 0),
    "bf16-master-full": (dict(precision="bf16-master", recompute="full"), (1, None), 0),
    "bf16-selective": (dict(precision="bf16", recompute="selective"), (2, None), 0),
    "ddp-dp2-bf16-mixed-accum2": (dict(precision="bf16-mixed", dp=2), (1, 4), 0),
    "zero1-dp2-bf16": (dict(precision="bf16", dp=2, zero=1), (1, None), 0),
    "zero2-dp2-fp32-full": (dict(precision="fp32", dp=2, zero=2, recompute="full"), (1, None), 0),
    "tp2-sp-dp2-zero3-bf16-mixed": (dict(TP2, precision="bf16-mixed", zero=3), (1, None), 0),
    "tp2-sp-bf16-selective-op": (dict(TP2, dp=1, precision="bf16", recompute="selective-op"), (1, None), 0),
    "1f1b-pp2-last-zero3-dp2-bf16": (dict(precision="bf16", pp=2, dp=2, zero=3), (1, 8), 1),
    "1f1b-pp2-first-fp32": (dict(precision="fp32", pp=2), (1, 4), 0),
    "lora-bf16-mixed-dropout-full": (
        dict(LORA, precision="bf16-mixed", lora_dropout=0.1, recompute="full"), (1, None), 0
    ),
    "act-offload-bf16": (dict(precision="bf16", offload_activations="cpu"), (1, None), 0),
    "eager-bf16": (dict(precision="bf16", attention="eager"), (1, None), 0),
    "eager-fp32-selective": (dict(precision="fp32", attention="eager", recompute="selective"), (1, None), 0),
    "interleaved-pp2-v2-first-zero2-dp2-bf16-mixed": (dict(V2, precision="bf16-mixed", dp=2, zero=2), (1, 8), 0),
    "gpipe-pp2-last-tp2-sp-zero3-dp2-bf16-mixed": (
        dict(TP2, pp=2, pp_schedule="gpipe", precision="bf16-mixed", zero=3), (1, 8), 1
    ),
    "tp2-no-sp-zero3-dp2-bf16": (dict(TP2, sequence_parallel=False, zero=3, precision="bf16"), (1, None), 0),
    "zero1-dp3-bf16-master-selective-op-accum2": (
        dict(precision="bf16-master", dp=3, zero=1, recompute="selective-op"), (1, 6), 0
    ),
    "lora-zero1-dp2-bf16": (dict(LORA, precision="bf16", dp=2, zero=1), (1, None), 0),
    "tied-zero3-dp2-bf16-mixed": (dict(precision="bf16-mixed", dp=2, zero=3), (1, None), 0),
    "lora-q-v-bf16-master-lm-head-copy": (
        dict(LORA, precision="bf16-master", lora_targets=("q_proj", "v_proj"), modules_to_save=("lm_head",)),
        (1, None), 0,
    ),
}  # fmt: skip
# in the default run: one rank, FSDP2's groups, LoRA over the biased base under DDP; the others under
# -m slow (the default suite's time)
DEFAULT = {"bf16", "zero3-dp2-bf16-mixed", "lora-ddp-dp2-bf16"}


def _model(name: str) -> ModelSpec:
    return TIED_QWEN if name.startswith("tied") else QWEN


def _run_peaks(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> tuple[int, int]:
    """The steady peaks of the run the estimate replays (CPU's dropout kernel), what only CUDA
    allocates left out."""
    run = trainer_run(model, workload, plan, stage=stage if plan.pp > 1 else None, cuda=False)
    assert run is not None
    return steady_peaks([e for e in run if e.tag.rsplit(".", 1)[-1] not in CUDA_ONLY])


def _measure(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> tuple[int, int]:
    """The bundled trainer on CPU, on the rank the run follows: the steady peak, and the forward's
    and backward's."""
    pytest.importorskip("torch")
    rank = followed_rank(model, workload, plan, stage)
    return measured_peaks(trainer_record(model, workload, plan, rank, math=plan.precision == "fp32"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in CPU_CASES])
def test_the_bundled_trainer_on_cpu_peaks_where_the_run_does(name):
    changes, (micro_batch, global_batch), stage = CPU_CASES[name]
    plan = Plan(**changes)
    workload = TrainingWorkload(seq_len=128, micro_batch=micro_batch, global_batch=global_batch)
    model = _model(name)
    assert supported(model, workload, plan) is None  # the estimate follows it op by op
    predicted, measured = _run_peaks(model, workload, plan, stage), _measure(model, workload, plan, stage)
    for what, p, got in zip(("step", "forward and backward"), predicted, measured, strict=True):
        assert abs(p / got - 1) <= CPU_BOUND, f"{name} {what}: predicted {p:,}, measured {got:,}"


def test_each_bias_follows_its_weight_sharded_as_its_rows():
    """``model.parameters()``: wq.weight, wq.bias, wk.weight, wk.bias, wv.weight, wv.bias, wo.weight;
    under TP a bias is split as its column-parallel weight's rows."""
    workload = TrainingWorkload(seq_len=128, micro_batch=1)
    for tp in (1, 2):
        shapes = param_shapes(dims(QWEN, workload, Plan(tp=tp, sequence_parallel=tp > 1)), False)
        names = [n.removeprefix("layers.0.") for n in shapes if n.startswith("layers.0.")]
        assert names[1:8] == [
            "attention.wq.weight", "attention.wq.bias", "attention.wk.weight", "attention.wk.bias",
            "attention.wv.weight", "attention.wv.bias", "attention.wo.weight",
        ]  # fmt: skip
        assert shapes["layers.0.attention.wq.bias"] == (QWEN.q_size // tp, 1)
        assert shapes["layers.0.attention.wk.bias"] == (QWEN.kv_size // tp, 1)


def test_the_bias_gradient_is_summed_after_dx_and_dw_with_cudas_staging():
    """AddmmBackward0 (torch 2.13, CPU dispatch log): dX, dW, then the engine's sum of the
    incoming gradient to the bias; on CUDA the sum's staging buffer and semaphores around it."""
    plan, workload = Plan(precision="bf16"), TrainingWorkload(seq_len=2048, micro_batch=1)
    run = trainer_run(QWEN, workload, plan, steady_steps=0)
    tags = [e.tag for e in run if e.op == ALLOC and e.tag.startswith("layers.0.attention.wq")]
    backward = tags[tags.index("layers.0.attention.wq.dX") :]
    order = ("dX", "dW", "bias.grad", "reduce_workspace", "reduce_semaphores")
    assert backward[:5] == [f"layers.0.attention.wq.{t}" for t in order]
    sizes = {e.tag: e.size for e in run if e.op == ALLOC and e.tag.startswith("layers.0.attention.wq.")}
    assert sizes["layers.0.attention.wq.bias.grad"] == QWEN.q_size * 2
    staging, semaphores = column_sum_staging(workload.seq_len, QWEN.q_size)
    got = sizes["layers.0.attention.wq.reduce_workspace"], sizes["layers.0.attention.wq.reduce_semaphores"]
    assert got == (staging, semaphores)
    grads = [e for e in run if e.op == ALLOC and e.tag == "layers.0.attention.wq.bias.grad"]
    assert grads[0].category == Category.GRADIENTS


def _torch_backward_products(bias: bool) -> list[tuple[int, ...]]:
    """The shapes of what torch's backward of ``nn.Linear(16, 8)`` over a (2, 5, 16) input computes,
    in order (a dispatch log on CPU): the products and the sum to the bias."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("mm", "sum"):
                shapes.append(tuple(out.shape))
            return out

    linear = torch.nn.Linear(16, 8, bias=bias).to(torch.bfloat16)
    y = linear(torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True))
    with Log():
        y.backward(torch.ones_like(y))
    return shapes


def test_torch_computes_dx_then_dw_then_the_bias_sum_as_the_run_does():
    """The order the run's ``addmm`` follows (dX, dW, the bias's sum), read off torch itself; and
    ``mm``'s, dW first (``ops.linear``), for contrast."""
    assert _torch_backward_products(bias=True) == [(10, 16), (8, 16), (1, 8)]
    assert _torch_backward_products(bias=False) == [(8, 16), (10, 16)]


def test_the_column_sums_staging_is_the_norm_weights_on_the_traces_shapes():
    """``Reduce.cuh`` from source, against what the traces measured for a norm weight's gradient
    (``Tape._validate``: 8 B an element up to ``REDUCE_WORKSPACE_CAP``): 2,048 to 8,192 columns over
    8,192 to 32,768 rows; fewer than 1,024 rows need no staging (each thread keeps under 256 values)."""
    for rows in (8192, 16384, 32768):
        for cols in (2048, 4096, 8192):
            staging, semaphores = column_sum_staging(rows, cols)
            assert staging == min(rows * cols * 8, REDUCE_WORKSPACE_CAP), (rows, cols)
            assert semaphores == cols // 32
    assert column_sum_staging(1000, 4096) == (0, 0)
    assert column_sum_staging(8192, 3584)[0] == 4 * 3584 * 76 * 32 * 4  # qwen2.5-7b: 28 blocks wide, 76 deep


def test_the_estimate_answers_qwen2_plans_with_the_op_level_run():
    """Qwen2.5 plans (q, k, v biases) no longer fall back to the phase model; output or MLP
    biases and QK-norm still do; a quantized biased base is followed too (test_timeline_quant_compose.py)."""
    for changes in (
        dict(precision="bf16-mixed", recompute="full"),
        dict(dp=8, zero=3, precision="bf16-mixed", recompute="selective-op"),
        dict(dp=4, tp=2, sequence_parallel=True, zero=3, precision="bf16"),
        dict(finetune="lora", lora_rank=16, lora_targets=("all-linear",), precision="bf16"),
    ):
        job = resolve_job("qwen2.5-7b", None, dict(seq_len=4096, micro_batch=1, **changes), False)
        assert job.model.qkv_bias
        assert supported(job.model, job.workload, job.plan) is None, changes
        _, which = plan_run(job.model, job.workload, job.plan, "memplan")
        assert which == "trainer", which
    workload = TrainingWorkload(seq_len=2048, micro_batch=1)
    for field in ("attn_out_bias", "mlp_bias", "qk_norm"):
        assert supported(QWEN.model_copy(update={field: True}), workload, Plan()) is not None, field
    qlora = Plan(finetune="lora", lora_targets=("all-linear",), quant="nf4", double_quant=True)
    assert supported(QWEN, TrainingWorkload(seq_len=4096, micro_batch=1), qlora) is None  # quant_compose.py


def test_an_unbiased_model_runs_as_before():
    """Without biases the run's allocations are those of ``mm`` (no bias parameter, no sum)."""
    run = trainer_run(TINY, TrainingWorkload(seq_len=128, micro_batch=1), Plan(precision="bf16"), steady_steps=0)
    assert not [e for e in run if e.op == ALLOC and ("bias" in e.tag)]
