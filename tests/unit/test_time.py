"""The step-time model: alpha-beta collectives, links, and how the step moves with the plan."""

from __future__ import annotations

import pytest

from memplan.costmodel.flops import training_flops_per_token
from memplan.costmodel.time import (
    Efficiency,
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    estimate_time,
    group_link,
    recompute_fraction,
)
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

H100 = load_gpu("h100-sxm")
EIGHT = ClusterSpec(gpus_per_node=8, nodes=1)
LLAMA8 = load_model("llama3-8b")
WORK = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64)


def _time(plan: Plan, workload: TrainingWorkload = WORK, cluster: ClusterSpec = EIGHT, **kw):
    return estimate_time(LLAMA8, workload, plan, H100, cluster, **kw)


def test_ring_collectives_follow_alpha_beta():
    link = Link(bytes_per_s=100e9, alpha_s=1e-5)
    # all-gather of 8 GB over 8 ranks: 7 steps of (alpha + 1 GB / 100 GB/s)
    assert all_gather_s(8e9, 8, link) == pytest.approx(7 * (1e-5 + 0.01))
    assert all_reduce_s(8e9, 8, link) == pytest.approx(2 * all_gather_s(8e9, 8, link))
    assert all_to_all_s(8e9, 8, link) == pytest.approx(7 * 1e-5 + 8e9 * 7 / 8 / 100e9)
    assert all_reduce_s(8e9, 1, link) == 0.0


def test_groups_inside_a_node_use_nvlink_and_across_nodes_the_network():
    cluster = ClusterSpec(gpus_per_node=8, nodes=4, inter_node_bytes_per_s=50e9)
    eff = Efficiency()
    assert group_link(H100, cluster, 1, 8, eff).bytes_per_s == pytest.approx(H100.nvlink_bytes_per_s * eff.network)
    assert group_link(H100, cluster, 8, 4, eff).bytes_per_s == pytest.approx(50e9 * eff.network)
    assert group_link(H100, cluster, 2, 8, eff).alpha_s == eff.alpha_inter_s  # spans 16 GPUs


def test_a_ring_across_nodes_uses_the_nics_of_its_ranks_on_each_node():
    """NCCL's rings leave a node through different GPUs' NICs: a group with 4 ranks per node
    (stride 2) moves data at 4 NICs' bandwidth, one with a rank per node at one NIC's, and no
    group beyond NVLink's bandwidth."""
    cluster = ClusterSpec(gpus_per_node=8, nodes=4, inter_node_bytes_per_s=50e9)
    eff = Efficiency()
    assert group_link(H100, cluster, 2, 16, eff).bytes_per_s == pytest.approx(4 * 50e9 * eff.network)
    assert group_link(H100, cluster, 8, 4, eff).bytes_per_s == pytest.approx(50e9 * eff.network)
    assert group_link(H100, cluster, 16, 2, eff).bytes_per_s == pytest.approx(50e9 * eff.network)
    capped = group_link(H100, cluster, 1, 32, eff).bytes_per_s  # 8 x 50 GB/s is below NVLink's 450
    assert capped == pytest.approx(8 * 50e9 * eff.network)
    fast = ClusterSpec(gpus_per_node=8, nodes=4, inter_node_bytes_per_s=100e9)
    assert group_link(H100, fast, 1, 32, eff).bytes_per_s == pytest.approx(H100.nvlink_bytes_per_s * eff.network)


def test_breakdown_sums_to_the_step_and_mfu_is_consistent():
    report = _time(Plan(dp=8, zero=3))
    assert sum(report.breakdown.values()) == pytest.approx(report.step_time_s)
    tokens = 64 * 4096
    assert report.tokens_per_s == pytest.approx(tokens / report.step_time_s)
    assert report.mfu == pytest.approx(report.flops_per_step / report.step_time_s / 8 / H100.peak_flops["bf16"])
    assert 0 < report.mfu < Efficiency().matmul  # never above what the matmuls reach


def test_recomputation_costs_time_and_counts_in_hfu_only():
    none, selective, full = (_time(Plan(dp=8, zero=3, recompute=r)) for r in ("none", "selective", "full"))
    assert none.step_time_s < selective.step_time_s < full.step_time_s
    assert none.hfu == pytest.approx(none.mfu)
    # the layers' forward again (4 passes of 3); the LM head is outside the checkpointed layers
    model = load_model("llama3-8b")
    total = training_flops_per_token(model, 4096)
    head = 6 * model.vocab_size * model.hidden_size
    assert full.hfu / full.mfu == pytest.approx(1 + (total - head) / 3 / total, rel=1e-6)
    assert none.flops_per_step == full.flops_per_step


