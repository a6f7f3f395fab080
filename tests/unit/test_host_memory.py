"""Host memory (memplan.costmodel.host) and the NVMe tier at dp = 1: what a node keeps in RAM,
the refusal when it exceeds the node's memory and the NVMe changes advised then; the time model's
NVMe and parameter-offload terms."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.costmodel.advice import host_suggestions, suggest
from memplan.costmodel.host import host_memory, mem_total_bytes
from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.optimizer import state_bytes_per_param
from memplan.costmodel.params import total_params
from memplan.costmodel.precision import POLICIES
from memplan.costmodel.time import estimate_time
from memplan.estimation import estimate
from memplan.specs.hardware import ClusterSpec
from memplan.specs.loader import load_gpu, load_model
from memplan.specs.plan import Plan
from memplan.specs.resolve import resolve_job
from memplan.specs.workload import TrainingWorkload

GiB = 2**30
L8 = load_model("llama3-8b")
A100 = load_gpu("a100-80gb")
WORK = TrainingWorkload(seq_len=2048, micro_batch=1)
OFFLOAD = Plan(zero=1, offload_optimizer="cpu", precision="bf16-mixed")


def test_mem_total_is_read_in_bytes(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   20000000 kB\n")
    assert mem_total_bytes(meminfo) == 65_536_000 * 1024
    assert mem_total_bytes(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("MemTotal: lots\n")
    assert mem_total_bytes(tmp_path / "odd") is None


def test_a_node_holds_every_rank_share_and_the_spilled_paged_states():
    report = estimate_memory(L8, WORK, OFFLOAD, "memplan")
    cpu = report.offload.cpu
    # bf16-mixed ZeRO-Offload: AdamW's two fp32 states of every parameter on the host
    assert cpu == int(total_params(L8) * state_bytes_per_param("adamw", POLICIES["bf16-mixed"]))
    one = host_memory(report, 1, 0, 64 * GiB, "--host-memory")
    assert (one.needed_bytes, one.pinned_bytes, one.paged_bytes) == (cpu, cpu, 0) and one.fits
    eight = host_memory(report, 8, 0, 64 * GiB, "--host-memory")
    assert eight.needed_bytes == 8 * cpu and not eight.fits
    assert "8 ranks" in eight.reason() and "64.00 GiB (--host-memory)" in eight.reason()
    assert host_memory(report, 8, 0, None, "").fits  # unknown: not checked
    paged = estimate_memory(L8, WORK, Plan(precision="bf16-mixed", optimizer="paged-adamw-32bit"), "memplan")
    spill = host_memory(paged, 1, 10 * GiB, None, "")
    assert spill.paged_bytes == paged.paged_optimizer_states - 10 * GiB > 0 and spill.pinned_bytes == 0


def test_estimate_refuses_a_plan_the_host_cannot_hold_and_advises_nvme():
    job = resolve_job(
        "llama3-8b", None, {"gpu": "a100-80gb", "gpus": 1, "zero": 1, "offload_optimizer": "cpu",
                            "precision": "bf16-mixed"},
    )  # fmt: skip
    roomy = estimate(job, host_memory_bytes=256 * GiB, host_source="--host-memory")
    assert roomy.fits and roomy.host is not None and roomy.host.fits
    short = estimate(job, host_memory_bytes=48 * GiB, host_source="--host-memory")
    assert not short.fits and short.fits_reason.startswith("host memory:")
    assert short.memory.peak.reserved == roomy.memory.peak.reserved  # the device's verdict is unchanged
    fitting = [s.change for s in short.suggestions if s.fits]
    assert fitting and all("NVMe" in change for change in fitting)
    unknown = estimate(job)
    assert unknown.fits and unknown.host is not None and unknown.host.available_bytes is None


def test_host_suggestions_hold_both_device_and_host():
    plan = Plan(zero=3, offload_optimizer="cpu", offload_params="cpu", precision="bf16-mixed")
    current = estimate_memory(L8, WORK, plan, "memplan").peak.reserved
    found = host_suggestions(L8, WORK, plan, "memplan", A100.capacity_bytes, current, 1, 32 * GiB)
    by = {s.change: s for s in found}
    both = by["optimizer states and parameters to NVMe (ZeRO-3)"]
    assert both.fits
    report = estimate_memory(L8, WORK, plan.model_copy(update={"offload_optimizer": "nvme", "offload_params": "nvme"}),
                             "memplan")  # fmt: skip
    assert report.offload.cpu <= 32 * GiB and both.reserved == report.peak.reserved


def test_one_gpu_advice_includes_the_nvme_tier():
    plan = Plan(precision="bf16-mixed")
    current = estimate_memory(L8, WORK, plan, "memplan").peak.reserved
    found = suggest(
        L8, WORK, plan, "memplan", A100.capacity_bytes, current, gpu=A100, cluster=ClusterSpec(gpus_per_node=1)
    )
    nvme = next(s for s in found if s.change.startswith("ZeRO-Infinity"))
    cpu = next(s for s in found if s.change.startswith("ZeRO-3 with parameters and optimizer on the CPU"))
    assert nvme.fits and cpu.fits
    assert nvme.step_time_s > cpu.step_time_s  # the NVMe traffic costs time: the CPU tier ranks first
    assert found.index(cpu) < found.index(nvme)


@pytest.mark.parametrize(("opt", "params"), [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")])
def test_the_nvme_term_is_the_bytes_over_the_node_bandwidth(opt, params):
    cluster = ClusterSpec(gpus_per_node=1)
    plan = Plan(zero=3, offload_optimizer=opt, offload_params=params, precision="bf16-mixed")
    t = estimate_time(L8, WORK, plan, A100, cluster)
    n = total_params(L8)
    moved = 2 * n * state_bytes_per_param("adamw", POLICIES["bf16-mixed"])
    if params == "nvme":
        moved += 3 * n * POLICIES["bf16-mixed"].param_bytes  # read for the forward and the backward, written once
    assert t.breakdown["nvme"] == pytest.approx(moved / cluster.nvme_bytes_per_s)
    cpu = estimate_time(L8, WORK, plan.model_copy(update={"offload_optimizer": "cpu", "offload_params": "cpu"}),
                        A100, cluster)  # fmt: skip
    assert "nvme" not in cpu.breakdown and t.step_time_s > cpu.step_time_s


def test_offloaded_parameters_cross_pcie_on_one_gpu_too():
    """ZeRO-3 with the parameters on the CPU on one GPU: the shards cross PCIe every forward and
    backward (the term was skipped with no data-parallel group, and overwritten beside the optimizer's)."""
    cluster = ClusterSpec(gpus_per_node=1)
    plan = Plan(zero=3, offload_optimizer="cpu", offload_params="cpu", precision="bf16-mixed")
    t = estimate_time(L8, WORK, plan, A100, cluster)
    n = total_params(L8)
    assert t.breakdown["param_offload"] == pytest.approx(2 * n * 4 / A100.pcie_bytes_per_s)
    assert t.breakdown["offload"] > 0  # the optimizer step's own PCIe traffic, beside it


def test_tunes_host_check_takes_the_trainers_paged_states_from_its_run():
    """``memplan tune --runtime hf`` checks the host with the op-level run's paged states where that run answers
    the plan: llama3-8b's ``paged-adamw-8bit`` pages 19.21 GB (the Trainer's ``register_module_override`` gives
    the embedding 32-bit states), not the closed form's 16.06 GB; a host between the two holds the closed form's
    and not the run's (the whole share spilled: no device headroom)."""
    from memplan.costmodel.timeline.hf_trainer import hf_plan_run
    from memplan.search.evaluate import Context, evaluate
    from memplan.search.space import Candidate
    from memplan.search.tune import host_fits, run_paged_bytes

    plan = Plan(precision="bf16", optimizer="paged-adamw-8bit")
    work = TrainingWorkload(seq_len=1024, micro_batch=1)
    phase = Context(L8, load_gpu("h100-sxm"), ClusterSpec(gpus_per_node=1))  # no Trainer: the closed form's
    ctx = Context(L8, phase.gpu, phase.cluster, runtime="hf")
    ev = evaluate(Candidate(plan, work), phase).model_copy(update={"headroom_bytes": 0})  # the host check reads
    # the plan, its workload and the headroom alone
    run = hf_plan_run(L8, work, plan)
    closed = estimate_memory(L8, work, plan, "hf").paged_optimizer_states
    assert run_paged_bytes(ev, ctx) == run.managed == 19_212_009_472
    embedding = L8.vocab_size * L8.hidden_size
    assert run.managed - closed == 2 * 3 * embedding  # two states, 4 bytes each instead of 1
    between = (closed + run.managed) // 2
    assert not host_fits(ev, ctx, between) and host_fits(ev, ctx, run.managed)
    assert run_paged_bytes(ev, phase) is None and host_fits(ev, phase, between)
