"""How the Trainer's model was built (``plan.model_build``), as the allocations the build makes on the GPU.

What the build leaves in PyTorch's caching allocator is reserved before the first step, so it decides how
the steps' tensors are carved (``allocator/``). Two builds, read from transformers 5.23 and bitsandbytes 0.50:

``from_pretrained`` with a ``device_map`` (``modeling_utils.py``, ``_load_pretrained_model``: "Warmup cuda to
load the weights much faster", ``caching_allocator_warmup(model, expanded_device_map, hf_quantizer)`` whenever a
``device_map`` is given and the quantizer is not HQQ / Quark):

- ``get_total_byte_count``: over ``model.state_dict()``'s keys (parameters and persistent buffers; the rotary
  tables are not persistent), skipping ``all_tied_weights_keys`` (a tied ``lm_head``), ``numel x element_size``
  in the dtype the model was made in, or ``hf_quantizer.param_element_size``: 0.5 for a ``Linear4bit`` weight
  (``quantizer_bnb_4bit.py``: ``quantized_element_size``), 1 for a ``Linear8bitLt`` one;
- ``caching_allocator_warmup``: the count less the cache already reserved but unused (none in a fresh process:
  this run's assumption), at most the device's memory less 1.2 GiB (not applied here: a model that large does
  not train on the device), then ``torch.empty(int(byte_count // 2), dtype=torch.float16)``, freed when it
  returns. PyTorch's allocator keeps that one segment cached and carves the weights loaded next from it;
- ``core_model_loading.convert_and_load_state_dict_in_model``: the checkpoint's tensors in ``dot_natural_key``
  order (``layers.2`` before ``layers.10``), each materialized on the device in the model's dtype
  (``_materialize_copy``: ``tensor.to(device=device, dtype=dtype)``, a blocking copy that casts on the host:
  one device allocation). A dense model loads through a thread pool of up to 4 workers (``GLOBAL_WORKERS``):
  its allocations run in that order up to the pool's interleaving (the weights fit the warmup segment, so the
  order does not change what is reserved). A quantized one loads in sequence (on-the-fly quantization);
- a 4-bit weight (``Bnb4bitQuantize.convert``: ``Params4bit(value).to(value.device)`` -> ``_quantize`` ->
  ``functional.quantize_4bit``): the 16-bit weight arrives, then CUDA's ``quantize_4bit`` kernel
  (``backends/cuda/ops.py``) allocates the fp32 ``absmax`` per 64 elements, then the packed codes; ``code``
  (``get_4bit_type`` on the device: 16 fp32); with double quantization ``offset = absmax.mean()``, the
  temporary ``absmax - offset``, ``quantize_blockwise`` of it (the dynamic map's first use puts 256 fp32 on the
  device for the process, ``name2qmap``; the kernel's fp32 absmax per 256, its uint8 codes; the map copied into
  the state), the temporary and the fp32 absmax freed; the 16-bit weight goes when ``convert`` returns;
- an 8-bit weight (``Bnb8bitQuantize.convert``: ``Int8Params(value.to("cpu")).to(value_device)`` ->
  ``_quantize``): the 16-bit weight arrives, then its fp16 copy on the device (``.to(device, dtype=float16)``
  from the host copy), ``int8_vectorwise_quant``'s ``row_stats`` (``SCB``, fp32 per row) and ``CB`` (int8);
  the fp16 copy goes at ``_quantize``'s return, the 16-bit weight when ``convert`` returns;
- over a quantized base, ``prepare_model_for_kbit_training`` (peft ``utils/other.py``) then casts each other
  16-bit parameter, in ``model.parameters()`` order, to fp32 (``param.data = param.data.to(torch.float32)``).

``to_device``: each parameter its own allocation in ``model.parameters()`` order, as ``Module._apply`` moves
a model loaded on the host (``model.to("cuda")``: what the Trainer does to a model from ``from_pretrained``
without a ``device_map``), a tied weight once. ``from_config`` under ``torch.device("cuda")`` allocates the
same way but for two things not modelled: the rotary table's few temporaries and, with tied embeddings, the
untied ``lm_head`` allocated then freed by ``tie_weights``. A quantized base is loaded with a ``device_map``
(transformers gives bitsandbytes one when none is passed), so a plan refuses ``to_device`` over one. Under
the Trainer's FSDP2 a model loaded on the CPU is not moved by the Trainer but sharded onto the GPU by
accelerate (``hf_fsdp_load.py``); there the parameters made here are the host's.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.hf_bnb import BLOCK, CODE_4BIT, CODE_8BIT, NESTED_BLOCK, Bnb4bit, Bnb8bit

BUILDS = ("from_pretrained", "to_device")


def natural_key(name: str) -> list[tuple]:
    """transformers' ``dot_natural_key`` (``core_model_loading.py``): digits sort as numbers."""
    parts: list[tuple] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def element_size(name: str, itemsize: int, quant: Bnb4bit | Bnb8bit | None) -> float:
    """``hf_quantizer.param_element_size`` (or ``param.element_size()`` without a quantizer)."""
    if quant is not None and quant.quantized(name.removesuffix(".weight")):
        return 0.5 if isinstance(quant, Bnb4bit) else 1
    return itemsize


