"""The search's fast form for fine-tuning and fp32 plans, and for every plan of transformers' loops,
taken from the op-level run.

For a plan the op-level run models (the bundled trainer's ``timeline.trainer`` or transformers'
Trainer ``timeline.hf_trainer``) on one rank, over a dense
model whose layers are all alike: the run of the model cut to two depths (``cut_depths``: 4 and
6 layers, or 5 and 7), each replayed through the allocator model and cut into spans
(``span_peaks``) that mean the same at every depth: between the run's marks (the build, each
step, the meter's phases), and within those by the layer the allocations belong to (the first,
the second, the next to last, the last, or none). Each span's peak allocated is an affine
function of the depth: every layer adds the same parameters, adapters, quantization state,
saved activations and gradients, and the moment a span peaks at has the same tensors around it
at every depth. So a span's peak at the model's depth ``L`` is ``a + (b - a) (L - d) / 2`` from
its peaks ``a`` and ``b`` at depths ``d`` and ``d + 2``, and the step's peak is the highest span's.

Why spans and not the run's single peak: the moment that peaks moves with the depth. The QLoRA
build (a 16-bit base quantized on the device) peaks while the embedding and the head are cast
at 4 layers, after the last layer's quantization at 32 (16-bit and 4-bit copies of every layer).
Why the layer positions: within a span of layers, a layer's peak is affine in its index, so the
layers between the second and the next to last never peak above both. Why two depths apart: on
a small model the adapters' blocks, served unsplit from cached segments, repeat every other
layer (the increments alternate 336,368,640 and 334,271,488 B on an 8-layer, 1,024-wide Llama
with LoRA on every linear layer); the two depths share the model's parity.

Under ZeRO-1 the most-loaded rank's optimizer share is not affine in the depth (whole
parameters dealt largest first to the least-loaded rank): both cut runs step the whole model's share
instead, renamed into the cut model (``_zero1_shard``, ``_cut_shard``).

A quantized base loaded by ``from_pretrained`` (``_loads_quantized``) is the exception: its load leaves
holes whose rests are not affine in the depth, so the whole run answers it; so is one the bundled trainer
builds on the device (``_builds_quantized``: the holes of the 16-bit embedding and head it casts to fp32, the
8-bit weights' unsplit blocks).

Under FSDP2 a collective buffer's layer is not the one its tag names: the all-gather of the next
group is issued at the end of a layer's forward, and the backward prefetches the previous layer's
inside its own, so those buffers belong to the span they fall in (``_owner``, ``_fsdp2``).

A pipelined fp32 plan (``_pipeline_peak``) is cut chunk by chunk: every chunk of the followed rank
cut to the two depths, the schedule, micro-batches and the rank the same, the layer positions taken
within a chunk.

Measured against the whole run: equal to the byte on every plan of
tests/search/test_fast_form_finetune.py, within 0.02% on tests/search/test_fast_form_fsdp.py's
(docs/cost-model.md, "The search's fast form against the run"). Full training under transformers'
loops (``_hf_full``): within 0.1% of the whole run on tests/search/test_fast_form_hf.py's grid, FSDP2's
plans (the whole run, ``_whole_hf``) to the byte. A search computes each plan's once
(``search.evaluate.Context.run_peaks``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.quant import CudaArch, cuda_arch
from memplan.costmodel.timeline.events import ALLOC, MARK, Category, Timeline, collection_paused
from memplan.costmodel.timeline.phases import PHASE_MARKS
from memplan.specs.model import ModelSpec
from memplan.specs.plan import TRANSFORMERS_RUNTIMES, Plan
from memplan.specs.workload import TrainingWorkload

if TYPE_CHECKING:
    from memplan.specs.hardware import GPUSpec

SHALLOWEST = 4  # the first two and the last two layers, and none between
STEP = 2  # the two depths' difference: the allocator's blocks repeat every other layer (below)


class RunPeak(NamedTuple):
    """The allocated peak the op-level run reaches (``max_memory_allocated``), and in which span."""

    allocated: int
    phase: str  # "setup" (the build), "forward", "backward" or "optimizer"


def applies(model: ModelSpec, plan: Plan, runtime: str, device: str) -> bool:
    """Whether this fast form answers the plan: the fine-tuning (LoRA, QLoRA) and fp32 plans on
    CUDA of one pipeline stage, or the fp32 pipelines (``_pipelined``), without tensor parallelism,
    on one data-parallel rank or, under the bundled trainer, over DDP (ZeRO-0), ZeRO-1 or FSDP2
    (``_over_ranks``), over a model whose layers repeat (no MoE, latent attention, per-layer
    attention kinds or RoPE pattern, multi-token prediction; one window on every layer, Mistral's or
    Phi-3's, repeats: :func:`_repeats`), with every layer treated alike (no ``recompute_layers``), for the
    runtimes the run models. Full training under transformers' loops in every precision (``_hf_full``: cut
    runs, or the whole run where they do not extrapolate, ``_whole_hf``); under the bundled trainer the plans
    of full bf16 training stay on the phase model's sums (the 768-plan grid's cost; how far they are from the
    run: docs/cost-model.md). LoRA over an MoE model under ``hf`` or ``hf-loop``: the whole run
    (``_moe_lora_peak``), on either device."""
    if _moe_lora(model, plan):
        return runtime in ("hf", "hf-loop")
    if device == "cuda" and runtime in TRANSFORMERS_RUNTIMES and plan.finetune == "full":
        return _hf_full(plan, runtime)

    if device != "cuda" or runtime not in ("memplan", "hf"):  # hf-loop: 48 of 50 exact (docs/cost-model.md)
        return False
    if plan.finetune == "full" and plan.precision != "fp32":
        return False
    if plan.tp * plan.cp * plan.ep > 1 or plan.recompute_layers is not None:
        return False
    if plan.dp > 1 and not _over_ranks(plan, runtime):
        return False
    # one attention kind on every layer (Mistral's and Phi-3's windows): the layers still repeat
    repeats = _repeats(model)
    if plan.pp > 1:
        return repeats and model.num_mtp_layers == 0 and _pipelined(plan, runtime)
    return repeats and model.num_mtp_layers == 0 and model.num_layers >= SHALLOWEST + 2 * STEP - 1


def _repeats(model: ModelSpec) -> bool:
    """Whether the model's decoder layers are alike, so that runs cut to two depths extrapolate: no experts,
    latent attention or per-layer RoPE, and one attention kind on every layer (a window on every layer,
    Mistral's or Phi-3's, repeats; Gemma's alternating kinds do not)."""
    return not (model.moe or model.mla or model.rope_pattern or len(set(model.attention_pattern)) > 1)


def _hf_full(plan: Plan, runtime: str) -> bool:
    """Full training under transformers' Trainer (``hf``) or the hand-written loop (``hf-loop``), in every
    precision, as ``reserve.plan_run`` runs it: one rank, or under ``hf`` DDP (ZeRO-0, ``hf_ddp.py``) or
    accelerate's FSDP2 (ZeRO-2/3, ``hf_fsdp.py`` with either build, ``hf_fsdp_load.py``); no tensor, pipeline,
    context or expert parallelism, no ZeRO-1 (``hf_support``: not modelled). Where the phase model's sums
    missed the run by -74% .. +45% on llama3-8b under FSDP2: the build (under ``bf16=True`` accelerate
    upcasts every trained parameter to fp32 on the GPU and holds it beside the fp32 shards while it shards,
    33.65 GiB at 1,024 tokens where the sums' step peaks at 8.74), the fp32 master shards and states the
    policy keeps where the sums count a bf16 model's, and under ``bf16-mixed`` autocast's weight copies and
    fp32 activations the sums add where FSDP2's policy casts at the all-gather (13.98 and 3.8 GiB at 4,096
    tokens); on one rank by up to -9% on the 1B config (its tied embedding's gradient and their sum beside
    the head's; docs/cost-model.md, "The search's fast form under ``--runtime hf`` and ``hf-loop``").
    FSDP2 and the models whose layers do not repeat take the whole run (``_whole_hf``); the rest the cut runs."""
    if plan.tp * plan.pp * plan.cp * plan.ep > 1 or plan.recompute_layers is not None or plan.zero == 1:
        return False
    return plan.dp == 1 or runtime == "hf"


def _whole_hf(model: ModelSpec, plan: Plan, runtime: str) -> bool:
    """The full-training plans of ``_hf_full`` the whole run answers: accelerate's FSDP2, whose build leaves
    the model's full copies freed (``from_pretrained`` onto the GPU before ``fully_shard``, or each full
    parameter in turn under ``cpu_ram_efficient_loading``) and the shards, gradients and optimizer states
    carved from those holes, so which blocks are served whole (their rest under 1 MiB, ``should_split``) is
    not affine in the depth (the 1B config's per-two-layer increments at 4..10 layers: 175.02, 178.01 and
    174.02 MiB, bf16 ZeRO-3, full recompute; the cut runs missed by up to +0.29%); and models whose layers
    do not repeat (MoE, latent attention, attention or RoPE patterns, multi-token prediction) or are too
    shallow to cut."""
    if runtime == "hf" and plan.dp > 1 and plan.zero >= 2:
        return True
    repeats = _repeats(model)
    return not repeats or model.num_mtp_layers > 0 or model.num_layers < SHALLOWEST + 2 * STEP - 1


def _pipelined(plan: Plan, runtime: str) -> bool:
    """The pipelined plans the cut runs answer (``_pipeline_peak``): fp32 full training under the
    bundled trainer (the only runtime that pipelines; it runs no LoRA under a pipeline:
    ``timeline.support``), on one data rank or FSDP2 over each chunk. Where the phase model's sums
    missed the run by -8.77% (pp 2, 1F1B, 4,096 tokens, 8 micro-batches on the 1B Llama of the H200
    traces): CUDA's math SDPA backward (fp32: four ``s x s`` tensors per head) beside the
    schedule's in-flight micro-batches; bf16 pipelines stay on the sums (within 0.02%)."""
    return runtime == "memplan" and plan.finetune == "full" and plan.precision == "fp32"


def _over_ranks(plan: Plan, runtime: str) -> bool:
    """The plans over several data ranks the cut runs answer: the bundled trainer's DDP (ZeRO-0)
    and ZeRO-1, whose gradient buckets add the same per layer (ZeRO-1's optimizer share is the whole
    model's in both cut runs: ``_zero1_shard``), where the
    phase model's sums miss the run by up to -19% (fp32, ZeRO-1, full recompute, 4,096 tokens) and
    -67% (QLoRA under DDP: docs/cost-model.md, "The search's fast form against the run"); and
    FSDP2 (``_fsdp2``)."""
    return runtime == "memplan" and (plan.zero <= 1 or _fsdp2(plan))


def _fsdp2(plan: Plan) -> bool:
    """FSDP2's ZeRO-3 and ZeRO-2 (``timeline/fsdp.py``), with its CPU offload or without: each layer
    group adds the same shards, all-gather and reduce-scatter buffers and sharded gradients, and
    its collective buffers belong to the span they are allocated in (``_owner``), so the spans line
    up. Where the phase model's sums missed the run by -26.5% (fp32, ZeRO-3, full recompute, 4,096
    tokens: SDPA's math backward beside FSDP2's buffers) and -35.1% with CPU offload; the fast form
    is within 0.02% of the run on tests/search/test_fast_form_fsdp.py's grid, equal to the byte on
    most of it: the rest is the allocator's unsplit blocks (an optimizer state served whole from a
    cached segment with under 1 MiB to spare, ``CUDACachingAllocator.cpp`` ``should_split``), which
    come with the depth unevenly (docs/cost-model.md). Full training only: the trainer refuses LoRA
    under FSDP2 (``timeline.support``), so such a plan is not counted as run (``tune._run_plans``)."""
    return plan.zero >= 2 and plan.finetune == "full"


def run_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str, gpu: GPUSpec | None = None
) -> RunPeak | None:
    """The op-level run's allocated peak for ``applies`` plans, from the runs cut to ``cut_depths`` layers
    (the whole run over a quantized base: ``_loads_quantized``, ``_builds_quantized``); None where the run
    does not model the plan (``reserve.plan_run`` falls back to the phases) or the cut runs' spans do not
    line up. ``gpu``: its SMs and compute capability pick a 4-bit
    base's kernel (``quant.cuda_arch``)."""
    if _moe_lora(model, plan):
        return _moe_lora_peak(model, workload, plan, device, gpu, runtime)
    if not _modelled(model, workload, plan, runtime, cuda_arch(gpu)):
        return None
    if plan.pp > 1:
        return _pipeline_peak(model, workload, plan, device, gpu)
    if _loads_quantized(plan, runtime) or _builds_quantized(plan, runtime):
        return _whole_run_peak(model, workload, plan, runtime, device, gpu)
    if plan.finetune == "full" and runtime in TRANSFORMERS_RUNTIMES and _whole_hf(model, plan, runtime):
        return _whole_hf_peak(model, workload, plan, runtime, device, gpu)
    depths, shard = cut_depths(model.num_layers), _zero1_shard(model, workload, plan, runtime)
    cut = [
        _span_peaks(
            model.model_copy(update={"num_layers": n}),
            workload,
            plan,
            runtime,
            device,
            gpu,
            None if shard is None else _cut_shard(shard, model.num_layers, n),
        )
        for n in depths
    ]
    return _extrapolated(cut, (model.num_layers - depths[0]) // STEP)


def _extrapolated(cut: list[list[tuple[str, int]] | None], steps: int) -> RunPeak | None:
    """The highest span's peak ``steps`` times ``STEP`` layers deeper than the shallower cut run's,
    each span's taken affine in the depth from the two cut runs' (None where they do not line up)."""
    if cut[0] is None or cut[1] is None or [p for p, _ in cut[0]] != [p for p, _ in cut[1]]:
        return None
    spans = [(a + (b - a) * steps, label) for (label, a), (_, b) in zip(*cut, strict=True)]
    allocated, label = max(spans, key=lambda s: s[0])  # the first of equals: the step's order
    return RunPeak(allocated, _phase(label))


def _moe_lora(model: ModelSpec, plan: Plan) -> bool:
    """LoRA over an MoE model, or over Phi-3, OLMo 2, Gemma 2 or 3 (``reserve.run_only``): no phase-model sum
    screens it, its LoRA layer counting a dense Llama MLP of ``ffn_size`` where the experts are (or Llama's
    layer where the family's norms and projections are)."""
    from memplan.costmodel.reserve import run_only

    return run_only(model, plan)


def _moe_lora_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str, gpu: GPUSpec | None, runtime: str = "hf"
) -> RunPeak:
    """The whole run of transformers' Trainer or the hand-written loop (``runtime``; ``reserve.plan_run``, which raises
    rather than fall back to the phases where the run does not follow the plan: a GPU below compute capability 8.0),
    as ``estimate`` reports it: on CUDA replayed through the caching allocator model, on CPU its live bytes
    (``cpu_reserve.cpu_replay``: no caching allocator); in the phase of its highest span."""
    from memplan.costmodel.cpu_reserve import cpu_replay
    from memplan.costmodel.reserve import plan_run, replay

    run, _ = plan_run(model, workload, plan, runtime, device, gpu)
    label = max(span_peaks(run, model.num_layers), key=lambda s: s[1])[0]
    peak = replay(run, AllocatorConfig()) if device == "cuda" else cpu_replay(run)
    return RunPeak(peak.max_allocated, _phase(label))


