"""Sliding layers past their window on CUDA under the Trainer (``hf_sliding.cuda_masked_sdpa``): SDPA's
memory-efficient kernel with the window's float mask, from PyTorch's source, not run on a GPU. Held by the run's
own tensors (sizes, lifetimes: what the kernel allocates and saves, the padded bias, no bias gradient), by the CPU
run where the two share ops (``repeat_kv``, the float mask, the gradients' sizes; the CPU run equals the real
Trainer, tests/unit/test_timeline_hf_sliding.py), and by ``hf_support``'s line between what the run follows on
CUDA and what stays on the phase model. No torch needed: the runs are memplan's.
"""

from __future__ import annotations

import pytest
from estimate_json import estimate_memory as _estimate

from memplan.costmodel.quant import CudaArch
from memplan.costmodel.timeline.events import ALLOC, FREE
from memplan.costmodel.timeline.hf_families import family_config
from memplan.costmodel.timeline.hf_sliding import cuda_saved_mask_bytes
from memplan.costmodel.timeline.hf_support import hf_supported, sliding_cuda_ok
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_kernel, hf_run
from memplan.costmodel.timeline.mem_efficient import lse_numel
from memplan.specs.loader import model_from_data
from memplan.specs.plan import Plan, trainer_autocast
from memplan.specs.workload import TrainingWorkload

B, STEPS = 2, 2
# Gemma 3 with 256-wide heads (the 16-bit k65536 kernels): five sliding layers and a full one
GEMMA3 = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "intermediate_size": 344,
    "vocab_size": 2000,
    "sliding_window": 64,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 256,
}
MISTRAL = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 344,
    "vocab_size": 2000,
    "sliding_window": 64,
    "max_position_embeddings": 256,
}
H100, A100, B200 = CudaArch(132, 9, 0), CudaArch(108, 8, 0), CudaArch(148, 10, 0)  # (SMs, major, minor)


def _model(config: dict, **update):
    return model_from_data({**config, **update}, "w/config.json", "w")


def _run(model, seq: int, precision: str, device: str = "cuda", recompute: str = "none"):
    plan = Plan(precision=precision, recompute=recompute)
    workload = TrainingWorkload(seq_len=seq, micro_batch=B)
    assert hf_supported(model, plan, workload, device=device) is None
    d = hf_dims(model, workload, plan)
    kernel = hf_kernel(model, plan, device)
    kw = dict(arch=model.architecture, extra=family_config(model), mixed=trainer_autocast(plan, "hf"))
    return hf_run(d, model.tied_embeddings, kernel, steps=STEPS, **kw)


def _attention_events(timeline, layer: int) -> list:
    return [e for e in timeline.events if e.op != 2 and f"layers.{layer}.self_attn." in e.tag]


def _leaf(e) -> str:
    return e.tag.rsplit(".", 1)[1]


