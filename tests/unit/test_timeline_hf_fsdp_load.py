"""The Trainer's FSDP2 over a model loaded on the CPU (``timeline/hf_fsdp_load.py``, ``model_build: to_device``,
the default of ``hf`` FSDP plans): accelerate's ``cpu_ram_efficient_loading`` as memplan's exports write it.

On CPU (rank 0 of two or three under the fake process group, tests/accuracy/hf_fsdp_steps.py) the real Trainer
with ``fsdp_config["cpu_ram_efficient_loading"]`` is held against the run: its peak to the byte, and the load's
allocations (``fsdp2_load_full_state_dict``: the padded copies of short chunks, ``constant_pad_nd``, and each
shard, ``empty_like``) in order and size. On CPU the full parameters are the loaded model itself; the full copy
each key puts on the GPU is from accelerate's source (``.full``), checked here for what the run does with it:
one at a time, so the build's GPU peak is the shards plus one parameter, and the steps are the same run's.
"""

from __future__ import annotations

import json

import pytest
from hf_predict import hf_predict

from memplan.costmodel.timeline.events import ALLOC, FREE, MARK
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan

LOADED = ("constant_pad_nd.default", "empty_like.default")  # the load's allocations, as the tracker names them


def _run(case, zero: int, dp: int, host: bool = True, kernel: str = "cpu_flash", steps: int = 3):  # noqa: ANN001, ANN202
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, dp=dp, zero=zero)
    return hf_predict(case, plan, steps=steps, host_load=host, kernel=kernel)


def _loaded(timeline) -> list[int]:  # noqa: ANN001
    """The sizes of the run's load: each key's chunk pads and shard."""
    tags = (".chunk_pad", ".shard")
    return [e.size for e in timeline.events if e.op == ALLOC and e.tag.endswith(tags)]


def _check(case, zero: int, dp: int) -> None:  # noqa: ANN001
    hf_fsdp_steps = pytest.importorskip("hf_fsdp_steps")
    config = {"cpu_ram_efficient_loading": True}
    measured = hf_fsdp_steps.run(case, steps=3, reshard=zero == 3, world=dp, log=True, config=config)
    timeline = _run(case, zero, dp)
    predicted = _loaded(timeline)
    loads = [size for _, size, op, _ in measured.events if op in LOADED][: len(predicted)]
    assert loads == predicted, f"{case.name}: the load's allocations differ"
    assert timeline.peak()[0] == measured.peak


def _case(name: str, **fields):  # noqa: ANN202
    hf_steps = pytest.importorskip("hf_steps")
    return hf_steps.Case(f"hffsdp-load-{name}", loop="trainer", **{**hf_steps.BASE_SMALL, **fields})


def test_the_cpu_load_equals_rank_0s_shards_and_peak() -> None:
    """Three ranks over rows they do not divide (4000, 32, 260): each short chunk padded, then the shard."""
    pytest.importorskip("accelerate")
    _check(_case("uneven", hidden=96, heads=3, kv_heads=1, ffn=260), 2, 3)


@pytest.mark.parametrize(
    ("fields", "zero", "dp"),
    [({}, 3, 2), ({"tied": True}, 3, 2), ({"autocast": True}, 3, 2), ({"checkpointing": True, "tied": True}, 2, 2)],
)
def test_cpu_load_variants_equal_rank_0s_shards_and_peak(fields: dict, zero: int, dp: int) -> None:
    """A tied model (its head's own key loaded, then let go), ``bf16=True`` (the fp32 upcast shards)."""
    pytest.importorskip("accelerate")
    _check(_case("-".join(fields) or "fp32", **fields), zero, dp)


@pytest.mark.parametrize(("fields", "zero", "dp"), [({"targets": ("all-linear",)}, 2, 3), ({"tied": True}, 3, 2)])
def test_a_lora_cpu_load_equals_rank_0s_shards_and_peak(fields: dict, zero: int, dp: int) -> None:
    """PEFT LoRA in fp32: the frozen base's keys and each adapter's (``lora_A``, ``lora_B`` after its
    ``base_layer``) loaded in ``state_dict()`` order."""
    pytest.importorskip("accelerate")
    hf_fsdp_steps, peft_steps = pytest.importorskip("hf_fsdp_steps"), pytest.importorskip("peft_steps")

    case = peft_steps.PeftCase("hffsdp-load-lora", **{**peft_steps.TINY, **fields})
    plan = peft_steps.plan_of(case).model_copy(update=dict(dp=dp, zero=zero))
    timeline = hf_predict(case, plan, host_load=True)
    config = {"cpu_ram_efficient_loading": True}
    measured = hf_fsdp_steps.run(case, steps=3, reshard=zero == 3, world=dp, log=True, config=config)
    predicted = _loaded(timeline)
    assert [size for _, size, op, _ in measured.events if op in LOADED][: len(predicted)] == predicted
    assert timeline.peak()[0] == measured.peak