def _pipeline_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str, gpu: GPUSpec | None
) -> RunPeak | None:
    """A pipeline rank's peak (``_pipelined``) from the runs with every chunk cut to ``cut_depths``
    of its ``L / (p v)`` layers: the phase model's most-loaded rank (``trainer.phase_stage``, asked
    of the whole model: the estimate's pick, ``stages.stage_verdict``, would cost a full run per stage,
    where this form costs two cut runs) at both depths, with the same schedule, micro-batches, chunks and stage
    role (first, middle, last), so the runs take the same actions (``schedule.schedule_actions``)
    and their spans, keyed by the chunk-local layer positions (``c{chunk}.layers.{j}``: ``_position``
    over one chunk's layers) in the actions' order, line up. Each forward and backward adds one
    chunk's layers' activations, gradients and the in-flight micro-batches' saves per layer; the
    receive buffers, the sends and the head are the same at every depth: each span's peak is affine in
    the chunk's depth. Chunks of under ``SHALLOWEST + STEP`` layers are run whole (no deeper than the cut)."""
    from memplan.costmodel.timeline.trainer import phase_stage, trainer_run

    chunks, arch = plan.stages, cuda_arch(gpu)
    per, stage = model.num_layers // chunks, phase_stage(model, workload, plan)
    if per < SHALLOWEST + STEP:
        return _whole_run_peak(model, workload, plan, "memplan", device, gpu)

    def spans(depth: int) -> list[tuple[str, int]] | None:
        cut = model.model_copy(update={"num_layers": depth * chunks})
        with collection_paused():
            run = trainer_run(cut, workload, plan, stage=stage, gpu_arch=arch)
        return None if run is None else span_peaks(run, depth)

    depths = cut_depths(per)
    return _extrapolated([spans(n) for n in depths], (per - depths[0]) // STEP)


def _loads_quantized(plan: Plan, runtime: str) -> bool:
    """A quantized base loaded by transformers' ``from_pretrained`` (``timeline/hf_build.py``): its 16-bit
    weights arrive in the warmup segment and leave holes the quantized ones are carved from, so where a
    block is served whole (its rest under 1 MiB) depends on the depth, not affinely (Llama 3 8B cut to 5,
    7 and 9 layers, QLoRA over a bf16 load: 0.5, 0 and 1 MiB of such rests at the peak). The whole run
    answers these plans."""
    return runtime in ("hf", "hf-loop") and plan.quant != "none" and plan.model_build == "from_pretrained"


def _builds_quantized(plan: Plan, runtime: str) -> bool:
    """A quantized base the bundled trainer builds on the device (``timeline/quant.py``, ``timeline/int8.py``):
    where its blocks are served whole (a rest of at most 1 MiB left unsplit, ``CUDACachingAllocator.cpp``
    ``should_split``) is not affine in the depth, so the whole run answers these plans, as ``_loads_quantized``'s
    (docs/cost-model.md, "The search's fast form against the run", 2026-11-28). A 16-bit 4-bit base:
    ``prepare_model_for_kbit_training``'s cast frees the 16-bit embedding and head (1,002 MiB each on llama3-8b),
    holes of one size at every depth that each step's forward carves its first layers' blocks from until they are
    full; at 1,024 tokens the head's keeps 746 MiB at 4 layers and 490 at 6 when step 1's backward asks for the
    logits' fp32 gradient (525,336,576 B), carved from it at 4 and served whole from a new 502 MiB segment at 6:
    the spans are affine from 12 layers on, and the cut runs were 13 MiB over the run. An 8-bit base: each MLP
    weight's int8 copy (45,088,768 B on llama2-7b) is served whole from its own 44 MiB segment in most layers and
    carved from a hole in the others, not every other layer (3, 5, 6, 7 and 9 of them served whole at 4 to 12
    layers): the cut runs were 9 to 23 MiB over the run."""
    return runtime == "memplan" and plan.quant != "none"


def _whole_run_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str, gpu: GPUSpec | None
) -> RunPeak:
    """The whole run's allocated peak (a quantized base, ``_loads_quantized``, ``_builds_quantized``; a pipeline's
    chunks too short to cut), on ``gpu`` (its kernels, ``quant.cuda_arch``): one pass of the allocator
    (``reserve.replay``), the phase of the span its first peak allocation falls in (:func:`phase_at`), as
    ``_whole_hf_peak`` takes it (the highest span's outside the middle layers before 2026-11-29, walked with a
    second allocator: the same figures on the output guard's plans and a QLoRA tune, 48 s -> 39 s)."""
    from memplan.costmodel.reserve import plan_run, replay

    run, _ = plan_run(model, workload, plan, runtime, device, gpu)
    r = replay(run, AllocatorConfig())
    return RunPeak(r.max_allocated, phase_at(run, r.peak_event))


