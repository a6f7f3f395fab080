"""The search's fast form gives the full estimate's numbers, to the bit.

``evaluate`` reads ``memory.training_peak`` and ``time.step_speed`` (with the search's shared
``TimeMemo``) instead of building ``estimate_memory``'s and ``estimate_time``'s reports; here
every figure of an evaluation is compared with those reports over plans of dense, MoE, MLA and
per-layer-attention models, under several runtimes, devices and a calibration, in an order that
makes the memo serve most stages from plans evaluated before."""

from __future__ import annotations

import pytest

from memplan.costmodel import memory as M
from memplan.costmodel import overhead as O
from memplan.costmodel import time as T
from memplan.costmodel.fast_run import applies
from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.time import Efficiency, estimate_time
from memplan.search.evaluate import Context, Evaluation, evaluate
from memplan.search.space import Candidate, SpaceOptions, enumerate_space
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan, PlanFields
from memplan.specs.workload import TrainingWorkload

GiB = 2**30

CASES = [  # (model, GPUs, SpaceOptions fields): dense, MoE, MLA with dense layers, sliding and chunked attention
    ("llama3-70b", 64, {"seq_len": 8192, "global_batches": (512,), "precisions": ("bf16-mixed", "fp32")}),
    ("mixtral-8x7b", 16, {"seq_len": 4096, "global_batches": (64,), "precisions": ("bf16-mixed", "bf16")}),
    ("deepseek-v2-lite", 8, {"seq_len": 4096, "global_batches": (32,), "allow_offload": True}),
    ("gemma2-9b", 8, {"seq_len": 8192, "global_batches": (32,), "precisions": ("bf16-mixed", "bf16")}),
    ("llama4-scout", 16, {"seq_len": 8192, "global_batches": (64,)}),
    ("llama3-8b", 2, {"seq_len": 2048, "global_batches": (8,), "finetune": "qlora", "quants": ("nf4", "int8")}),
    # fp8 (torchao under memplan/hf, Transformer Engine under megatron) and paged optimizer states
    ("llama3-8b", 8, {"seq_len": 4096, "global_batches": (32,), "precisions": ("fp8", "bf16-master")}),
    ("llama3-8b", 1, {"seq_len": 2048, "global_batches": (8,), "optimizer": "paged-adamw-8bit", "allow_offload": True}),
]