@pytest.mark.parametrize("tied", [False, True])
def test_on_cuda_the_build_holds_the_shards_and_one_full_parameter(tied: bool) -> None:
    """On CUDA nothing of the model is on the GPU before ``prepare``; the load holds one full fp32 parameter
    (``bf16=True`` upcast it on the host) beside the shards; the steps are the run's over the GPU-loaded
    model, event for event."""
    case = _case("cuda", dtype="bfloat16", autocast=True, tied=tied)
    host, device = (_run(case, 3, 2, host, "flash", steps=1) for host in (True, False))
    live = best = 0
    fulls = []
    for e in host.events:
        if e.op == MARK and e.tag == "build":
            break
        live += e.size if e.op == ALLOC else -e.size if e.op == FREE else 0
        best = max(best, live)
        if e.op == ALLOC and e.tag.endswith(".full"):
            fulls.append(e.size)
    shards = sum(_loaded(host)[: len(fulls)])
    assert fulls and max(fulls) == 4000 * 128 * 4
    keys = [e.tag for e in host.events if e.op == ALLOC and e.tag.endswith(".full")]
    assert len(fulls) == len(_loaded(host)) == 21  # a tied model: 20 parameters, the head's key loaded again
    assert keys[-1].endswith("lm_head.weight.full")
    assert best <= shards + max(fulls) + 4096  # the buffers and tr_loss beside them
    first = next(e for e in host.events if e.op == ALLOC)
    assert first.tag.endswith("embed_tokens.weight.full")

    def steps(timeline) -> list[tuple]:  # noqa: ANN001
        at = next(i for i, e in enumerate(timeline.events) if e.op == MARK and e.tag == "build")
        return [(e.op, e.size, e.tag) for e in timeline.events[at:]]

    assert steps(host) == steps(device)


