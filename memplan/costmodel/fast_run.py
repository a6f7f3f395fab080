"""The search's fast form for fine-tuning and fp32 plans, taken from the op-level run.

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

A quantized base loaded by ``from_pretrained`` (``_loads_quantized``) is the exception: its load leaves
holes whose rests are not affine in the depth, so the whole run answers it.

Measured against the whole run: equal to the byte on every plan of
tests/search/test_fast_form_finetune.py (docs/cost-model.md, "The search's fast form against the
run"). A search computes each plan's once (``search.evaluate.Context.run_peaks``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from memplan.costmodel.allocator import AllocatorConfig, CachingAllocator
from memplan.costmodel.quant import CudaArch, cuda_arch
from memplan.costmodel.timeline.events import ALLOC, MARK, Category, Timeline, collection_paused
from memplan.costmodel.timeline.phases import PHASE_MARKS
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
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
    CUDA of one pipeline stage without tensor parallelism, on one data-parallel rank or, under the
    bundled trainer, over DDP (ZeRO-0) or ZeRO-1 (``_over_ranks``), over a model whose layers
    repeat (no MoE, latent attention, per-layer attention or RoPE pattern, multi-token
    prediction), with every layer treated alike (no ``recompute_layers``), for the runtimes the
    run models. The plans of full bf16 training stay on the phase model's sums (the 768-plan
    grid's cost; how far they are from the run: docs/cost-model.md). LoRA over an MoE model under
    ``hf``: the whole run (``_moe_lora_peak``), on either device."""
    if _moe_lora(model, plan):
        return runtime == "hf"
    if device != "cuda" or runtime not in ("memplan", "hf"):  # hf-loop: 48 of 50 exact (docs/cost-model.md)
        return False
    if plan.finetune == "full" and plan.precision != "fp32":
        return False
    if plan.pp > 1 or plan.tp * plan.cp * plan.ep > 1 or plan.recompute_layers is not None:
        return False
    if plan.dp > 1 and not _over_ranks(plan, runtime):
        return False
    repeats = not (model.moe or model.mla or model.rope_pattern or model.attention_pattern)
    return repeats and model.num_mtp_layers == 0 and model.num_layers >= SHALLOWEST + 2 * STEP - 1


def _over_ranks(plan: Plan, runtime: str) -> bool:
    """The plans over several data ranks the cut runs answer: the bundled trainer's DDP (ZeRO-0)
    and ZeRO-1, whose gradient buckets and optimizer shards add the same per layer, where the
    phase model's sums miss the run by up to -19% (fp32, ZeRO-1, full recompute, 4,096 tokens) and
    -67% (QLoRA under DDP: docs/cost-model.md, "The search's fast form against the run"). Not
    FSDP2 (ZeRO-2, ZeRO-3): its shards are carved from segments whose packing does not repeat
    layer by layer (ZeRO-3's cut runs' spans do not line up; ZeRO-2's miss the run by up to
    4.7 MB)."""
    return runtime == "memplan" and plan.zero <= 1


def run_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str, gpu: GPUSpec | None = None
) -> RunPeak | None:
    """The op-level run's allocated peak for ``applies`` plans, from the runs cut to
    ``cut_depths`` layers; None where the run does not model the plan (``reserve.plan_run`` falls back to the
    phases) or the cut runs' spans do not line up. ``gpu``: its SMs and compute capability pick a 4-bit
    base's kernel (``quant.cuda_arch``)."""
    if _moe_lora(model, plan):
        return _moe_lora_peak(model, workload, plan, device, gpu)
    if not _modelled(model, workload, plan, runtime, cuda_arch(gpu)):
        return None
    if _loads_quantized(plan, runtime):
        return _whole_run_peak(model, workload, plan, runtime, device)
    depths = cut_depths(model.num_layers)
    cut = [
        _span_peaks(model.model_copy(update={"num_layers": n}), workload, plan, runtime, device, gpu) for n in depths
    ]
    if cut[0] is None or cut[1] is None or [p for p, _ in cut[0]] != [p for p, _ in cut[1]]:
        return None
    steps = (model.num_layers - depths[0]) // STEP
    spans = [(a + (b - a) * steps, label) for (label, a), (_, b) in zip(*cut, strict=True)]
    allocated, label = max(spans, key=lambda s: s[0])  # the first of equals: the step's order
    return RunPeak(allocated, _phase(label))


