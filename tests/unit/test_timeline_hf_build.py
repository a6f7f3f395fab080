"""How the Trainer's model was built (``hf_build.py``): transformers' warmup and load order, and what the
caching allocator keeps of them.

No GPU here: transformers' own ``caching_allocator_warmup`` runs on the CPU with its device map pointed at
``cuda:0`` and ``torch.cuda.mem_get_info`` / ``memory_reserved`` / ``memory_allocated`` / ``torch.empty``
answered for a fresh 141 GiB device, so the bytes it would ask the allocator for are read, not guessed; the
loader's ``set_param_for_module`` calls give the order it puts the weights in.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.allocator.sizing import get_allocation_size, round_size
from memplan.costmodel.reserve import plan_run, replay
from memplan.costmodel.timeline.events import ALLOC, MARK, Timeline
from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit
from memplan.costmodel.timeline.hf_build import warmup_bytes
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_run
from memplan.errors import MemplanError
from memplan.specs.loader import model_from_data
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

WARMUP = "caching_allocator_warmup"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=160)
TINY.update(vocab_size=256)
# (architecture, tied, load dtype, quantization): the warmup's element sizes and skipped keys
CASES = {
    "llama-bf16": ("llama", False, "bfloat16", None),
    "llama-fp32-tied": ("llama", True, "float32", None),
    "qwen2-bf16-biases": ("qwen2", False, "bfloat16", None),
    "llama-nf4-double-quant": ("llama", False, "bfloat16", "nf4"),
    "llama-int8": ("llama", False, "bfloat16", "int8"),
}


def _config(arch: str, tied: bool):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(**TINY, tie_word_embeddings=tied)


def _quantization(quant: str | None):
    import torch
    import transformers

    if quant == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    if quant is None:
        return None
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


@contextlib.contextmanager
def _fresh_device(torch, requested: list[int]):
    """``torch.cuda`` as a fresh 141 GiB device for the warmup's queries; ``torch.empty`` on it recorded."""
    cuda, saved = torch.cuda, (torch.cuda.mem_get_info, torch.cuda.memory_reserved, torch.cuda.memory_allocated)
    empty = torch.empty

    def fake_empty(n, dtype=None, device=None, requires_grad=False):
        assert str(device).startswith("cuda")
        requested.append(n * empty(0, dtype=dtype).element_size())

    cuda.mem_get_info = lambda index: (141 * 2**30, 141 * 2**30)
    cuda.memory_reserved = cuda.memory_allocated = lambda index: 0
    torch.empty = fake_empty
    try:
        yield
    finally:
        cuda.mem_get_info, cuda.memory_reserved, cuda.memory_allocated = saved
        torch.empty = empty


def transformers_load(tmp_path, arch: str, tied: bool, dtype: str, quant: str | None) -> tuple[list[int], list[str]]:
    """What ``from_pretrained(..., device_map=...)`` of a random checkpoint asks the warmup for, and the
    order its loader sets the weights in."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import core_model_loading as cml
    from transformers import modeling_utils as mu

    config = _config(arch, tied)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    requested: list[int] = []
    order: list[str] = []
    warmup, set_param = mu.caching_allocator_warmup, cml.set_param_for_module

    def on_cuda(model, device_map, hf_quantizer):
        with _fresh_device(torch, requested):
            warmup(model, dict.fromkeys(device_map, "cuda:0"), hf_quantizer)

    def record(model, name, *args, **kwargs):
        order.append(name)
        return set_param(model, name, *args, **kwargs)

    kwargs = dict(dtype=getattr(torch, dtype), device_map="cpu", quantization_config=_quantization(quant))
    mu.caching_allocator_warmup, cml.set_param_for_module = on_cuda, record
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)
    finally:
        mu.caching_allocator_warmup, cml.set_param_for_module = warmup, set_param
    return requested, order


def memplan_build(arch: str, tied: bool, dtype: str, quant: str | None) -> Timeline:
    """The run's build (no step) of the same model loaded the same way."""
    data = {**_config(arch, tied).to_dict(), "architectures": [f"{arch.capitalize()}ForCausalLM"]}
    model = model_from_data(data, f"{arch}/config.json", arch)
    itemsize = 4 if dtype == "float32" else 2
    fields = dict(finetune="qlora", quant=quant, double_quant=quant == "nf4") if quant else {}
    plan = Plan(precision="fp32" if itemsize == 4 else "bf16", **fields)
    d = hf_dims(model, TrainingWorkload(seq_len=64, micro_batch=1), plan)
    q = Bnb4bit(True, itemsize, itemsize) if quant == "nf4" else Bnb8bit() if quant == "int8" else None
    kw = dict(qkv_bias=model.qkv_bias, arch=model.architecture, quant=q, build="from_pretrained")
    return hf_run(d, model.tied_embeddings, "cpu_flash", steps=0, **kw)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_warmup_is_the_size_transformers_asks_for(tmp_path, case):
    requested, order = transformers_load(tmp_path, *CASES[case])
    run = memplan_build(*CASES[case])
    warmups = [e.size for e in run if e.op == ALLOC and e.tag == WARMUP]
    assert warmups == requested and len(requested) == 1
    # the weights then arrive in the loader's order, under the checkpoint's names (over a quantized base
    # prepare_model_for_kbit_training's fp32 copies come after, under the same names)
    loaded = list(dict.fromkeys(e.tag for e in run if e.op == ALLOC and e.tag in order))
    assert loaded == order