def warmup_bytes(shapes: dict[str, tuple[int, int]], itemsize: int, quant: Bnb4bit | Bnb8bit | None) -> int:
    """The bytes ``caching_allocator_warmup`` asks for in a fresh process: ``get_total_byte_count`` over the
    checkpoint's parameters (``shapes``: a tied ``lm_head`` already left out) in the dtype the model is made
    in (``itemsize``), then ``torch.empty(int(byte_count // 2), dtype=torch.float16)``."""
    total = sum(rows * cols * element_size(name, itemsize, quant) for name, (rows, cols) in shapes.items())
    return int(total // 2) * 2


MakeParam = Callable[[str, int, int], Tensor]  # (name, numel, itemsize) -> a managed parameter


def from_pretrained(
    tape: Tape, shapes: dict[str, tuple[int, int]], itemsize: int, quant: Bnb4bit | Bnb8bit | None, param: MakeParam
) -> dict[str, Tensor]:
    """The warmup segment, then the checkpoint's weights in load order (quantized ones quantized as they
    arrive), then ``prepare_model_for_kbit_training``'s fp32 casts over a quantized base; the weights by name."""
    tape.b.free(tape.b.alloc(warmup_bytes(shapes, itemsize, quant), Category.PARAMETERS, "caching_allocator_warmup"))
    weights: dict[str, Tensor] = {}
    first = True  # bitsandbytes' dynamic map goes to the device at the first double quantization
    for name in sorted(shapes, key=natural_key):
        rows, cols = shapes[name]
        if quant is None or not quant.quantized(name.removesuffix(".weight")):
            weights[name] = param(name, rows * cols, itemsize)
            continue
        arrived = tape.new(rows * cols, itemsize, f"{name}.loaded", Category.PARAMETERS)
        if isinstance(quant, Bnb4bit):
            weights[name] = quantize_4bit(tape, quant, name, rows * cols, first)
            first = False
        else:
            weights[name] = quantize_8bit(tape, quant, name, rows, cols)
        tape.done(arrived)
    if quant is not None and itemsize != 4:
        for name, (rows, cols) in shapes.items():  # model.parameters() order
            if not quant.quantized(name.removesuffix(".weight")):
                old, weights[name] = weights[name], param(name, rows * cols, 4)
                tape.free(old)
    return {name: weights[name] for name in shapes}


def quantize_4bit(tape: Tape, quant: Bnb4bit, name: str, numel: int, first: bool) -> Tensor:
    """``functional.quantize_4bit`` on CUDA over an arrived weight: the packed codes, the state kept."""
    blocks = -(-numel // BLOCK)
    kept = Category.PARAMETERS
    if quant.double_quant:  # quantized again below, then freed
        absmax = tape.new(blocks, 4, f"{name}.absmax", kept)
    else:  # the state's absmax
        absmax = tape.managed(blocks, 4, f"{name}.absmax", kept)
    packed = tape.managed((numel + 1) // 2, 1, name, kept)
    tape.managed(CODE_4BIT, 4, f"{name}.code", kept)
    if not quant.double_quant:
        return packed
    tape.managed(1, 4, f"{name}.offset", kept)
    shifted = tape.new(blocks, 4, f"{name}.absmax_minus_offset", kept)
    if first:
        tape.managed(CODE_8BIT, 4, "bitsandbytes.dynamic_map", Category.PARAMETERS)
    tape.managed(-(-blocks // NESTED_BLOCK), 4, f"{name}.state2.absmax", Category.PARAMETERS)
    tape.managed(blocks, 1, f"{name}.absmax_quantized", Category.PARAMETERS)
    tape.managed(CODE_8BIT, 4, f"{name}.state2.code", Category.PARAMETERS)
    tape.done(shifted, absmax)
    return packed


def quantize_8bit(tape: Tape, quant: Bnb8bit, name: str, rows: int, cols: int) -> Tensor:
    """``Int8Params._quantize`` on CUDA over an arrived weight: its fp16 copy, ``SCB``, ``CB`` (kept)."""
    fp16 = tape.new(rows * cols, 2, f"{name}.fp16", Category.PARAMETERS)
    scb = tape.managed(rows, 4, f"{name}.SCB", Category.PARAMETERS)
    cb = tape.managed(rows * cols, 1, name, Category.PARAMETERS)
    tape.done(fp16)
    quant.adopt(tape, name, cb, scb, rows)
    return cb