@pytest.mark.parametrize(("seq", "precision", "itemsize"), [(100, "bf16", 2), (128, "fp32", 4), (120, "bf16-mixed", 2)])
def test_each_sliding_layer_saves_its_float_bias_padded_to_eight_columns(seq: int, precision: str, itemsize: int):
    """Per sliding layer and forward: the (b, 1, s, s) float mask, replaced by ``pad_bias``'s copy where s is no
    multiple of 8 (the unpadded one freed right after), saved by the memory-efficient node to its backward, freed
    only once its dq, dk, dv exist; the log-sum-exp padded to 32 rows; no bias gradient anywhere. The full layer
    (the sixth) builds no mask."""
    model = _model(GEMMA3)
    timeline = _run(model, seq, precision)
    float_bytes, saved_bytes = B * seq * seq * itemsize, cuda_saved_mask_bytes(B, seq, itemsize)
    assert (saved_bytes > float_bytes) == (seq % 8 != 0)
    for layer in range(5):
        events = _attention_events(timeline, layer)
        floats = [e for e in events if _leaf(e) == "mask_float" and e.op == ALLOC]
        assert len(floats) == STEPS and {e.size for e in floats} == {float_bytes}
        saved_leaf = "mask_padded" if seq % 8 else "mask_float"
        saved = [e for e in events if _leaf(e) == saved_leaf and e.op == ALLOC]
        assert {e.size for e in saved} == {saved_bytes} and len(saved) == STEPS
        for bias in saved:
            at = events.index(bias)
            freed = next(i for i, e in enumerate(events) if e.op == FREE and e.tensor == bias.tensor)
            between = [_leaf(e) for e in events[at:freed] if e.op == ALLOC]
            assert {"out", "lse"} <= set(between)  # held across the backward
            # the kernel's backward: dq, dk, dv, the delta (fp32: with its product and sum), the workspace; no
            # grad_bias (the mask requires none)
            delta = ["delta"] if itemsize == 2 else ["delta_product", "delta_sum", "delta"]
            assert between[between.index("dq") :] == ["dq", "dk", "dv", *delta, "grad_q_workspace"]
            if seq % 8:  # the unpadded mask goes as the padded one replaces it
                assert events[at + 1].op == FREE and _leaf(events[at + 1]) == "mask_float"
        lse = {e.size for e in events if _leaf(e) == "lse" and e.op == ALLOC}
        assert lse == {lse_numel(B, 4, seq) * 4}
    full = _attention_events(timeline, 5)  # flash, or math in fp32 with GQA (its own causal mask)
    assert not [e for e in full if _leaf(e) in ("mask_float", "mask_padded") or "sdpa_efficient" in e.tag]


