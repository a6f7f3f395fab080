"""A bitsandbytes 4-bit base under LoRA in the bundled trainer's op-level run (``timeline/quant.py``),
replayed against the H200 run h200_a_qlora8b (tests/data/gpu-traces/h200.json; the trace in
../shared/gpu-traces: llama3-8b, nf4 with double quantization, LoRA r16 all-linear, bf16 compute,
full recompute, 4096 x 4, default allocator)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.lora import ADAPTER_BYTES, trainable_params
from memplan.costmodel.quant import weight_4bit_bytes
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline.events import ALLOC, FREE, Category
from memplan.costmodel.timeline.quant import mean_staging
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.resolve import resolve_job

H200 = json.loads((Path(__file__).parents[1] / "data" / "gpu-traces" / "h200.json").read_text())["runs"]
RUN = H200["h200_a_qlora8b"]
PLAN = dict(
    dp=1,
    finetune="qlora",
    quant="nf4",
    lora_rank=16,
    lora_targets=("all-linear",),
    precision="bf16",
    recompute="full",
    seq_len=4096,
    micro_batch=4,
    global_batch=4,
)
ALLOCATED_TOLERANCE = 0.005  # issue 27's bound on the H200 traces
RESERVED_TOLERANCE = 0.01


def _job(**changes):
    return resolve_job("llama3-8b", None, dict(PLAN, **changes), inference=False)


@pytest.fixture(scope="module")
def timeline():
    job = _job()
    return trainer_run(job.model, job.workload, job.plan)


def test_the_plan_is_the_one_that_ran():
    args = RUN["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert args[0] == "llama3-8b" and flags["--finetune"] == "qlora" and flags["--quant"] == "nf4"
    assert flags["--allocator"] == "default" and flags["--runtime"] == "memplan"
    assert int(flags["--lora-rank"]) == PLAN["lora_rank"] and (flags["--lora-targets"],) == PLAN["lora_targets"]
    assert int(flags["--seq-len"]) == PLAN["seq_len"] and int(flags["--micro-batch"]) == PLAN["micro_batch"]
    assert flags["--precision"] == PLAN["precision"] and flags["--recompute"] == PLAN["recompute"]
    assert _job().plan.double_quant  # finetune: qlora defaults to double quantization, as the run had


def test_the_replayed_peaks_match_the_h200_run(timeline):
    result = replay(timeline, AllocatorConfig(expandable_segments=False))
    assert result.failure is None
    allocated, reserved = RUN["measured_allocated"], RUN["measured_reserved"]
    assert abs(result.max_allocated / allocated - 1) <= ALLOCATED_TOLERANCE, (result.max_allocated, allocated)
    assert abs(result.max_reserved / reserved - 1) <= RESERVED_TOLERANCE, (result.max_reserved, reserved)


def test_the_estimate_answers_qlora_with_the_op_level_run():
    job = _job()
    _, which = plan_run(job.model, job.workload, job.plan, "memplan")
    assert which == "trainer"


def _live(timeline, upto_mark: str) -> dict[str, int]:
    live: dict[str, int] = {}
    for e in timeline:
        if e.op == ALLOC:
            live[e.category] = live.get(e.category, 0) + e.size
        elif e.op == FREE:
            live[e.category] -= e.size
        elif e.tag == upto_mark:
            return live
    raise AssertionError(upto_mark)


def test_the_built_base_is_packed_linears_beside_an_fp32_rest(timeline):
    """After the build: each decoder linear's packed codes and double-quantized state
    (``costmodel.quant.weight_4bit_bytes``, measured on bitsandbytes' CPU storage) plus
    bitsandbytes' one shared 1 KiB dynamic map, the embedding, norms and head in fp32
    (``prepare_model_for_kbit_training``), the fp32 adapters; no bf16 weight left."""
    job = _job()
    m = job.model
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_size
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (h, f), (f, h)]
    linears = m.num_layers * sum(weight_4bit_bytes(o, i, True) for o, i in shapes)
    rest = (2 * m.vocab_size * h + (2 * m.num_layers + 1) * h) * 4
    adapters = trainable_params(m, ("all-linear",), 16, ()) * ADAPTER_BYTES
    assert _live(timeline, "build")[Category.PARAMETERS] == linears + 1024 + rest + adapters


def test_each_4bit_linear_dequantizes_its_weight_in_the_forward_and_the_backward(timeline):
    """``_dequant_linear_fallback`` in the forward and the recompute, ``dequantize_4bit`` in the
    backward: a bf16 weight-sized transient per linear, per pass (3 steps x 32 layers x 7)."""
    weights = [e for e in timeline if e.op == ALLOC and e.tag.endswith("weight_dq")]
    assert len(weights) == 3 * 3 * 32 * 7
    assert {e.size for e in weights} == {4096 * 4096 * 2, 1024 * 4096 * 2, 14336 * 4096 * 2}


@pytest.mark.parametrize(("values", "staging"), [(65_536, 0), (262_144, 128), (917_504, 448)])
def test_the_absmax_mean_stages_as_the_trace_shows(values, staging):
    """h200_a_qlora8b 1022-1026 and 1455-1464: ``absmax.mean()`` over wq's, wk's and w1's absmaxes."""
    assert mean_staging(values) == staging


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(micro_batch=1, seq_len=512, global_batch=1), "kernel the GPU picks"),
        (dict(quant="int8", double_quant=False, precision="bf16-mixed"), "LLM.int8"),
        (dict(precision="bf16-mixed"), "or under autocast"),
    ],
    ids=["few-tokens", "int8-autocast", "autocast"],
)
def test_quantized_plans_it_cannot_follow_get_none(changes, reason):
    job = _job(**changes)
    assert reason in supported(job.model, job.workload, job.plan)
    assert trainer_run(job.model, job.workload, job.plan) is None