def _estimate(capsys, args: list[str]) -> dict:
    from memplan.cli.app import run

    code = run(["estimate", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_an_hf_fsdp_plan_loads_on_the_cpu_by_default(capsys) -> None:
    """``--runtime hf --dp 2 --zero 3`` resolves ``model_build: to_device`` (shown in the plan) and replays the
    CPU load: its peak no higher than the GPU-loaded build's, which ``--model-build from_pretrained`` still
    gives; without FSDP, or over a quantized base, the default stays ``from_pretrained``."""
    args = ["llama3-8b", "--runtime", "hf", "--gpus", "8", "--zero", "3", "--recompute", "full", "--seq-len", "2048"]
    cpu = _estimate(capsys, args)
    gpu = _estimate(capsys, [*args, "--model-build", "from_pretrained"])
    assert (cpu["plan"]["model_build"], gpu["plan"]["model_build"]) == ("to_device", "from_pretrained")
    assert cpu["memory"]["model"] == gpu["memory"]["model"] == "op-level"
    assert cpu["memory"]["peak"]["allocated"] < gpu["memory"]["peak"]["allocated"]
    assert cpu["memory"]["peak"]["phase"] != "setup"
    for other in (["--gpus", "8", "--zero", "0"], ["--gpus", "8", "--zero", "3", "--finetune", "qlora"]):
        plan = _estimate(capsys, ["llama3-8b", "--runtime", "hf", *other])["plan"]
        assert plan["model_build"] == "from_pretrained"


@pytest.mark.parametrize(("build", "efficient"), [(None, True), ("from_pretrained", False)])
def test_the_fsdp_exports_load_as_the_plan_does(build: str | None, efficient: bool) -> None:
    """``cpu_ram_efficient_loading`` in the hf-trainer, accelerate and axolotl exports follows the plan's
    build: on by default, off (with each rank's device_map) for an hf plan given ``from_pretrained``."""
    import yaml

    from memplan.export import render
    from memplan.specs.resolve import job_from

    flags = dict(gpus=2, zero=3, precision="bf16-mixed", runtime="hf", seq_len=1024, micro_batch=1)
    job = job_from(load_model("llama3-8b"), None, None, {**flags, "model_build": build})
    trainer = render(job, "hf-trainer", sharding="fsdp")
    assert yaml.safe_load(trainer.text)["training_arguments"]["fsdp_config"]["cpu_ram_efficient_loading"] is efficient
    assert any("device_map" in note for note in trainer.notes) is not efficient
    fsdp = yaml.safe_load(render(job, "accelerate").text)["fsdp_config"]
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is fsdp["fsdp_sync_module_states"] is efficient
    assert yaml.safe_load(render(job, "axolotl", sharding="fsdp").text)["fsdp_config"]["cpu_ram_efficient_loading"] is (
        efficient
    )


def test_advice_resolves_a_default_build_again() -> None:
    """A changed plan (advice, its check) takes the build its own default gives where the plan's was the
    default: DDP -> FSDP loads on the CPU, FSDP -> a 4-bit base with a device_map (no error); a build given
    otherwise stays."""
    from memplan.specs.loader import load_model
    from memplan.specs.plan import changed_plan, fsdp_build

    m = load_model("llama3-8b")
    ddp, fsdp = Plan(dp=8), fsdp_build(Plan(dp=8, zero=3), (), "hf", m)
    assert fsdp.model_build == "to_device"
    assert changed_plan(ddp, {"zero": 3}, "hf", m).model_build == "to_device"
    assert changed_plan(ddp, {"zero": 3}, "memplan", m).model_build == "from_pretrained"
    qlora = changed_plan(fsdp, {"finetune": "lora", "quant": "nf4"}, "hf", m)
    assert (qlora.quant, qlora.model_build) == ("nf4", "from_pretrained")
    given = Plan(dp=8, zero=3, model_build="from_pretrained")
    assert changed_plan(given, {"zero": 2}, "hf", m).model_build == "from_pretrained"
    assert changed_plan(Plan(dp=8, model_build="to_device"), {"recompute": "full"}, "hf", m).model_build == "to_device"


def test_deepseek_v3_defaults_to_the_load_the_trainer_can_run() -> None:
    """accelerate's cpu_ram_efficient_loading cannot shard V3's routers' score-correction buffer (the real
    Trainer raises, tests/unit/test_timeline_hf_fsdp_mla.py): its FSDP plans default to from_pretrained and
    the exporters write no CPU load; given explicitly, the CPU load is refused in one line."""
    from memplan.specs.loader import load_model
    from memplan.specs.plan import changed_plan, cpu_loadable, fsdp_build

    v3, v2 = load_model("deepseek-v3"), load_model("deepseek-v2-lite")
    assert not cpu_loadable(v3) and cpu_loadable(v2)
    assert fsdp_build(Plan(dp=8, zero=3), (), "hf", v3).model_build == "from_pretrained"
    assert fsdp_build(Plan(dp=8, zero=3), (), "hf", v2).model_build == "to_device"
    assert changed_plan(Plan(dp=8), {"zero": 3}, "hf", v3).model_build == "from_pretrained"
    import yaml

    from memplan import api
    from memplan.errors import MemplanError
    from memplan.export import render
    from memplan.specs.resolve import job_from

    flags = dict(gpus=8, zero=3, precision="bf16-mixed", runtime="hf", seq_len=1024, micro_batch=1)
    flags_workload = {"seq_len": 1024, "micro_batch": 1, "global_batch": 8}
    job = job_from(v3, None, None, flags)
    assert job.plan.model_build == "from_pretrained"
    trainer = render(job, "hf-trainer", sharding="fsdp")
    assert yaml.safe_load(trainer.text)["training_arguments"]["fsdp_config"]["cpu_ram_efficient_loading"] is False
    with pytest.raises(MemplanError, match="cpu_ram_efficient_loading"):
        lora = {"finetune": "lora", "lora_targets": ["q_a_proj"], "model_build": "to_device"}
        api.estimate(v3, plan={"dp": 8, "zero": 3, **lora}, workload=flags_workload, runtime="hf")