def test_the_warmup_counts_quantized_weights_at_their_packed_size():
    shapes = {"model.layers.0.mlp.up_proj.weight": (160, 64), "model.norm.weight": (64, 1)}
    assert warmup_bytes(shapes, 2, None) == (160 * 64 + 64) * 2
    assert warmup_bytes(shapes, 2, Bnb4bit(True, 2, 2)) == 160 * 64 // 2 + 64 * 2
    assert warmup_bytes(shapes, 2, Bnb8bit()) == 160 * 64 + 64 * 2


def _built(model_build: str, **fields) -> tuple[Timeline, int]:
    """Llama 3 8B's hf run up to its first step, and the warmup's size."""
    flags = dict(precision="bf16", seq_len=1024, micro_batch=1, model_build=model_build) | fields
    job = resolve_job("llama3-8b", None, flags, inference=False)
    run, which = plan_run(job.model, job.workload, job.plan, "hf")
    assert which == "hf"
    end = next(i for i, e in enumerate(run) if e.op == MARK and e.tag == "build")
    warmup = next((e.size for e in run if e.tag == WARMUP), 0)
    return Timeline(run.events[:end]), warmup


SMALL_SEGMENT = 2 * 2**20  # the small pool's segment (kSmallBuffer): the norms, rotary tables, tr_loss


def test_the_weights_are_carved_from_the_cached_warmup_segment():
    build, warmup = _built("from_pretrained")
    small = sum(round_size(e.size) for e in build if e.op == ALLOC and e.size <= 2**20 and e.tag != WARMUP)
    assert small <= SMALL_SEGMENT  # the small weights take one small segment
    r = replay(build, AllocatorConfig())
    assert r.max_reserved == get_allocation_size(round_size(warmup)) + SMALL_SEGMENT
    assert r.segments == 2  # the warmup's segment holds every large weight


def test_to_device_gives_each_weight_its_own_allocation():
    pretrained, to_device = _built("from_pretrained"), _built("to_device")
    assert to_device[1] == 0  # no warmup
    a, b = replay(pretrained[0], AllocatorConfig()), replay(to_device[0], AllocatorConfig())
    assert a.max_allocated == b.max_allocated  # the same weights
    # Llama 3 8B's 8 MiB k/v projections each open a 20 MiB segment (kLargeBuffer) or fill one's rest
    assert b.segments > 2 and b.max_reserved > a.max_reserved


def test_a_4bit_base_is_quantized_as_it_loads():
    build, warmup = _built("from_pretrained", finetune="qlora", seq_len=2048)
    allocs = [e for e in build if e.op == ALLOC]
    tags = [e.tag for e in allocs]
    first = tags.index("model.layers.0.mlp.down_proj.weight.loaded")
    # the 16-bit weight arrives, CUDA's quantize_4bit: absmax then the packed codes
    assert [e.size for e in allocs[first : first + 3]] == [4096 * 14336 * 2, 4096 * 14336 // 64 * 4, 4096 * 14336 // 2]
    assert warmup < sum(e.size for e in allocs if e.tag.endswith(".loaded"))  # counted at 0.5 B an element


def test_to_device_over_a_quantized_base_is_refused():
    with pytest.raises(MemplanError, match="--model-build: a nf4 base is always loaded by from_pretrained"):
        resolve_job("llama3-8b", None, dict(finetune="qlora", model_build="to_device"), inference=False)


@pytest.mark.parametrize(("model_build", "shown"), [("from_pretrained", "device_map="), ("to_device", "model.to")])
def test_the_trainer_export_loads_the_model_as_the_plan_says(model_build, shown):
    from memplan.export import render

    job = resolve_job("llama3-8b", None, dict(gpus=2, precision="bf16", model_build=model_build), inference=False)
    notes = render(job, "hf-trainer").notes
    assert any(shown in note for note in notes)
    assert any("device_map" in note for note in notes) == (model_build == "from_pretrained")
