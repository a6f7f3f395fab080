"""Unit tests of the cost model's small functions: each checks a formula on numbers worked by hand."""

from __future__ import annotations

import pytest

from memplan.costmodel import params as P
from memplan.costmodel.layout import stage_layer_indices, stage_layout
from memplan.costmodel.memory import (
    estimate_memory,
    gradient_accumulation,
    inflight_layers,
    kv_cache_bytes,
)
from memplan.costmodel.overhead import SEGMENT_BYTES, communicators, fast_reserved_bytes
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload
from memplan.units import format_bytes, parse_bytes, parse_quantity


def test_units_keep_gib_and_gb_apart():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("81559MiB") == 81559 * 2**20
    assert parse_quantity("3.35TB/s") == pytest.approx(3.35e12)
    assert parse_quantity("989.4TFLOPS", "FLOPS") == pytest.approx(989.4e12)
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    for bad in ("eighty", "80 parsecs", "1e3 FLOPS"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "gpt3-175b"])
@pytest.mark.parametrize("pp", [2, 4])
def test_stages_hold_every_parameter_once(name: str, pp: int):
    """With TP = EP = 1 and untied embeddings, the stages' params add up to the model's."""
    model = load_model(name)
    total = sum(stage_layout(model, 1, 1, pp, 1, s).params for s in range(pp))
    extra = model.vocab_size * model.hidden_size if model.tied_embeddings else 0  # last stage's copy
    assert total == P.total_params(model) + extra


def test_tensor_and_expert_parallel_shard_what_they_should():
    model = load_model("mixtral-8x7b")
    full = stage_layout(model, 1, 1, 1, 1, 0)
    sharded = stage_layout(model, 2, 4, 1, 1, 0)
    assert sharded.expert_params == full.expert_params // 8
    assert sharded.dense_params < full.dense_params / 2 + 32 * 2 * model.hidden_size + model.hidden_size


def test_interleaved_layer_assignment():
    # 16 layers, 2 stages, 2 chunks: stage 0 holds chunks 0 and 2
    assert stage_layer_indices(16, 2, 2, 0) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert stage_layer_indices(16, 2, 2, 1) == [4, 5, 6, 7, 12, 13, 14, 15]


def test_inflight_layers_by_schedule():
    L_stage, p, m = 4, 8, 32
    assert inflight_layers(Plan(pp=p), 0, m, L_stage) == p * L_stage  # 1F1B: L layers on stage 0
    assert inflight_layers(Plan(pp=p), p - 1, m, L_stage) == L_stage  # last stage: one micro-batch
    assert inflight_layers(Plan(pp=p, pp_schedule="gpipe"), 3, m, L_stage) == m * L_stage
    v = 2
    inter = inflight_layers(Plan(pp=p, pp_schedule="interleaved", virtual_stages=v), 0, m, L_stage)
    assert inter == pytest.approx(p * L_stage * (1 + (p - 1) / (p * v)))  # Korthikanti 4.2.3
    assert inflight_layers(Plan(pp=p), 0, 2, L_stage) == 2 * L_stage  # fewer micro-batches than stages


def test_gradient_accumulation_is_derived():
    assert gradient_accumulation(TrainingWorkload(micro_batch=2, global_batch=64), Plan(dp=8)) == 4
    assert gradient_accumulation(TrainingWorkload(micro_batch=2), Plan(dp=8)) == 1


def test_kv_cache_formula_and_paging():
    model = load_model("llama3-8b")  # 32 layers, 8 KV heads x 128
    work = InferenceWorkload(batch=4, prompt_tokens=1000, generated_tokens=0, kv_dtype="bf16")
    assert kv_cache_bytes(model, work, 1, range(32)) == 2 * 32 * 4 * 1000 * 8 * 128 * 2
    paged = work.model_copy(update={"block_size": 16})
    assert kv_cache_bytes(model, paged, 1, range(32)) == 2 * 32 * 4 * 1008 * 8 * 128 * 2
    assert kv_cache_bytes(model, work, 8, range(32)) == kv_cache_bytes(model, work, 1, range(32)) // 8
    # replicated KV heads
    assert kv_cache_bytes(model, work, 16, range(32)) == kv_cache_bytes(model, work, 8, range(32))