@pytest.mark.parametrize(("config", "precision"), [(GEMMA3, "fp32"), (MISTRAL, "fp32"), (GEMMA3, "bf16-mixed")])
def test_the_ops_cuda_shares_with_the_cpu_run_allocate_the_same(config: dict, precision: str) -> None:
    """``repeat_kv``'s copies, the float mask and its two scalars, SDPA's output and dq / dk / dv, the gradients'
    sums over the groups: the same sizes in the same order as the CPU run (equal to the real Trainer's), layer by
    layer; CUDA adds only its kernel's own (the log-sum-exp's rows padded to 32 where s is not, the backward's
    delta and workspace, the 16-bit forward's fp32 accumulator)."""
    update = {"attention_pattern": ("sliding",), "sliding_window": 64} if config is MISTRAL else {}
    model = _model(config)
    if update:  # memplan reads no window from a Mistral config.json: a model file states it
        model = type(model)(**{**model.model_dump(), **update})
    shared = {"k_repeat", "v_repeat", "mask_zero", "mask_neg_inf", "mask_float", "out", "dq", "dk", "dv"}
    shared |= {"grad_sum_groups"}
    cuda, cpu = _run(model, 128, precision), _run(model, 128, precision, device="cpu")
    sliding = [i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding"]
    assert sliding
    for layer in sliding:
        mine = [(e.op, e.size, _leaf(e)) for e in _attention_events(cuda, layer) if _leaf(e) in shared]
        theirs = [(e.op, e.size, _leaf(e)) for e in _attention_events(cpu, layer) if _leaf(e) in shared]
        assert [x for x in mine if x[0] == ALLOC] == [x for x in theirs if x[0] == ALLOC], layer
        assert sorted(x for x in mine if x[0] == FREE) == sorted(x for x in theirs if x[0] == FREE), layer


def test_the_mask_costs_what_the_saved_biases_and_repeats_hold() -> None:
    """Against the same run with the window out of reach (every layer is_causal under flash): the peak grows by
    the five sliding layers' saved biases at least, and by no more than those, ``repeat_kv``'s copies, the bool
    grid and the kernel's buffers (the delta, its workspace and the forward's accumulator of one layer)."""
    reached, unreached = _model(GEMMA3), _model(GEMMA3, sliding_window=512)
    seq = 100
    grown = _run(reached, seq, "bf16").peak()[0] - _run(unreached, seq, "bf16").peak()[0]
    biases = 5 * cuda_saved_mask_bytes(B, seq, 2)
    tokens = B * seq
    repeats = 5 * 2 * tokens * 4 * 256 * 2 // 2  # k and v to 4 heads from 2: half of each copy new
    one_layer = tokens * 4 * 256 * 4 + 4 * 1024 * 1024  # the fp32 accumulator, the delta and workspace (< 4 MiB)
    assert biases <= grown <= biases + repeats + seq * seq + one_layer


def test_checkpointing_keeps_the_bool_grid_and_remakes_the_biases() -> None:
    """Under the Trainer's checkpointing no float bias outlives its layer's forward: the recompute makes it again
    (one per sliding layer and step in the forward, one in the backward)."""
    timeline = _run(_model(GEMMA3), 100, "bf16", recompute="full")
    for layer in range(5):
        events = _attention_events(timeline, layer)
        padded = [e for e in events if _leaf(e) == "mask_padded" and e.op == ALLOC]
        assert len(padded) == 2 * STEPS
        first = padded[0]
        after = events[events.index(first) :]
        freed = next(i for i, e in enumerate(after) if e.op == FREE and e.tensor == first.tensor)
        assert not [e for e in after[:freed] if _leaf(e) in ("dq", "dk", "dv")]  # gone before any backward


@pytest.mark.parametrize(
    ("config", "precision", "gpu", "followed"),
    [
        (GEMMA3, "bf16", H100, True),  # 256-wide heads: past cuDNN's 128, the memory-efficient kernel
        (GEMMA3, "bf16", A100, True),
        (GEMMA3, "bf16", B200, False),  # its backward blocks by shared memory: known on 8.0 / 9.0 only
        (GEMMA3, "fp32", H100, True),
        (GEMMA3, "bf16-mixed", H100, True),
        (MISTRAL, "bf16", H100, False),  # cuDNN (32-wide heads on 9.0): its workspace is the runtime's
        (MISTRAL, "bf16", A100, True),  # 8.0: cuDNN not first, the 16-bit memory-efficient kernel (64x64 blocks)
        (MISTRAL, "fp32", H100, True),
        (MISTRAL, "fp32", A100, True),
    ],
)
def test_which_masked_calls_cuda_follows(config: dict, precision: str, gpu: CudaArch, followed: bool) -> None:
    model = _model(config)
    if config is MISTRAL:
        model = type(model)(**{**model.model_dump(), "attention_pattern": ("sliding",), "sliding_window": 64})
    plan = Plan(precision=precision)
    assert sliding_cuda_ok(model, plan, gpu) is followed
    reason = hf_supported(model, plan, TrainingWorkload(seq_len=128, micro_batch=B), gpu_arch=gpu)
    assert (reason is None) is followed, reason
    if not followed:
        assert "a window the sequence reaches: on CUDA SDPA takes the mask to its" in reason
        assert ("outside compute capability 8.0 / 9.0" in reason) is (gpu is B200)


def test_estimate_answers_gemma3_past_its_window_on_the_gpu_op_level(capsys) -> None:
    """gemma3-12b at 4096 tokens (its 1024-token window reached in 40 of 48 layers) on the default GPU (an
    H100): the op-level run answers; Phi-3-mini's 96-wide heads (cuDNN) stay on the phase model."""
    gemma = _estimate(capsys, ["gemma3-12b", "--runtime", "hf", "--precision", "bf16", "--seq-len", "4096"])
    assert gemma["model"] == "op-level" and gemma["model_reason"] is None
    phi = _estimate(capsys, ["phi3-mini", "--runtime", "hf", "--precision", "bf16", "--seq-len", "4096"])
    assert phi["model"] == "phase" and "takes the mask to its cudnn kernel" in phi["model_reason"]
