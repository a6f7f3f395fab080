"""bitsandbytes' paged optimizers (memplan.costmodel.optimizer): their state bytes, which of them
live in CUDA managed memory (outside the caching allocator) on CUDA, and what bitsandbytes does
with them on CPU (falls back to ordinary tensors: the same bytes, in the allocator)."""

from __future__ import annotations

import warnings

import pytest

from memplan.costmodel import optimizer as O
from memplan.costmodel.layout import stage_layout
from memplan.costmodel.memory import estimate_memory
from memplan.costmodel.precision import POLICIES
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

L8 = load_model("llama3-8b")
WORK = TrainingWorkload(seq_len=2048, micro_batch=1)
PAGED = ("paged-adamw-8bit", "paged-adamw-32bit", "paged-lion-8bit", "paged-lion-32bit")


def test_state_bytes_per_parameter():
    fp32 = POLICIES["bf16-mixed"]  # no master copy, bf16 states for torch's AdamW
    assert O.state_bytes_per_param("paged-adamw-8bit", fp32) == O.state_bytes_per_param("adamw-8bit", fp32)
    assert O.state_bytes_per_param("paged-adamw-8bit", fp32) == 2 * (1 + 4 / 256)
    assert O.state_bytes_per_param("paged-adamw-32bit", fp32) == 8  # fp32 states whatever the params' dtype
    assert O.state_bytes_per_param("paged-lion-8bit", fp32) == 1 + 4 / 256
    assert O.state_bytes_per_param("paged-lion-32bit", fp32) == 4
    master = POLICIES["bf16-master"]
    assert O.state_bytes_per_param("paged-adamw-32bit", master) == 8 + master.master_bytes
    assert [O.paged_bytes_per_param(o) for o in PAGED] == [2, 8, 1, 4]  # the absmaxes stay in the allocator
    assert O.paged_bytes_per_param("adamw-8bit") == 0 and not O.is_paged("adamw")


def test_lora_adapters_under_the_threshold_are_not_paged():
    """get_state_buffer pages a tensor of 1e5 elements or more: r=16 on llama3-8b's 4096-wide
    projections gives 65,536-element lora_A / lora_B (not paged); the MLP's 14,336-wide side is."""
    layout = stage_layout(L8, 1, 1, 1, 1, 0)
    qv = Plan(finetune="lora", lora_rank=16, optimizer="paged-adamw-8bit")
    assert O.paged_elements(L8, layout, qv) == 0
    mlp = Plan(finetune="lora", lora_rank=16, lora_targets=("gate_proj", "down_proj"), optimizer="paged-adamw-8bit")
    # gate_proj's lora_B (14336 x 16) and down_proj's lora_A (16 x 14336); the 4096-wide sides are not
    assert O.paged_elements(L8, layout, mlp) == 2 * 32 * 14336 * 16
    # r=64: q_proj's A and B and v_proj's A (64 x 4096 = 262,144) are paged, v_proj's B (1024 x 64) is not
    rank64 = Plan(finetune="lora", lora_rank=64, optimizer="paged-adamw-8bit")
    assert O.paged_elements(L8, layout, rank64) == 32 * 64 * 3 * 4096
    saved = Plan(finetune="lora", modules_to_save=("lm_head",), optimizer="paged-adamw-32bit")
    assert O.paged_state_bytes(L8, layout, saved) == 128256 * 4096 * 8


def test_full_training_pages_everything_but_the_norms():
    layout = stage_layout(L8, 1, 1, 1, 1, 0)
    plan = Plan(optimizer="paged-adamw-32bit")
    norms = 32 * 2 * 4096 + 4096
    assert O.paged_elements(L8, layout, plan) == layout.params - norms
    sharded = Plan(dp=8, zero=1, optimizer="paged-adamw-32bit")
    assert O.paged_elements(L8, layout, sharded) == (layout.params - norms) / 8
    offloaded = Plan(zero=1, offload_optimizer="cpu", optimizer="paged-adamw-32bit")
    assert O.paged_state_bytes(L8, layout, offloaded) == 0  # the host steps it: nothing is paged


@pytest.mark.parametrize(("paged", "plain"), [("paged-adamw-8bit", "adamw-8bit")])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_on_cuda_the_paged_states_leave_the_allocator_and_on_cpu_they_stay(paged, plain, finetune):
    extra = {"finetune": finetune, "lora_rank": 64} if finetune != "full" else {}
    a = Plan(precision="bf16-mixed", optimizer=plain, recompute="full", **extra)
    b = a.model_copy(update={"optimizer": paged})
    cuda_a, cuda_b = (estimate_memory(L8, WORK, p, "hf") for p in (a, b))
    moved = cuda_b.paged_optimizer_states
    layout = stage_layout(L8, 1, 1, 1, 1, 0)
    assert moved == O.paged_state_bytes(L8, layout, b) > 0
    assert cuda_a.paged_optimizer_states == 0
    assert cuda_a.model_states.optimizer_states - cuda_b.model_states.optimizer_states == moved
    assert cuda_a.peak.allocated - cuda_b.peak.allocated == moved
    cpu_a, cpu_b = (estimate_memory(L8, WORK, p, "hf", "cpu") for p in (a, b))
    assert cpu_b.paged_optimizer_states == 0
    assert cpu_a.peak.allocated == cpu_b.peak.allocated