def test_offload_moves_states_off_the_gpu():
    model = load_model("llama3-8b")
    work = TrainingWorkload(seq_len=2048, micro_batch=1)
    on_gpu = estimate_memory(model, work, Plan(dp=8, zero=3))
    off = estimate_memory(model, work, Plan(dp=8, zero=3, offload_optimizer="cpu", offload_params="cpu"))
    assert off.model_states.optimizer_states == 0 and off.model_states.parameters == 0
    assert off.offload.cpu >= on_gpu.model_states.optimizer_states + on_gpu.model_states.parameters
    nvme = estimate_memory(model, work, Plan(dp=8, zero=3, offload_optimizer="nvme"))
    assert nvme.offload.nvme == on_gpu.model_states.optimizer_states
    assert off.peak.allocated < on_gpu.peak.allocated


def test_fast_reserved_adds_slack_in_segments_and_no_overhead():
    assert communicators(8, 1, 1, 1, 1) == 1
    assert communicators(8, 8, 4, 1, 1) == 3
    reserved = fast_reserved_bytes(10 * 2**30)
    assert reserved % SEGMENT_BYTES == 0
    assert 10 * 2**30 * 1.07 <= reserved < 10 * 2**30 * 1.07 + SEGMENT_BYTES


def test_first_and_last_stage_differ_and_the_report_names_the_peak():
    model = load_model("llama3-8b")
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64)
    report = estimate_memory(model, work, Plan(dp=2, pp=4, tp=2, zero=1))
    # the bundled trainer's torch.distributed.pipelining: the second stage is examined too
    assert set(report.stage_peaks) == {0, 1, 3}
    assert set(estimate_memory(model, work, Plan(dp=2, pp=4, tp=2, zero=1), "megatron").stage_peaks) == {0, 3}
    assert report.peak.allocated == max(report.stage_peaks.values())
    assert report.peak.rank == report.peak.stage * 2 * 2  # tp x dp ranks per stage
    assert "pipeline stage" in report.peak.rank_role


def test_logits_are_a_term_of_their_own():
    """Llama-3's 128k vocabulary: at 8,192 tokens the fp32 logits alone are about 4 GB."""
    model = load_model("llama3-8b")
    report = estimate_memory(model, TrainingWorkload(seq_len=8192, micro_batch=1), Plan(), "hf")
    assert report.peak.breakdown["logits_and_loss"] > 4 * 8192 * model.vocab_size


def test_eager_attention_holds_the_scores_and_flash_does_not():
    model = load_model("llama3-8b")
    work = TrainingWorkload(seq_len=4096, micro_batch=1)
    eager = estimate_memory(model, work, Plan(attention="eager"), "megatron").activations.per_layer
    flash = estimate_memory(model, work, Plan(attention="flash"), "megatron").activations.per_layer
    a, s, d = model.num_attention_heads, 4096, 2
    assert eager - flash == s * a * s * (2 * d + 1) - s * 4 * a


def test_zero_stages_shard_the_right_states():
    model = load_model("llama3-8b")
    work = TrainingWorkload(seq_len=1024, micro_batch=1)
    # ZeRO's own accounting (DeepSpeed semantics: ZeRO-2 keeps whole parameters)
    states = [estimate_memory(model, work, Plan(dp=8, zero=z), "megatron").model_states for z in range(4)]
    assert states[1].optimizer_states == states[0].optimizer_states // 8
    assert states[2].gradients == pytest.approx(states[1].gradients / 8, rel=1e-6)
    assert states[3].parameters == pytest.approx(states[2].parameters / 8, rel=1e-6)
    # FSDP2 (the memplan trainer): ZeRO-2's persistent parameters are the shard too; the
    # whole ones are gathered per step (measured in tests/validate)
    fsdp = [estimate_memory(model, work, Plan(dp=8, zero=z)) for z in (2, 3)]
    assert fsdp[0].model_states.parameters == fsdp[1].model_states.parameters
    assert fsdp[0].peak.breakdown["gathered_params"] > fsdp[1].peak.breakdown.get("gathered_params", 0)