@pytest.mark.parametrize(
    "name,gpus,fields",
    CASES,
    ids=[
        f"{c[0]}-{c[1]}-"
        + "-".join(map(str, c[2].get("precisions", "")))
        + c[2].get("finetune", "")
        + c[2].get("optimizer", "")
        for c in CASES
    ],
)
def test_fast_form_is_the_full_estimate(name, gpus, fields):
    model, gpu = load_model(name), load_gpu("h100-sxm")
    cluster = ClusterSpec(gpus_per_node=8, nodes=max(1, gpus // 8))
    candidates = list(enumerate_space(model, SpaceOptions(gpus=gpus, **fields)).candidates)
    candidates = candidates[:: max(1, len(candidates) // 60)]
    settings = [("memplan", "cuda", 1.0, None), ("megatron", "cuda", 1.0, None)]
    settings += [("hf", "cpu", 1.13, Efficiency.for_gpu(gpu, calibration=1.2))]
    checked = 0
    for runtime, device, ratio, eff in settings:
        ctx = Context(model, gpu, cluster, runtime=runtime, margin_bytes=4 * GiB, peak_ratio=ratio, efficiency=eff,
                      device=device)  # fmt: skip
        # twice, the second time backwards: the memo then serves every stage
        for c in [*candidates, *reversed(candidates)]:
            ev = evaluate(c, ctx)
            mem = estimate_memory(model, c.workload, c.plan, runtime, device)
            speed = estimate_time(model, c.workload, c.plan, gpu, cluster, runtime, ctx.time_efficiency)
            allocated, reserved, phase = mem.peak.allocated, mem.peak.reserved, mem.peak.phase
            if applies(model, c.plan, runtime, device):  # the run's peak (tests/search/test_fast_form_finetune.py)
                run = ctx.run_peaks[c]  # fast_run.run_peak's, once per plan
                if run is not None:
                    allocated, reserved, phase = run.allocated, O.fast_reserved_bytes(run.allocated), run.phase
            if ratio != 1.0:
                allocated = round(allocated * ratio)
                reserved = O.fast_reserved_bytes(allocated)
            got = (ev.peak_allocated_bytes, ev.peak_reserved_bytes, ev.peak_phase, ev.peak_rank, ev.overhead_bytes)
            assert got == (allocated, reserved, phase, mem.peak.rank, mem.overhead), c.plan
            assert ev.gradient_accumulation == mem.gradient_accumulation
            assert ev.fits == (reserved + mem.overhead <= gpu.capacity_bytes - 4 * GiB)
            assert ev.headroom_bytes == gpu.capacity_bytes - mem.overhead - reserved
            figures = (ev.step_time_s, ev.tokens_per_s, ev.tokens_per_s_per_gpu, ev.mfu)
            assert figures == (speed.step_time_s, speed.tokens_per_s, speed.tokens_per_s_per_gpu, speed.mfu), c.plan
            assert all(type(v) is float for v in figures)
            checked += 1
    assert checked == 6 * len(candidates) and len(candidates) >= 20


class _Recording:
    """A plan that notes which of its fields are read."""

    def __init__(self, plan: Plan):
        self._plan, self.read = plan, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._plan, name)


@pytest.mark.parametrize(
    "name,plan",
    [
        ("llama3-8b", dict(tp=2, cp=2, dp=2, recompute="selective-op", sequence_parallel=True)),
        ("llama3-8b", dict(tp=4, pp=2, pp_schedule="interleaved", virtual_stages=2, recompute="full",
                           recompute_layers=3, attention="eager", precision="fp32"))
        ,
        ("mixtral-8x7b", dict(dp=4, ep=4, zero=3, recompute="selective")),
        ("gemma2-9b", dict(dp=2, zero=2, precision="bf16")),
        ("llama3-8b", dict(finetune="qlora", quant="nf4", lora_rank=16, lora_targets=("all-linear",),
                           lora_dropout=0.1, recompute="full", precision="bf16", offload_params="cpu",
                           offload_optimizer="cpu", dp=2, zero=3)),
        ("llama3-8b", dict(finetune="qlora", quant="int8", lora_rank=8, lora_targets=("q_proj",),
                           modules_to_save=("lm_head",), recompute="selective-op")),
    ],
)  # fmt: skip
def test_stage_fields_are_what_a_stage_reads(name, plan):
    """The memo keys a stage's micro-batch by ``time.STAGE_FIELDS``: a field it read beyond
    those would let two plans that differ in it share a wrong entry."""
    model, gpu = load_model(name), load_gpu("h100-sxm")
    eff = Efficiency.for_gpu(gpu)
    real = Plan(**plan)
    link = T.group_link(gpu, ClusterSpec(gpus_per_node=8, nodes=1), 1, 2, eff)
    for stage in sorted({0, real.pp - 1}):
        for autocast, backend in ((False, "flash"), (True, "math"), (False, "eager")):
            recorder = _Recording(real)
            T._stage_micro_batch(model, recorder, stage, 4096, 4096.0, 2, 1e15, gpu, eff, link, link, link,
                                 False, True, backend, autocast)  # fmt: skip
            assert recorder.read <= set(T.STAGE_FIELDS), recorder.read - set(T.STAGE_FIELDS)
    recorder = _Recording(real)
    T._recompute_flops_per_token(model, recorder, 4096)
    assert recorder.read <= set(T.STAGE_FIELDS)
    for offload in ("none", "cpu"):
        recorder = _Recording(real.model_copy(update={"offload_optimizer": offload}))
        for torch_host in (False, True):
            T._optimizer(model, recorder, T.POLICIES[real.precision], 4, gpu, eff, offload == "none", torch_host)
            assert recorder.read <= set(T.OPTIMIZER_FIELDS), recorder.read


@pytest.mark.parametrize(
    "name,plan",
    [
        ("llama3-8b", dict(tp=2, cp=2, dp=2, zero=3, quant="none", attention="eager", precision="fp32")),
        ("gemma2-9b", dict(tp=2, dp=2, zero=1, sequence_parallel=True)),
        ("llama3-8b", dict(finetune="qlora", quant="nf4", precision="bf16", lora_targets=("q_proj", "v_proj"))),
        ("deepseek-v2-lite", dict(dp=2, pp=3, pp_schedule="interleaved", virtual_stages=3, zero=2, attention="triton")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("runtime", ["memplan", "hf", "megatron"])
def test_memory_memo_keys_are_what_is_read(name, plan, runtime, monkeypatch):
    """The memory memo keys the rank's shape by ``memory.SHAPE_FIELDS`` (and whether FSDP2
    runs, which is where ZeRO and dp come in), a stage's MoE share by the pipeline layout and
    the pipeline's buffers by the schedule: nothing else may be read."""
    model, real = load_model(name), Plan(**plan)
    rt = M.RUNTIMES[runtime]
    fsdp2 = M._fsdp2(rt, real)
    monkeypatch.setattr(M, "_fsdp2", lambda rt, plan: fsdp2)
    workload = TrainingWorkload(seq_len=4096, micro_batch=2, global_batch=16)
    for device in ("cuda", "cpu"):
        recorder = _Recording(real)
        x = M._shape(model, workload, recorder, M.POLICIES[real.precision], rt, device)
        assert recorder.read <= set(M.SHAPE_FIELDS), recorder.read - set(M.SHAPE_FIELDS)
    for stage in range(real.pp):
        recorder = _Recording(real)
        M._moe_fraction(model, M.stage_layout(model, real.tp, real.ep, real.pp, real.virtual_stages, stage), recorder)
        assert recorder.read <= set(M.LAYOUT_FIELDS), recorder.read
        recorder = _Recording(real)
        layout = M.stage_layout(model, real.tp, real.ep, real.pp, real.virtual_stages, stage)
        M.model_states(layout, recorder, M.POLICIES[real.precision], 0.1)
        assert recorder.read <= set(M.STATE_FIELDS), recorder.read
        recorder = _Recording(real)
        M.pipeline_buffers(x, recorder, stage, 8, 4)
        assert recorder.read <= {*M.PIPELINE_FIELDS, "stages"}, recorder.read  # stages: pp x virtual_stages
    recorder = _Recording(real)
    M._stages_to_examine(model, recorder, rt)
    assert recorder.read == {"pp"}, recorder.read  # the memo keys the stages examined by pp alone


def test_constructed_evaluation_is_pydantics():
    """``evaluate`` builds its result without pydantic's ``model_construct``: the same object,
    field for field, set fields, dumps, copies and validation included."""
    model, gpu = load_model("llama3-8b"), load_gpu("h100-sxm")
    ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=1), margin_bytes=4 * GiB)
    for c in list(enumerate_space(model, SpaceOptions(gpus=8, seq_len=4096)).candidates)[::97]:
        ev = evaluate(c, ctx)
        reference = Evaluation.model_construct(**dict(ev.__dict__))
        assert ev == reference and repr(ev) == repr(reference)
        assert ev.model_fields_set == reference.model_fields_set == set(Evaluation.model_fields)
        assert ev.model_dump_json() == reference.model_dump_json()
        assert Evaluation.model_validate(ev.model_dump()) == ev
        assert ev.model_copy(update={"fits": not ev.fits}).fits is not ev.fits
        assert ev.__pydantic_extra__ is None and ev.__pydantic_private__ is None


def test_plan_fields_read_as_the_plan():
    """``evaluate`` hands the cost model a :class:`PlanFields` (plain attributes) for its plan:
    every field and both properties read as on the plan, and the evaluation keeps the plan."""
    plan = Plan(dp=2, tp=2, pp=4, virtual_stages=2, pp_schedule="interleaved", zero=1, recompute="full")
    fields = PlanFields(plan)
    for name in [*Plan.model_fields, "world_size", "stages"]:
        assert getattr(fields, name) == getattr(plan, name), name
    assert fields.world_size == 16 and fields.stages == 8
    with pytest.raises(AttributeError):
        fields.not_a_field  # noqa: B018
    model, gpu = load_model("llama3-8b"), load_gpu("h100-sxm")
    ctx = Context(model, gpu, ClusterSpec(gpus_per_node=8, nodes=2))
    workload = TrainingWorkload(seq_len=2048, micro_batch=1, global_batch=64)
    assert evaluate(Candidate(plan, workload), ctx).plan is plan