def _whole_hf_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str, gpu: GPUSpec | None
) -> RunPeak:
    """The whole run's allocated peak (``_whole_hf``'s plans), on ``gpu`` (its kernels): one pass of the
    allocator (``reserve.replay``: the run's ``max_allocated`` and the first allocation that reaches it,
    ``peak_event``), then the phase of the span that allocation falls in (:func:`phase_at`), read off the
    events before it without the allocator. The same figures as the highest of every span (``span_peaks``
    with ``middle``; the first of equals), which cost a third more of the allocator's pass (the spans' labels
    kept at every event): a whole llama3-70b run under FSDP2 (2,048 tokens, full recompute) is built in
    0.5 s and replayed in 0.2 s of CPU (docs/accuracy.md, "Speed"); tests/search/test_fast_form_hf_speed.py
    holds the two equal. Under ``hf`` the run's last step is emitted from the one before where that is exact
    (``timeline/hf_repeat.py``: one rank and FSDP2 with AdamW), a third of the build."""
    from memplan.costmodel.reserve import plan_run, replay
    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    arch = cuda_arch(gpu)
    if runtime == "hf" and device == "cuda" and hf_supported(model, plan, workload, runtime, arch, device) is None:
        with collection_paused():  # the last step emitted from the one before where exact (hf_repeat.py)
            run = hf_plan_run(model, workload, plan, arch, device, repeated=True)
    else:
        run, _ = plan_run(model, workload, plan, runtime, device, gpu)
    r = replay(run, AllocatorConfig())
    return RunPeak(r.max_allocated, phase_at(run, r.peak_event))