def test_selective_op_keeps_the_input_odd_matmuls_attention_and_reduce_scatters():
    """Per-op SAC on a gated GQA layer: input d h, q d q/t, v d kv/t, gate d f/t, down d h (a
    row-parallel partial sum, full width), attention output d q/t and log-sum-exp 4 a/t;
    under SP the input is split by t and the two reduce-scatter outputs d h/t are kept."""
    from memplan.costmodel import activations as A
    from memplan.costmodel.memory import layer_activation_bytes
    from memplan.costmodel.runtimes import RUNTIMES

    m = load_model("llama3-8b")
    h, q, kv, f, a = m.hidden_size, m.q_size, m.kv_size, m.ffn_size, m.num_attention_heads
    tokens, d, t = 2 * 4096, 2, 4
    x = A.Shape(model=m, b=2, s=4096, span=4096, t=t, sp=False, d=d, eager=False, dropout=False)
    per_token = d * h + d * (q + kv + f) // t + d * h + (d * q + 4 * a) // t
    assert A.op_sac_layer(x) == tokens * per_token
    sp = A.Shape(model=m, b=2, s=4096, span=4096, t=t, sp=True, d=d, eager=False, dropout=False)
    assert A.op_sac_layer(sp) == A.op_sac_layer(x) - tokens * d * h + tokens * d * h // t + 2 * tokens * d * h // t
    rt = RUNTIMES["memplan"]
    none = layer_activation_bytes(x, rt, "none", 0.0, 1)
    selective = layer_activation_bytes(x, rt, "selective", 0.0, 1)
    op = layer_activation_bytes(x, rt, "selective-op", 0.0, 1)
    assert op < selective < none


@pytest.mark.parametrize("t", [1, 2])
def test_autocast_dynamic_cache_is_counted_for_transformers_only(t: int):
    """Under autocast transformers' DynamicCache keeps fp32 keys and values (2 x 4kv per token
    and layer, split by t); the bundled trainer has no cache, and its fp32 RoPE'd keys are
    freed once SDPA has cast them (measured: exactly 8kv bytes per token and layer)."""
    from memplan.costmodel import activations as A
    from memplan.costmodel.runtimes import RUNTIMES

    m = load_model("llama3-8b")
    x = A.Shape(model=m, b=2, s=1024, span=1024, t=t, sp=False, d=2, eager=False, dropout=False, autocast=True)
    cache = x.tokens * 2 * 4 * m.kv_size // t
    assert RUNTIMES["hf-loop"].layer(x) - RUNTIMES["memplan"].layer(x) == cache
    plain = A.Shape(model=m, b=2, s=1024, span=1024, t=t, sp=False, d=2, eager=False, dropout=False)
    assert RUNTIMES["hf-loop"].layer(plain) == RUNTIMES["memplan"].layer(plain)  # no autocast: no fp32 copies


def test_a_middle_stage_with_many_micro_batches_is_the_peak():
    """torch.distributed.pipelining keeps on a middle stage one activation receive buffer and one
    gradient receive buffer per micro-batch (stage.py, ``_setup_forward_recv_info`` /
    ``_setup_backward_recv_info``): 2m activations, against m on the first stage and the last.
    1F1B's sends hold only the latest input gradient (``Schedule1F1B``'s ``bwd_sends``; the op-level
    run's ``pipeline._Held1F1B``: the run of this plan's stage 1 holds the 64 and 64 receive
    buffers and no other input gradient). With 64 micro-batches of 4096 tokens of Llama 2 7B (bf16,
    b s h x 2 = 33,554,432 B each) the second stage's pipeline buffers at its last forward are 129
    of them (the 64 and 64 receive buffers and the latest input gradient; its 3 outputs in
    ``fwd_cache`` stand where the checkpointed layers would count their first inputs, the receive
    buffers themselves), which outweighs the first's extra in-flight layer inputs and the last's
    logits: the report names it. Measured on the bundled trainer at a small shape
    (docs/cost-model.md, Pipelines)."""
    model = load_model("llama2-7b")
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64)
    report = estimate_memory(model, work, Plan(pp=4, tp=8, recompute="full", precision="bf16"))
    assert report.peak.stage == 1 and report.peak.rank_role == "pipeline stage 1"
    assert report.peak.phase == "forward"
    assert report.peak.breakdown["comm_buffers"] == (64 + 64 + 1) * 4096 * 4096 * 2