def test_residency_is_what_the_headroom_holds():
    assert O.paged_residency(10, 30) == (10, 0)
    assert O.paged_residency(10, 4) == (4, 6)
    assert O.paged_residency(10, -5) == (0, 10)


@pytest.mark.parametrize(
    ("cls", "plain", "name"),
    [("PagedAdamW8bit", "AdamW8bit", "paged-adamw-8bit"), ("PagedAdamW32bit", "AdamW32bit", "paged-adamw-32bit"),
     ("PagedLion8bit", "Lion8bit", "paged-lion-8bit"), ("PagedLion32bit", "Lion32bit", "paged-lion-32bit")],
)  # fmt: skip
def test_bitsandbytes_on_cpu_falls_back_to_the_same_state_bytes(cls, plain, name):
    """bitsandbytes 0.50.2 on CPU: ``get_state_buffer`` warns "Paged optimizers are not supported
    on CPU" and returns ``torch.zeros_like``; the states it holds, counted by the suite's tracker,
    are the non-paged optimizer's to the byte and ``state_bytes_per_param`` per element (plus the
    256-entry fp32 quantization map of each 8-bit state)."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from tests.accuracy.storage_tracker import StorageTracker

    def states(opt_cls) -> tuple[int, list[str]]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(512, 256)), torch.nn.Parameter(torch.randn(4096))]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = opt_cls(params, lr=1e-3)
        tracker = StorageTracker()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracker:
                opt.step()
        seen: dict[int, int] = {}
        for p in params:
            for t in opt.state[p].values():
                if torch.is_tensor(t):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        assert not any(getattr(t, "is_paged", False) for p in params for t in opt.state[p].values())
        return sum(seen.values()), [str(w.message) for w in caught]

    paged, warned = states(getattr(bnb.optim, cls))
    unpaged, _ = states(getattr(bnb.optim, plain))
    assert paged == unpaged
    assert any("not supported on CPU" in w for w in warned)
    elements, count = 512 * 256 + 4096, 2 if "adamw" in name else 1
    qmaps = count * 256 * 4 if "8bit" in name else 0  # one quantization map per state
    blocks = count * (elements // 256) * 4 if "8bit" in name else 0  # an fp32 absmax per 256 values
    per = O.paged_bytes_per_param(name)
    assert paged == elements * per + blocks + qmaps


def test_the_step_time_charges_what_pages_beyond_the_headroom():
    from memplan.costmodel.time import estimate_time, paged_optimizer_s
    from memplan.specs.hardware import ClusterSpec
    from memplan.specs.loader import load_gpu

    a100, one = load_gpu("a100-80gb"), ClusterSpec(gpus_per_node=1)
    plan = Plan(precision="bf16-mixed", optimizer="paged-adamw-32bit")  # 60 GiB of fp32 states
    report = estimate_memory(L8, WORK, plan, "memplan")
    headroom = a100.capacity_bytes - report.overhead - report.peak.reserved
    _, spilled = O.paged_residency(report.paged_optimizer_states, headroom)
    assert spilled > 0
    seconds = paged_optimizer_s(L8, WORK, plan, a100, "memplan")
    assert seconds == pytest.approx(2 * spilled / a100.pcie_bytes_per_s)
    t = estimate_time(L8, WORK, plan, a100, one)
    assert t.breakdown["paged_optimizer"] == pytest.approx(seconds)
    unpaged = estimate_time(L8, WORK, plan.model_copy(update={"optimizer": "adamw"}), a100, one)
    assert "paged_optimizer" not in unpaged.breakdown


def test_a_card_too_small_for_the_states_is_advised_the_paged_optimizer():
    """phi3-mini in bf16 on an RTX 4090 does not fit with AdamW's states; paged 8-bit AdamW
    takes them out of the allocator and fits, with the flag tune needs to search it."""
    import io
    import json
    from contextlib import redirect_stderr, redirect_stdout

    from memplan.cli.app import run

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(["estimate", "phi3-mini", "--gpus", "1", "--gpu", "rtx-4090", "--precision", "bf16",
                    "--recompute", "full", "--format", "json"])  # fmt: skip
    assert code == 0, err.getvalue()
    data = json.loads(out.getvalue())
    assert not data["fits"]
    paged = next(s for s in data["suggestions"] if s["change"] == "paged 8-bit AdamW")
    assert paged["fits"] and paged["step_time_s"] > 0
    from memplan.search.advice import _flag

    assert _flag("paged 8-bit AdamW") == "--optimizer paged-adamw-8bit"