def whole_hf_run(model: ModelSpec, plan: Plan, runtime: str, device: str) -> bool:
    """Whether ``run_peak`` answers an ``applies`` plan with the whole run of transformers' Trainer
    (``_whole_hf_peak``; ``runtime`` ``hf`` on CUDA): the plans whose peak costs a whole op-level run, which
    :func:`run_peak_bound` bounds from below for a fraction of it."""
    return (
        runtime == "hf"
        and device == "cuda"
        and plan.finetune == "full"
        and plan.pp == 1
        and not _moe_lora(model, plan)
        and not _loads_quantized(plan, runtime)
        and _whole_hf(model, plan, runtime)
    )


def run_peak_bound(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str, gpu: GPUSpec | None = None
) -> int | None:
    """A lower bound on ``run_peak(...).allocated`` of a :func:`whole_hf_run` plan: the allocated peak of the
    Trainer's run up to the end of its first step (the build, the first forward and backward, the optimizer's
    states made at its first step), replayed through the same allocator. That run is the whole run's first
    events, event for event (``hf_plan_run`` with ``steps=1`` over the same data), and an allocator replay is
    causal, so its peak is the whole run's over those events, at most the whole run's: ~40% of the whole run's
    cost on llama3-70b under FSDP2. None where the run does not model the plan (``run_peak`` answers None)."""
    from memplan.costmodel.reserve import replay
    from memplan.costmodel.timeline.hf_support import hf_supported
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run

    arch = cuda_arch(gpu)
    if hf_supported(model, plan, workload, "hf", arch, device) is not None:
        return None
    with collection_paused():
        run = hf_plan_run(model, workload, plan, arch, device, steps=1)
    return replay(run, AllocatorConfig()).max_allocated