def _moe_lora(model: ModelSpec, plan: Plan) -> bool:
    """LoRA over an MoE model (``reserve.run_only``): no phase-model sum screens it, its LoRA layer
    counting a dense MLP of ``ffn_size`` where the experts are."""
    return model.moe is not None and plan.finetune != "full"


def _moe_lora_peak(
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str, gpu: GPUSpec | None
) -> RunPeak:
    """The whole run of transformers' Trainer (``reserve.plan_run``, which raises rather than fall back to
    the phases where the run does not follow the plan: a GPU below compute capability 8.0), as
    ``estimate`` reports it: on CUDA replayed through the caching allocator model, on CPU its live
    bytes (``cpu_reserve.cpu_replay``: no caching allocator); in the phase of its highest span."""
    from memplan.costmodel.cpu_reserve import cpu_replay
    from memplan.costmodel.reserve import plan_run, replay

    run, _ = plan_run(model, workload, plan, "hf", device, gpu)
    label = max(span_peaks(run, model.num_layers), key=lambda s: s[1])[0]
    peak = replay(run, AllocatorConfig()) if device == "cuda" else cpu_replay(run)
    return RunPeak(peak.max_allocated, _phase(label))


def _loads_quantized(plan: Plan, runtime: str) -> bool:
    """A quantized base loaded by transformers' ``from_pretrained`` (``timeline/hf_build.py``): its 16-bit
    weights arrive in the warmup segment and leave holes the quantized ones are carved from, so where a
    block is served whole (its rest under 1 MiB) depends on the depth, not affinely (Llama 3 8B cut to 5,
    7 and 9 layers, QLoRA over a bf16 load: 0.5, 0 and 1 MiB of such rests at the peak). The whole run
    answers these plans."""
    return runtime in ("hf", "hf-loop") and plan.quant != "none" and plan.model_build == "from_pretrained"


def _whole_run_peak(model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str) -> RunPeak:
    """The whole run's allocated peak, in the phase of the highest span outside the middle layers."""
    from memplan.costmodel.reserve import plan_run, replay

    run, _ = plan_run(model, workload, plan, runtime, device)
    label = max(span_peaks(run, model.num_layers), key=lambda s: s[1])[0]
    return RunPeak(replay(run, AllocatorConfig()).max_allocated, _phase(label))


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
    model: ModelSpec, workload: TrainingWorkload, plan: Plan, runtime: str, device: str, gpu: GPUSpec | None
) -> list[tuple[str, int]] | None:
    """Each span's peak allocated in the run of ``model`` (None where the phases answer)."""
    from memplan.costmodel.reserve import plan_run

    run, which = plan_run(model, workload, plan, runtime, device, gpu)
    return None if which.startswith("phases") else span_peaks(run, model.num_layers)


def span_peaks(run: Timeline, layers: int) -> list[tuple[str, int]]:
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
    between two of the middle ones (the hand loop's) belongs to them."""
    from memplan.costmodel.reserve import STREAM_IDS

    with collection_paused():
        alloc = CachingAllocator(AllocatorConfig())
        blocks, spans, mark, where, opened = {}, [], "setup", "", set()
        for op, tensor, size, category, stream, tag in run.events:
            if op == MARK:
                spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
                alloc.max_allocated, mark, where, opened = alloc.allocated, tag, "", set()
                continue
            if op != ALLOC:  # a free never raises the peak: it stays in the span it falls in
                alloc.free(blocks.pop(tensor))
                continue
            # an allocation outside the layers between two of the middle ones is theirs
            position = _position(tag, layers) or ("other" if where == "other" else "")
            group = "gradients" if tag.endswith("grad_seed") else _OPENS.get(category)
            if position != where or (group is not None and group not in opened):
                spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
                if group is not None:
                    opened.add(group)
                alloc.max_allocated, where = alloc.allocated, position
            blocks[tensor] = alloc.malloc(size, STREAM_IDS[stream])
        spans.append((f"{mark}|{where}|{'+'.join(sorted(opened))}", alloc.max_allocated))
    return [(label, peak) for label, peak in spans if "|other|" not in label]


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