def test_pipeline_bubble_shrinks_with_more_microbatches_and_virtual_stages():
    small = _time(Plan(pp=4, dp=2), TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=8))
    big = _time(Plan(pp=4, dp=2), TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64))
    inter = _time(Plan(pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2),
                  TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64))  # fmt: skip
    share = [r.breakdown["pp_bubble"] / r.step_time_s for r in (small, big, inter)]
    assert share[0] > share[1] > share[2]
    per_mb = big.breakdown["compute"] / 32  # 64 / dp 2 micro-batches of compute
    assert big.breakdown["pp_bubble"] >= 3 * per_mb  # (p - 1) micro-batch slots at least


def test_tensor_parallel_comm_is_exposed_and_grows_across_nodes():
    inside = _time(Plan(tp=8))
    across = _time(Plan(tp=16), cluster=ClusterSpec(gpus_per_node=8, nodes=2))
    assert inside.breakdown["tp_comm"] > 0
    assert across.breakdown["tp_comm"] > inside.breakdown["tp_comm"]


def test_zero3_gathers_cost_more_than_zero1_across_slow_networks():
    slow = ClusterSpec(gpus_per_node=8, nodes=16, inter_node_bytes_per_s=1e9)
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=512)
    assert _time(Plan(dp=128, zero=3), work, slow).step_time_s > _time(Plan(dp=128, zero=1), work, slow).step_time_s


def test_offload_adds_pcie_and_host_optimizer_time():
    on_gpu = _time(Plan(dp=8, zero=3))
    offloaded = _time(Plan(dp=8, zero=3, offload_optimizer="cpu"))
    assert offloaded.breakdown["offload"] > 0 and offloaded.step_time_s > on_gpu.step_time_s


def test_calibration_scales_the_step():
    base = _time(Plan(dp=8, zero=3))
    slower = _time(Plan(dp=8, zero=3), eff=Efficiency.for_gpu(H100, calibration=1.25))
    assert slower.step_time_s == pytest.approx(1.25 * base.step_time_s)
    assert slower.mfu == pytest.approx(base.mfu / 1.25)


def test_fused_kernels_move_less_memory_than_eager():
    fused = _time(Plan(dp=8), runtime="megatron").breakdown["memory_bound"]
    assert fused < _time(Plan(dp=8)).breakdown["memory_bound"]


def test_moe_expert_parallel_pays_all_to_all():
    mixtral = load_model("mixtral-8x7b")
    work = TrainingWorkload(seq_len=4096, micro_batch=1, global_batch=64)
    report = estimate_time(mixtral, work, Plan(dp=8, ep=8, zero=3), H100, EIGHT)
    assert report.breakdown["ep_comm"] > 0
    # only the active experts count: MFU from 12.9B active params, not 46.7B
    assert report.flops_per_step < 64 * 4096 * 6 * 20e9


def test_selective_op_recomputes_every_second_matmul_and_the_elementwise_kernels():
    """torchtitan's per-op SAC on Llama 3 8B: k, the output projection and up are recomputed,
    (h kv + q h + h f) / (2 h q + 2 h kv + 3 h f) of the layer's forward matmuls, a third of
    that over forward and backward; every element-wise kernel runs again; flash attention
    does not (its output is saved); SP re-gathers (half a round of collectives), no SP
    re-reduces (one round)."""
    m = LLAMA8
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_size
    extra = recompute_fraction(Plan(recompute="selective-op"), m.num_layers, m)
    share = (h * kv + q * h + h * f) / (2 * h * q + 2 * h * kv + 3 * h * f)
    assert extra.matmul == pytest.approx(share / 3)
    assert extra.matmul == pytest.approx(0.122, abs=0.001)
    assert (extra.attention, extra.elementwise, extra.tp_rounds) == (0.0, pytest.approx(1 / 3), 1.0)
    assert recompute_fraction(Plan(recompute="selective-op", tp=2, sequence_parallel=True), 32, m).tp_rounds == 0.5
    assert recompute_fraction(Plan(recompute="selective-op", attention="eager"), 32, m).attention == pytest.approx(
        1 / 3
    )
    none, op, full = (_time(Plan(dp=8, zero=3, recompute=r)) for r in ("none", "selective-op", "full"))
    assert none.step_time_s < op.step_time_s < full.step_time_s
    assert op.hfu > op.mfu and op.flops_per_step == none.flops_per_step