def phase_at(run: Timeline, index: int) -> str:
    """The phase (``_phase``) of the span (``span_peaks``) that holds the run's event ``index``: the
    label's mark is the last mark before it, its groups those the allocations since that mark opened,
    up to and including ``index`` (a new group opens a new span, so no later allocation of the same span
    adds one)."""
    events = run.raw
    start = index
    while start > 0 and events[start - 1][0] != MARK:
        start -= 1
    mark = events[start - 1][5] if start > 0 else "setup"
    opened = set()
    for op, _, _, category, _, tag in events[start : index + 1]:
        if op == ALLOC:
            group = "gradients" if tag.endswith("grad_seed") else _OPENS.get(category)
            if group is not None:
                opened.add(group)
    return _phase(f"{mark}||{'+'.join(sorted(opened))}")


def cut_depths(layers: int) -> tuple[int, int]:
    """The two depths the run is taken at for a ``layers``-deep model: ``STEP`` apart, the
    shallower at least ``SHALLOWEST``, both of the model's parity."""
    shallow = SHALLOWEST + (layers - SHALLOWEST) % STEP
    return shallow, shallow + STEP


def _phase(label: str) -> str:
    """The step's phase a span (``span_peaks``) lies in: ``setup`` before the run's first mark
    (the build), the meter's phase after its marks; in the runs without them, the optimizer's
    step from its first allocation, the backward where a gradient was made, else the forward."""
    mark, _, groups = label.split("|")
    if mark in PHASE_MARKS:
        return PHASE_MARKS[mark] or "optimizer"  # phase:end: zero_grad, after the step
    if mark == "setup":
        return "setup"
    return "optimizer" if "optimizer" in groups else "backward" if "gradients" in groups else "forward"


