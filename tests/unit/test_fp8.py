"""fp8 training: the formulas of ``costmodel/fp8.py``, the plan fields, and what fp8 changes in a
step against bf16-master (Transformer Engine under megatron, torchao elsewhere)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import pytest
from phase_run import steady_peak

from memplan.cli.app import run
from memplan.costmodel import fp8 as F8
from memplan.costmodel.layout import stage_layout
from memplan.costmodel.memory import (
    POLICIES,
    _shape,
    _stage_phases,
    estimate_training,
    fsdp2_unsharded,
    stage_moments,
)
from memplan.costmodel.runtimes import RUNTIMES
from memplan.costmodel.timeline.events import ALLOC, Moment
from memplan.costmodel.timeline.step import build_run
from memplan.errors import MemplanError
from memplan.specs.loader import load_model
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

LLAMA = load_model("llama3-8b")
WORK = TrainingWorkload(seq_len=4096, micro_batch=1)
TINY = ModelSpec(
    name="tiny-fp8", hidden_size=192, num_layers=2, num_attention_heads=6, num_kv_heads=2, ffn_size=1024, vocab_size=256
)


# --- formulas -------------------------------------------------------------------------------


def test_an_eager_cast_peaks_at_nine_bytes_per_element_and_leaves_one():
    # forward of a 1024 -> 192 linear on 512 tokens: the input's cast (9 x 512 x 1024) outgrows
    # the fp8 input beside the weight's cast (512 x 1024 + 9 x 1024 x 192)
    assert F8.torchao_linear_forward_extra(512, 1024, 192) == 9 * 512 * 1024
    # a wide weight on few tokens: the weight's cast, beside the fp8 input
    assert F8.torchao_linear_forward_extra(4, 1024, 1024) == 4 * 1024 + 9 * 1024 * 1024


def test_backward_extra_is_the_input_recast_beside_two_fp8_gradients_and_the_fp8_weight():
    tokens, n_in, n_out = 512, 1024, 192
    go, w, x = tokens * n_out, n_in * n_out, tokens * n_in
    assert F8.torchao_linear_backward_extra(tokens, n_in, n_out, rowwise=False) == 2 * go + w + 9 * x
    # rowwise's fp32 output scales (tokens x n_in, then n_in x n_out) never outgrow the casts
    assert F8.torchao_linear_backward_extra(tokens, n_in, n_out, rowwise=True) == 2 * go + w + 9 * x
    # few tokens: the weight's cast is the largest moment
    assert F8.torchao_linear_backward_extra(1, 1024, 1024, rowwise=False) == 1024 + 9 * 1024 * 1024


def test_te_state_is_a_1024_step_amax_history_per_quantizer_under_delayed_scaling():
    # 5 quantizers per GEMM (3 forward, 2 backward), fp32: history (1024, 5) and scale (5,)
    assert F8.te_scaling_state_bytes(1, "delayed") == 5 * (1024 + 1) * 4
    assert F8.te_scaling_state_bytes(7, "tensorwise") == 7 * 5 * 2 * 4
    assert F8.te_weight_workspace_bytes(1000) == 2000  # row-wise fp8 and its transpose (Hopper)


def test_te_saves_the_norm_outputs_and_fc2_input_in_fp8_and_copies_the_attention_output():
    tokens, d, h, q, f = 10, 2, 64, 64, 256
    saved = tokens * (d - 1) * (2 * h + f)  # three d-byte tensors become 1-byte ones
    assert F8.te_saved_input_delta(tokens, d, h, q, f, t=1, rep=1) == tokens * q - saved
    # MoE layers (dense=0) keep the attention part only
    assert F8.te_saved_input_delta(tokens, d, h, q, f, 1, 1, dense=0.0) == tokens * q - tokens * (d - 1) * h


def test_fsdp_fp8_all_gather_halves_the_linear_weights_only():
    assert F8.fsdp_gathered_bytes(1000, 10, 2, fp8_gather=True) == 1000 + 20
    assert F8.fsdp_gathered_bytes(1000, 10, 2, fp8_gather=False) == 2020


# --- recipes and plan fields ----------------------------------------------------------------


def test_auto_is_each_librarys_default_recipe():
    assert F8.recipe("auto", "megatron") == "delayed"
    assert F8.recipe("auto", "memplan") == "tensorwise"
    assert F8.recipe("tensorwise", "megatron") == "tensorwise"  # TE's Float8CurrentScaling
    assert F8.library("hf") == "torchao"


@pytest.mark.parametrize(("recipe", "runtime"), [("rowwise", "megatron"), ("delayed", "memplan"), ("delayed", "hf")])
def test_a_recipe_the_library_lacks_is_refused_on_its_field(recipe, runtime):
    with pytest.raises(MemplanError) as err:
        estimate_training(LLAMA, WORK, Plan(precision="fp8", fp8_recipe=recipe), runtime)
    assert err.value.field == "plan.fp8_recipe"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(precision="bf16-master", fp8_recipe="rowwise"), "fp8_recipe: only meaningful with precision: fp8"),
        (dict(precision="bf16", fp8_all_gather=True), "fp8_all_gather: only meaningful"),
        (dict(precision="fp8", fp8_all_gather=True, zero=1, dp=2), "needs zero 2 or 3"),
        (dict(precision="fp8", fp8_all_gather=True, fp8_recipe="rowwise", zero=3, dp=2), "tensorwise scaling only"),
    ],
)
def test_plan_refuses_fp8_fields_that_cannot_apply(fields, message):
    with pytest.raises(ValueError, match=message):
        Plan(**fields)


def test_fp8_all_gather_needs_fsdp2():
    plan = Plan(precision="fp8", fp8_all_gather=True, zero=3, dp=8)
    with pytest.raises(MemplanError) as err:
        estimate_training(LLAMA, WORK, plan, "megatron")
    assert err.value.field == "plan.fp8_all_gather"


# --- against bf16-master --------------------------------------------------------------------


def _moments(plan: Plan, runtime: str, model: ModelSpec = LLAMA, work: TrainingWorkload = WORK):
    return _stage_phases(model, work, plan, RUNTIMES[runtime], 0, 1)


def test_transformer_engine_keeps_fp8_weights_and_saves_less_per_layer():
    """Megatron with TE, tp=8 + SP: fp8 adds the cached fp8 weights (2 bytes per linear weight
    element) and the amax history, and each layer saves the delta of ``te_saved_input_delta``."""
    fp8, bf16 = Plan(precision="fp8", tp=8, sequence_parallel=True), Plan(tp=8, sequence_parallel=True)
    a, b = _moments(fp8, "megatron"), _moments(bf16, "megatron")
    layout = stage_layout(LLAMA, 8, 1, 1, 1, 0)
    gemms = LLAMA.num_layers * 7
    weights = 2 * F8.linear_elements(LLAMA, layout) + F8.te_scaling_state_bytes(gemms, "delayed")
    assert a.moments[Moment.OPTIMIZER]["fp8_weights"] == weights
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v; gate, up, down
    assert weights == 2 * 32 * per_layer // 8 + 32 * 7 * 5 * 1025 * 4  # 1.63 GiB and 4.6 MB of history
    # the optimizer step has no activations: fp8 costs exactly its weights there
    assert sum(a.moments[Moment.OPTIMIZER].values()) - sum(b.moments[Moment.OPTIMIZER].values()) == weights
    x = _shape(LLAMA, WORK, fp8, POLICIES["fp8"], RUNTIMES["megatron"])
    h, q, f = LLAMA.hidden_size, LLAMA.q_size, LLAMA.ffn_size
    delta = F8.te_saved_input_delta(x.tokens, 2, h, q, f, 8, 8)
    assert a.per_layer - b.per_layer == delta < 0
    # 4096 tokens: norm outputs 2 x 4096/8 x 4096 and fc2 input 14336/8 bytes saved, a 4096/8 copy added
    assert delta == 4096 * (4096 // 8) - 4096 * (2 * 4096 // 8 + 14336 // 8)


def test_fp8_is_no_longer_memory_blind():
    """The issue's case: ``--precision fp8`` gave exactly bf16-master's memory. Under megatron it now
    differs by the fp8 weights less the activations saved in fp8; under the bundled trainer
    (torchao, eager) it differs where a layer's backward is the peak (by the casts' temporaries)."""
    megatron = [
        estimate_training(LLAMA, WORK, Plan(precision=p, dp=8, zero=1), "megatron") for p in ("fp8", "bf16-master")
    ]
    assert megatron[0].peak.allocated != megatron[1].peak.allocated
    assert megatron[0].activations.per_layer < megatron[1].activations.per_layer
    work = TrainingWorkload(seq_len=256, micro_batch=1)
    tiny = [estimate_training(TINY, work, Plan(precision=p), "memplan", "cpu") for p in ("fp8", "bf16-master")]
    x = _shape(TINY, work, Plan(precision="fp8"), POLICIES["fp8"], RUNTIMES["memplan"], "cpu")
    extra = F8.torchao_linear_backward_extra(x.tokens, 1024, 192, rowwise=False)
    assert tiny[0].phases["backward"] > tiny[1].phases["backward"]
    assert tiny[0].phases["backward"] - tiny[1].phases["backward"] <= extra


def test_torchao_saves_bf16_so_a_loss_bound_peak_is_unchanged():
    """torchao saves its high-precision input (pytorch/ao#1850): llama3-8b at 4096 tokens peaks at
    the loss's backward, where no cast is live, so fp8 and bf16-master agree there."""
    fp8, bf16 = (
        estimate_training(LLAMA, WORK, Plan(precision=p, dp=8, zero=3), "memplan") for p in ("fp8", "bf16-master")
    )
    assert fp8.activations.per_layer == bf16.activations.per_layer
    assert fp8.peak.allocated == bf16.peak.allocated


def test_fsdp2_fp8_all_gather_gathers_a_layers_linear_weights_in_fp8():
    plan = Plan(precision="fp8", dp=8, zero=3)
    layout = stage_layout(LLAMA, 1, 1, 1, 1, 0)
    bf16 = fsdp2_unsharded(LLAMA, layout, plan, POLICIES["fp8"])
    fp8 = fsdp2_unsharded(LLAMA, layout, plan, POLICIES["fp8"], fp8_gather=True)
    linear = layout.largest_layer_params - 2 * LLAMA.hidden_size
    assert bf16.backward_end - fp8.backward_end == linear  # one layer (the embedding is prefetched)
    assert bf16.forward == fp8.forward  # the head group stays bf16


# --- the timeline carries it ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "work", "plan", "runtime"),
    [
        (LLAMA, WORK, dict(dp=8, zero=1), "megatron"),
        (LLAMA, WORK, dict(dp=8, zero=3, fp8_all_gather=True), "memplan"),
        (TINY, TrainingWorkload(seq_len=256, micro_batch=1), dict(), "memplan"),
        (TINY, TrainingWorkload(seq_len=256, micro_batch=1), dict(recompute="full", fp8_recipe="rowwise"), "memplan"),
    ],
    ids=["megatron-te", "fsdp2-fp8-gather", "torchao", "torchao-rowwise-full"],
)
def test_the_timeline_reaches_the_fp8_moments(model, work, plan, runtime):
    p = Plan(precision="fp8", **plan)
    report = estimate_training(model, work, p, runtime)
    sm = stage_moments(model, work, p, runtime)
    timeline = build_run(sm.moments, sm.granularity, sm.build_grads)
    if sm.granularity.fsdp:
        assert steady_peak(timeline) >= report.peak.allocated  # FSDP2's forward all-gathers on top
    else:
        assert steady_peak(timeline) == report.peak.allocated
    if runtime == "megatron":
        assert any(e.category == "fp8_weights" for e in timeline.events if e.op == ALLOC)


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(["estimate", "llama3-8b", "--gpu", "h100-sxm", "--runtime", "megatron", "--precision", "fp8", *args])
    return code, out.getvalue(), err.getvalue()


def test_estimate_cli_takes_the_recipe_and_refuses_one_the_runtime_lacks():
    code, out, _ = _cli("--gpus", "8", "--fp8-recipe", "tensorwise", "--format", "json")
    assert code == 0
    assert '"fp8_weights"' in out
    code, out, err = _cli("--fp8-recipe", "rowwise")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "plan.fp8_recipe" in err and "transformer-engine" in err


def test_megatron_export_carries_the_te_recipe_and_refuses_torchaos():
    from memplan.export import export, parse
    from memplan.specs.resolve import resolve_job

    job = resolve_job("llama3-8b", None, dict(gpus=8, tp=8, precision="fp8", fp8_recipe="tensorwise", gpu="h100-sxm"))
    text = export(job, "megatron")
    assert "--fp8-recipe tensorwise" in text
    assert parse("megatron", text)["fp8_recipe"] == "tensorwise"
    rowwise = resolve_job("llama3-8b", None, dict(gpus=8, tp=8, precision="fp8", fp8_recipe="rowwise", gpu="h100-sxm"))
    with pytest.raises(MemplanError) as err:
        export(rowwise, "megatron")
    assert err.value.field == "plan.fp8_recipe"