def _modelled(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, gpu_arch: CudaArch | None
) -> bool:
    """Whether ``reserve.plan_run`` takes the op-level run for the whole model (on CUDA)."""
    if runtime == "memplan":
        from memplan.costmodel.timeline.support import supported

        return supported(model, workload, plan, gpu_arch) is None
    from memplan.costmodel.timeline.hf_support import hf_supported

    return hf_supported(model, plan, workload, runtime, gpu_arch) is None


def _span_peaks(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    runtime: str,
    device: str,
    gpu: GPUSpec | None,
    zero1_shard: list[tuple[str, int]] | None = None,
) -> list[tuple[str, int]] | None:
    """Each span's peak allocated in the run of ``model`` (None where the phases answer), under
    ZeRO-1 with the rank's optimizer stepping ``zero1_shard`` where given (``_cut_shard``)."""
    from memplan.costmodel.reserve import plan_run

    if zero1_shard is not None:  # the bundled trainer on CUDA (applies, _over_ranks)
        from memplan.costmodel.timeline.trainer import trainer_run

        with collection_paused():
            run = trainer_run(model, workload, plan, gpu_arch=cuda_arch(gpu), zero1_shard=zero1_shard)
        return None if run is None else span_peaks(run, model.num_layers)
    run, which = plan_run(model, workload, plan, runtime, device, gpu)
    return None if which.startswith("phases") else span_peaks(run, model.num_layers)


def _zero1_shard(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str
) -> list[tuple[str, int]] | None:
    """Under the bundled trainer's ZeRO-1 (``timeline/zero1.py``), the (name, elements) the
    most-loaded rank's optimizer steps in the ``model``'s run, in its order; else None.
    ``ZeroRedundancyOptimizer._partition_parameters`` deals whole parameters, largest first, to the
    least-loaded rank, so the rank's share is not affine in the depth: on llama3-8b at dp 8 the
    32-layer model's most-loaded rank holds other layers' tensors, in another order, than the 4- and
    6-layer models' (whose spans do not line up). The cut runs carry the whole model's instead."""
    if runtime != "memplan" or plan.zero != 1 or plan.dp == 1:
        return None
    from memplan.costmodel.timeline import zero1
    from memplan.costmodel.timeline.trainer import optimized_params

    return zero1.shard(optimized_params(model, workload, plan), plan.dp)


def _cut_shard(shard: list[tuple[str, int]], layers: int, depth: int) -> list[tuple[str, int]]:
    """The ``layers``-deep model's ZeRO-1 share renamed into the model cut to ``depth`` layers, the
    same tensors in the same order: its first two layers' keep their index, its last two's their
    place from the end, those between become the second layer's (the cut run's span labels,
    ``_position``, then the same at both depths; a layer's tensors have the same shapes and dtypes
    at every index). Each cut run's optimizer then holds the whole model's states and temporaries:
    they are the same at both depths, and the other spans' terms affine in the depth."""

    def renamed(name: str) -> str:
        m = _LAYER.search(name)
        if m is None:
            return name
        i = int(m.group(1))
        j = i if i < 2 else depth - (layers - i) if i >= layers - 2 else 1
        return f"{name[: m.start(1)]}{j}{name[m.end(1) :]}"

    return [(renamed(name), n) for name, n in shard]


def span_peaks(run: Timeline, layers: int, middle: bool = False) -> list[tuple[str, int]]:
    """The run of a ``layers``-deep model replayed through the default caching allocator
    (``reserve.replay``'s loop; the allocated bytes are the blocks', as
    ``torch.cuda.max_memory_allocated`` counts them), cut into spans, each with its label and
    peak allocated; the spans of the layers between the second and the next to last are left out
    (``_position``). A span opens at each mark of the run (the build's end, each step's, the
    meter's phases), where the allocations pass from one layer to another or out of the layers, and
    at the backward's seed (``grad_seed``, the loss's ``torch.ones_like`` in ``backward()``) or
    first gradient and the first optimizer allocation after a mark (where the backward and the
    optimizer's step begin in the runs without phase marks: transformers' Trainer, the hand loop;
    the later spans of the step carry them in their label). An allocation outside the layers
    between two of the middle ones (the hand loop's) belongs to them. With ``middle``, those
    spans too: every span, whose highest peak is the run's ``max_allocated`` (``_whole_hf_peak``)."""
    from memplan.costmodel.reserve import STREAM_IDS

    with collection_paused():
        alloc = CachingAllocator(AllocatorConfig())
        blocks, spans, mark, where, opened = {}, [], "setup", "", set()
        for op, tensor, size, category, stream, tag in run.raw:
            if op == MARK:
                spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
                alloc.max_allocated, mark, where, opened = alloc.allocated, tag, "", set()
                continue
            if op != ALLOC:  # a free never raises the peak: it stays in the span it falls in
                alloc.free(blocks.pop(tensor))
                continue
            position = _owner(tag, layers, where)
            group = "gradients" if tag.endswith("grad_seed") else _OPENS.get(category)
            if position != where or (group is not None and group not in opened):
                spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
                if group is not None:
                    opened.add(group)
                alloc.max_allocated, where = alloc.allocated, position
            blocks[tensor] = alloc.malloc(size, STREAM_IDS[stream])
        spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
    return spans if middle else [(label, peak) for label, peak in spans if "|other|" not in label]


def _owner(tag: str, layers: int, where: str) -> str:
    """The position (``_position``) an allocation tagged ``tag`` belongs to while the span of ``where``
    is open. An allocation outside the layers between two of the middle ones is theirs (the hand
    loop's). FSDP2's collective buffers (``timeline/fsdp.py``'s ``fsdp.<group>.*``: the all-gather's
    input and output, the reduce-scatter's, the copy-in metadata) are the open span's, whichever
    group they serve: the all-gather of group ``i + 1`` is issued at the end of layer ``i``'s forward
    (``pre_forward``), the backward's prefetch of layer ``i - 1`` inside layer ``i``'s
    (``pre_backward``), so by its own tag a layer's span would hold another position's prefetch at
    one depth (the second's, at 4 layers) and a middle layer's at another (6 layers)."""
    if tag.startswith(FSDP_TAG):
        return where
    return _position(tag, layers) or ("other" if where == "other" else "")


FSDP_TAG = "fsdp."
_LAYER = re.compile(r"layers\.(\d+)\.")


def _position(tag: str, layers: int) -> str:
    """Which layer an event belongs to by its tag (``layers.3.attention.wq``): ``first``,
    ``second``, ``next_to_last``, ``last``, ``other`` between them, or "" outside the layers. Each
    layer's spans peak at an affine function of its index (the same tensors, more of the earlier
    layers' activations or gradients around), so the layers between the second and the next to
    last never peak above both."""
    m = _LAYER.search(tag)
    if m is None:
        return ""
    i = int(m.group(1))
    return {0: "first", 1: "second", layers - 2: "next_to_last", layers - 1: "last"}.get(i, "other")


# the categories whose first allocation in a span opens a new one
_OPENS = {
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATES: "optimizer",
    Category.OPTIMIZER_TEMP: "optimizer",
}
