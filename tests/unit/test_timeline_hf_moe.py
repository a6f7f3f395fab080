"""The op-level run of ``transformers.Trainer`` over MoE models (``costmodel/timeline/hf_moe.py``: Mixtral,
Qwen3-MoE, Qwen2-MoE with its gated shared expert) against the real Trainer on CPU: tiny random models from
their config.json, full fine-tuning in fp32, bf16 and under ``bf16=True`` (over fp32 and over bf16 weights),
with and without gradient checkpointing, Qwen2/3-MoE with and without ``norm_topk_prob`` and with dense
layers (``mlp_only_layers``, ``decoder_sparse_step``), shapes where the experts' tensors (S = tokens x
top_k rows) and not the logits decide the peak; the peak of live storages over three steps
(``StorageTracker``, tests/accuracy/hf_steps.py's harness) equal to the byte on every case. As in
tests/unit/test_timeline_hf_families.py the run is compared with ``inplace_accumulate=False``, and with
``subclass_like=True``: under the tracker's dispatch mode two backward formulas write out of place
(``test_a_dispatch_mode_puts_index_and_topk_gradients_out_of_place``).

transformers runs the experts as ``grouped_mm`` (``hf_moe.py``): every tensor is sized by S whatever the
router picks, so the peak does not depend on the routing. ``test_the_routing_moves_no_bytes`` measures it:
the same Trainer run with every token sent to the same two experts and with the random router's spread.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)

from memplan.costmodel.timeline.hf_families import family_config  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_dims, hf_run  # noqa: E402
from memplan.specs.loader import load_model, model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# small vocabulary, several layers: the experts' activations and gradients, not the logits, dominate
SHAPE = dict(hidden=64, layers=3, heads=2, kv_heads=1, ffn=128, vocab=64, batch=2, seq=64)
MIXTRAL = (("num_local_experts", 4), ("num_experts_per_tok", 2))
QWEN3 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64), ("norm_topk_prob", True))
QWEN3_RAW = (*QWEN3[:3], ("norm_topk_prob", False))  # top-k scores not renormalised: no division
QWEN3_DENSE = (*QWEN3, ("mlp_only_layers", [1]))  # layer 1 keeps Qwen3MoeMLP (intermediate_size)
# Qwen2-MoE: the shared expert (96) wider than a routed one (32); norm_topk_prob off, its config's default
QWEN2 = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
QWEN2 += (("shared_expert_intermediate_size", 96),)
QWEN2_NORM = (*QWEN2, ("norm_topk_prob", True))
QWEN2_DENSE = (*QWEN2, ("mlp_only_layers", [0]), ("decoder_sparse_step", 2))  # layers 0 and 2 dense of 4


def _case(arch: str, tag: str, extra: tuple, slow: bool = False, **fields) -> hf_steps.Case:
    fields = {**SHAPE, **fields}
    return hf_steps.Case(f"hfmoe-{arch}-{tag}", arch=arch, loop="trainer", extra=extra, slow=slow, **fields)


BF16 = dict(dtype="bfloat16")
CASES = [
    _case("mixtral", "fp32", MIXTRAL),
    _case("mixtral", "bf16-ckpt", MIXTRAL, **BF16, checkpointing=True, layers=4, batch=1, seq=96),
    _case("mixtral", "autocast", MIXTRAL, autocast=True, layers=2),
    _case("qwen3_moe", "bf16", QWEN3, **BF16, seq=128, hidden=32, layers=2),
    _case("qwen3_moe", "raw-fp32-ckpt", QWEN3_RAW, checkpointing=True, layers=2),
    _case("qwen3_moe", "dense-fp32", QWEN3_DENSE),
    _case("qwen2_moe", "fp32", QWEN2),
    _case("qwen2_moe", "dense-autocast", QWEN2_DENSE, autocast=True, layers=4),
    _case("qwen2_moe", "norm-bf16-ckpt", QWEN2_NORM, **BF16, checkpointing=True),
    _case("mixtral", "bf16", MIXTRAL, slow=True, **BF16),
    _case("mixtral", "fp32-ckpt", MIXTRAL, slow=True, checkpointing=True),
    _case("mixtral", "bf16-autocast", MIXTRAL, slow=True, **BF16, autocast=True, layers=2),
    _case("mixtral", "top1-fp32", (("num_local_experts", 8), ("num_experts_per_tok", 1)), slow=True, seq=128),
    _case("qwen3_moe", "fp32", QWEN3, slow=True),
    _case("qwen3_moe", "bf16-ckpt", QWEN3, slow=True, **BF16, checkpointing=True),
    _case("qwen3_moe", "autocast-ckpt", QWEN3, slow=True, autocast=True, checkpointing=True, layers=2),
    _case("qwen3_moe", "bf16-autocast", QWEN3, slow=True, **BF16, autocast=True, layers=2),
    _case("qwen3_moe", "raw-bf16", QWEN3_RAW, slow=True, **BF16),
    _case("qwen3_moe", "dense-bf16-ckpt", (*QWEN3_DENSE, ("decoder_sparse_step", 2)), slow=True, **BF16, layers=4),
    _case("qwen2_moe", "norm-bf16", QWEN2_NORM, slow=True, **BF16, seq=128),
    _case("qwen2_moe", "fp32-ckpt", QWEN2, slow=True, checkpointing=True),
    _case("qwen2_moe", "autocast-ckpt", QWEN2_NORM, slow=True, autocast=True, checkpointing=True, layers=2),
    _case("qwen2_moe", "bf16-autocast", QWEN2, slow=True, **BF16, autocast=True, layers=2),
    _case("qwen2_moe", "dense-fp32", QWEN2_DENSE, slow=True, layers=4),
]


def predict(case: hf_steps.Case, dp: int = 1) -> int:
    """The run's peak for the case's config.json (its family read from it), on CPU's kernels, on one of
    ``dp`` ranks (DDP)."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    recompute = "full" if case.checkpointing else "none"
    plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, dp=dp)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert dp > 1 or hf_supported(model, plan, workload) is None, case.name
    # subclass_like: the tracker is a dispatch mode (hf_moe_ops.zeros_then_put)
    return hf_predict(case, plan, subclass_like=True).peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: hf_steps.Case) -> None:
    measured = hf_steps.measure_peak(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_cases_cover_both_families_precisions_and_checkpointing() -> None:
    for arch in ("mixtral", "qwen3_moe", "qwen2_moe"):
        mine = [c for c in CASES if c.arch == arch]
        assert {c.precision for c in mine} >= {"fp32", "bf16", "bf16-mixed"}
        assert any(c.checkpointing for c in mine) and any(not c.slow for c in mine)
    assert len({repr(dataclasses.astuple(c)[1:]) for c in CASES}) == len(CASES)  # extra may hold lists


# DDP over two gloo ranks (tests/accuracy/hf_ddp_steps.py, 10 s a case): rank 0's peak
DDP = ("hfmoe-mixtral-fp32", "hfmoe-mixtral-bf16-ckpt", "hfmoe-mixtral-autocast", "hfmoe-qwen3_moe-bf16")
DDP += ("hfmoe-qwen3_moe-raw-fp32-ckpt", "hfmoe-qwen2_moe-fp32", "hfmoe-qwen2_moe-dense-autocast")


@pytest.mark.slow
@pytest.mark.parametrize("name", DDP)
def test_ddp_equals_rank_0s_peak(name: str) -> None:
    import hf_ddp_steps

    case = next(c for c in CASES if c.name == name)
    measured = hf_ddp_steps.measure(case)
    predicted = predict(case, dp=hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_readers_take_transformers_5s_config_json() -> None:
    """transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts`` (its ``attribute_map``);
    ``norm_topk_prob`` as it is; Mixtral always renormalises."""
    qwen = _case("qwen3_moe", "reader", QWEN3).hf_config()
    assert "num_experts" not in qwen and qwen["num_local_experts"] == 8
    moe = model_from_data(qwen, "qwen/config.json", "qwen").moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_size, moe.norm_topk_prob) == (8, 2, 64, True)
    raw = model_from_data(_case("qwen3_moe", "raw", QWEN3_RAW).hf_config(), "raw/config.json", "raw").moe
    assert not raw.norm_topk_prob
    mixtral = model_from_data(_case("mixtral", "reader", MIXTRAL).hf_config(), "m/config.json", "m").moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (4, 2, True)


def test_the_qwen2_moe_reader_takes_the_shared_expert_norm_and_dense_layers() -> None:
    """Qwen2-MoE's config.json: the shared expert's width (its gate always built), ``norm_topk_prob``
    (off by default in ``Qwen2MoeConfig``), ``mlp_only_layers`` and ``decoder_sparse_step``; the layers
    the run keeps dense are those ``Qwen2MoeDecoderLayer`` builds ``Qwen2MoeMLP`` in."""
    cfg = _case("qwen2_moe", "reader", QWEN2_DENSE, layers=4).hf_config()
    model = model_from_data(cfg, "q2/config.json", "q2")
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_size, moe.norm_topk_prob) == (8, 2, 32, False)
    assert (moe.num_shared_experts, moe.shared_ffn_size, moe.shared_expert_gate) == (1, 96, True)
    assert family_config(model)["dense"] == (0, 2) and family_config(model)["shared_ffn"] == 96
    assert model_from_data(_case("qwen2_moe", "n", QWEN2_NORM).hf_config(), "n/config.json", "n").moe.norm_topk_prob
    real = transformers.Qwen2MoeConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    built = [type(layer.mlp).__name__ for layer in transformers.Qwen2MoeForCausalLM(real).model.layers]
    assert built == ["Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock"]


def _routing(model, ids) -> list[int]:
    """Top-k assignments per expert over every layer in one forward of ``ids`` (no tracker on)."""
    counts: list[int] = []

    def hook(module, args, out) -> None:
        per_expert = torch.bincount(out[2].flatten(), minlength=module.num_experts).tolist()
        counts[:] = [a + b for a, b in zip(counts or [0] * len(per_expert), per_expert, strict=True)]

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return counts


def test_the_routing_moves_no_bytes() -> None:
    """The real Trainer's peak with every token on the same two of four experts (zero router weights:
    tied scores) equals its peak under the random router's spread, and the run's. The learning rate
    is 0 in both so that the routing measured after the steps is the one they ran."""
    case = CASES[0]
    routes: dict[str, list[int]] = {}

    def prepare(skew: bool):
        def apply(model, args, ids) -> None:
            args.learning_rate = 0.0
            if skew:
                for layer in model.model.layers:
                    layer.mlp.gate.weight.data.zero_()
            routes["skew" if skew else "spread"] = _routing(model, ids)

        return apply

    spread = hf_steps._measure_trainer(case, STEPS, prepare(False))
    skewed = hf_steps._measure_trainer(case, STEPS, prepare(True))
    total = sum(routes["skew"])
    assert sorted(routes["skew"])[-2:] == [total // 2, total // 2]  # two experts take every token
    assert max(routes["spread"]) < 0.5 * total and min(routes["spread"]) > 0
    assert spread == skewed == predict(case), (spread, skewed)


def _backward_allocations(op, mode) -> list[int]:
    """The CPU allocator's allocations (torch.profiler, no dispatch mode of its own) in the backward of
    ``op`` over a 64 x 32 fp32 input (8192 B), under ``mode`` or none."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 32, requires_grad=True)
    y = op(x)
    seed = torch.ones_like(y)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with mode if mode is not None else contextlib.nullcontext():
            y.backward(seed)
    events = prof.profiler.kineto_results.events()
    return [e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() > 0]


@pytest.mark.parametrize("op", ["index", "topk"])
def test_a_dispatch_mode_puts_index_and_topk_gradients_out_of_place(op: str) -> None:
    """``index_backward`` and ``value_selecting_reduction_backward`` zero x's shape and write in place,
    one buffer (what ``Tape.subclass_like=False`` models, the GPU's case); under a dispatch mode (the CPU
    tracker) ``isTensorSubclassLike`` holds and they write into a second one."""
    from storage_tracker import StorageTracker

    rows = torch.arange(64).repeat(2)
    fn = (lambda x: x[rows]) if op == "index" else (lambda x: torch.topk(x, 4, dim=-1).values)
    assert _backward_allocations(fn, None) == [8192]
    assert _backward_allocations(fn, StorageTracker()) == [8192, 8192]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_estimate_answers_moe_op_level(capsys, name: str, precision: str) -> None:
    memory = _estimate(capsys, [name, "--runtime", "hf", "--precision", precision, "--seq-len", "1024"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"


BLOCK = "this MoE block"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _lora_case(tag: str, arch: str, extra: tuple, slow: bool = False, **fields):
    """A PEFT LoRA case over a tiny MoE model (tests/accuracy/peft_steps.py's harness)."""
    from peft_steps import TINY, PeftCase

    return PeftCase(f"hfmoe-lora-{arch}-{tag}", **{**TINY, "arch": arch, "extra": extra, "slow": slow, **fields})


MIXTRAL4 = (("num_local_experts", 4),)
LORA_CASES = [
    # q/v adapters over Mixtral: the frozen experts' grouped_mm keeps no input (428,544 B more if it did)
    ("qv-fp32", "mixtral", MIXTRAL, {}),
    ("attn-fp32", "qwen2_moe", QWEN2, {"targets": ATTN}),
    ("attn-bf16", "mixtral", MIXTRAL, {"targets": ATTN, "dtype": "bfloat16", "slow": True}),
    ("attn-fp32-ckpt", "mixtral", MIXTRAL, {"targets": ATTN, "checkpointing": True, "slow": True}),
    ("attn-autocast", "mixtral", MIXTRAL, {"targets": ATTN, "autocast": True, "slow": True}),
    ("save-head", "mixtral", MIXTRAL4, {"modules_to_save": ("lm_head",), "slow": True}),
    (
        "save-embed-ckpt",
        "mixtral",
        MIXTRAL4,
        {"modules_to_save": ("embed_tokens",), "checkpointing": True, "slow": True},
    ),
    ("attn-fp32", "qwen3_moe", QWEN3, {"targets": ATTN, "slow": True}),
    (
        "dense-bf16-ckpt",
        "qwen3_moe",
        QWEN3_DENSE,
        {"targets": ATTN, "dtype": "bfloat16", "checkpointing": True, "slow": True},
    ),
    (
        "dense-autocast-dropout",
        "qwen2_moe",
        QWEN2_DENSE,
        {"targets": ATTN, "autocast": True, "dropout": 0.1, "layers": 4, "slow": True},
    ),
]


@pytest.mark.parametrize(
    ("tag", "arch", "extra", "fields"),
    [pytest.param(*c, marks=[pytest.mark.slow] if c[3].get("slow") else [], id=f"{c[1]}-{c[0]}") for c in LORA_CASES],
)
def test_lora_on_attention_equals_the_trainers(tag: str, arch: str, extra: tuple, fields: dict) -> None:
    """PEFT LoRA on the attention linears of Mixtral, Qwen3-MoE and Qwen2-MoE under the real Trainer
    (tests/accuracy/hf_peft_steps.py), the frozen experts and router, equal to the byte."""
    pytest.importorskip("peft")
    import hf_peft_steps
    from peft_steps import plan_of

    case = _lora_case(tag, arch, extra, **fields)
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan, workload = plan_of(case), TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload) is None
    timeline = hf_predict(case, plan, subclass_like=True)
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), timeline.peak()[0]
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def _qwen2_moe():
    """A tiny Qwen2-MoE from its config.json (no bundled profile)."""
    return model_from_data(_case("qwen2_moe", "spec", QWEN2_DENSE, layers=4).hf_config(), "q2/config.json", "q2")


@pytest.mark.parametrize("moe", [{"dense_layers": (0, 5)}, {"layer_freq": 2}, {"dense_layers": (1,), "layer_freq": 3}])
def test_qwen3_moes_dense_layers_are_followed(moe: dict) -> None:
    """Qwen3-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``): the run's (every case of
    ``hfmoe-qwen3_moe-dense-*``), with the dense MLP's parameters in the layers the decoder keeps dense."""
    model = load_model("qwen3-30b-a3b")
    model = model.model_copy(update={"moe": model.moe.model_copy(update=moe), "num_layers": 6})
    plan, workload = Plan(precision="bf16"), TrainingWorkload(seq_len=512, micro_batch=1)
    assert hf_supported(model, plan, workload) is None
    extra = family_config(model)
    assert extra["dense"] == tuple(i for i in range(6) if not model.is_moe_layer(i)) and extra["dense"]
    from memplan.costmodel.timeline.hf_families import family
    from memplan.costmodel.timeline.hf_model import param_shapes
    from memplan.costmodel.timeline.hf_moe import layer_params, moe_sizes

    d, sparse = hf_dims(model, workload, plan), family("qwen3-moe")[1]
    shapes = param_shapes(d, False, False, layer_params("qwen3-moe", sparse, extra), moe_sizes(extra, d.h))
    dense = {i for i in range(6) if f"model.layers.{i}.mlp.gate_proj.weight" in shapes}
    assert dense == set(extra["dense"])
    assert all(f"model.layers.{i}.mlp.gate.weight" in shapes for i in range(6) if i not in dense)


def test_estimate_answers_a_tiny_qwen2_moe_op_level(capsys, tmp_path) -> None:
    """A Qwen2-MoE config.json with dense layers is answered by the run."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_case("qwen2_moe", "cli", QWEN2_DENSE, layers=4).hf_config()))
    memory = _estimate(capsys, [str(path), "--runtime", "hf", "--precision", "bf16", "--seq-len", "256"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None


@pytest.mark.slow
def test_estimate_answers_qwen2_moe_op_level(capsys) -> None:
    """Qwen1.5-MoE-A2.7B's config.json (60 experts, top-4, the 5632-wide gated shared expert) is answered
    by the run."""
    path = "tests/data/hf/qwen2-moe-a2.7b.json"
    memory = _estimate(capsys, [path, "--runtime", "hf", "--precision", "bf16", "--seq-len", "512"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["peak"]["reserved_detail"]["timeline"] == "hf"


@pytest.mark.parametrize(
    ("name", "moe", "plan", "reason"),
    [
        ("mixtral-8x7b", {"dense_layers": (0,)}, {}, BLOCK),  # MixtralDecoderLayer has no dense MLP
        ("mixtral-8x7b", {"layer_freq": 2}, {}, BLOCK),
        ("qwen3-30b-a3b", {"num_shared_experts": 1}, {}, BLOCK),
        ("mixtral-8x7b", {"router_bias": True}, {}, BLOCK),
        ("qwen2-moe", {"shared_expert_gate": False}, {}, BLOCK),  # Qwen2MoeSparseMoeBlock always gates it
        ("qwen2-moe", {"num_shared_experts": 2}, {}, BLOCK),
        ("qwen2-moe", {"router_bias": True}, {}, BLOCK),
        ("qwen3-30b-a3b", {}, {"finetune": "lora", "lora_targets": ("up_proj",)}, "PEFT over the qwen3-moe family"),
        ("mixtral-8x7b", {}, {"dp": 2, "ep": 2}, "more than one rank (tensor, pipeline, context or expert)"),
        ("mixtral-8x7b", {}, {"finetune": "lora", "lora_targets": ("down_proj",)}, "PEFT over the mixtral family"),
        ("qwen3-30b-a3b", {}, {"finetune": "lora", "lora_targets": ("q_proj", "gate_proj")}, "PEFT over the qwen3"),
        ("mixtral-8x7b", {}, {"finetune": "qlora", "quant": "nf4"}, "a quantized MoE base"),
        ("deepseek-v2-lite", {}, {"dp": 2, "zero": 1}, "ZeRO over more than one rank at stage 1"),  # DDP, FSDP2 run
        ("llama4-scout", {}, {}, "the llama4 family"),
    ],
)
def test_a_moe_plan_the_run_does_not_follow_stays_on_the_phase_model(
    name: str, moe: dict, plan: dict, reason: str
) -> None:
    model = _qwen2_moe() if name == "qwen2-moe" else load_model(name)
    model = model.model_copy(update={"moe": model.moe.model_copy(update=moe)})
    workload = TrainingWorkload(seq_len=512, micro_batch=1)
    why = hf_supported(model, Plan(precision="bf16", **plan), workload)
    assert why is not None and why.startswith(reason), why


def test_cuda_bf16_grouped_mm_allocates_its_argument_buffer() -> None:
    """On an H100 (compute capability 9.0) each bf16 ``grouped_mm`` call allocates CUTLASS's argument
    buffer (``hf_moe_ops.cutlass_args_bytes``: 480 B for 8 experts) and frees it; on an A100 (8.0) the
    fallback allocates none."""
    from memplan.costmodel.gemm_4bit_rule import CudaArch
    from memplan.costmodel.timeline.hf_moe_ops import GROUPED_MM_ARGS, cutlass_args_bytes

    model = load_model("mixtral-8x7b").model_copy(update={"num_layers": 2})
    plan, workload = Plan(precision="bf16"), TrainingWorkload(seq_len=256, micro_batch=1)
    sizes = {}
    for arch in (CudaArch(132, 9, 0), CudaArch(108, 8, 0)):
        d = hf_dims(model, workload, plan)
        timeline = hf_run(d, False, "flash", steps=1, arch="mixtral", extra=family_config(model, arch))
        sizes[arch.major] = [e.size for e in timeline if e.tag.endswith(GROUPED_MM_ARGS)]
    assert cutlass_args_bytes(8) == 480
    # two products a layer forward, two each backward (weight, input): 6 per layer, 2 layers, allocs and frees
    assert sizes[9] == [480] * 24 and sizes[8] == []


def _lora_peak(case, dp: int = 1) -> int:
    """The run's peak for a PEFT LoRA case over a tiny MoE model, on one of ``dp`` ranks (DDP)."""
    from peft_steps import plan_of

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = plan_of(case).model_copy(update={"dp": dp})
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload) is None, case.name
    return hf_predict(case, plan, subclass_like=True).peak()[0]


# LoRA on the attention linears under DDP over two gloo ranks (tests/accuracy/hf_ddp_steps.py; a PeftModel
# is no PreTrainedModel, so the Trainer passes find_unused_parameters=True: hf_ddp.py)
LORA_DDP = [
    ("qv-fp32", "mixtral", MIXTRAL, {}),
    ("attn-fp32", "qwen2_moe", QWEN2, {"targets": ATTN}),
    ("dense-bf16-ckpt", "qwen3_moe", QWEN3_DENSE, {"targets": ATTN, "dtype": "bfloat16", "checkpointing": True}),
    ("autocast-save-head", "mixtral", MIXTRAL4, {"targets": ATTN, "autocast": True, "modules_to_save": ("lm_head",)}),
    ("all-linear-dense-bf16", "qwen2_moe", QWEN2_DENSE, {"targets": ("all-linear",), "dtype": "bfloat16", "layers": 4}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("tag", "arch", "extra", "fields"), LORA_DDP, ids=[f"{c[1]}-{c[0]}" for c in LORA_DDP])
def test_lora_under_ddp_equals_rank_0s_peak(tag: str, arch: str, extra: tuple, fields: dict) -> None:
    pytest.importorskip("peft")
    import hf_ddp_steps

    case = _lora_case(f"ddp-{tag}", arch, extra, **fields)
    measured, predicted = hf_ddp_steps.measure(case), _lora_peak(case, hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# Qwen2-MoE's linears beyond the attention: PEFT 0.21.2 takes gate/up/down_proj as its shared expert's and dense
# layers' nn.Linear (transformers 5.23 converts no Qwen2-MoE names), and all-linear adds shared_expert_gate (one
# output); the router and the 3-D experts stay frozen (test_peft_wraps_what_the_run_follows)
MLP = ("gate_proj", "up_proj", "down_proj")
QWEN2_LINEAR_CASES = [
    ("mlp-dense-fp32", QWEN2_DENSE, {"targets": MLP, "layers": 4}),
    ("all-linear-bf16-ckpt", QWEN2, {"targets": ("all-linear",), "dtype": "bfloat16", "checkpointing": True}),
    ("all-linear-dense-autocast", QWEN2_DENSE, {"targets": ("all-linear",), "autocast": True, "layers": 4}),
    ("q-down-dropout-fp32", QWEN2, {"targets": ("q_proj", "down_proj"), "dropout": 0.1}),
]


@pytest.mark.parametrize(
    ("tag", "extra", "fields"),
    [pytest.param(*c, marks=[pytest.mark.slow] if i else [], id=c[0]) for i, c in enumerate(QWEN2_LINEAR_CASES)],
)
def test_lora_on_qwen2_moes_linears_equals_the_trainers(tag: str, extra: tuple, fields: dict) -> None:
    pytest.importorskip("peft")
    import hf_peft_steps

    case = _lora_case(tag, "qwen2_moe", extra, **fields)
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), _lora_peak(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize(
    ("arch", "extra", "targets", "linears", "wrapped"),
    [
        ("qwen2_moe", QWEN2_DENSE, MLP, {"shared_expert.gate_proj", "mlp.gate_proj"}, set()),
        ("qwen2_moe", QWEN2, ("all-linear",), {"shared_expert_gate", "q_proj", "shared_expert.down_proj"}, set()),
        ("qwen3_moe", QWEN3_DENSE, MLP, set(), {"mlp.experts"}),
        ("mixtral", MIXTRAL, ("all-linear",), {"q_proj"}, {"mlp.experts", "mlp.gate"}),
    ],
)
def test_peft_wraps_what_the_run_follows(arch: str, extra: tuple, targets: tuple, linears: set, wrapped: set) -> None:
    """What ``get_peft_model`` builds for the targets (``check_moe_lora``'s reasons): nn.Linear adapters
    (``lora.Linear``) on Qwen2-MoE's shared expert and dense MLP, none on its router or experts; on Qwen3-MoE
    the MLP names move to the experts' 3-D parameters (``lora.ParamWrapper``), its dense layer's MLP untouched;
    Mixtral's all-linear wraps the experts and the router."""
    peft = pytest.importorskip("peft")
    from peft_steps import build

    case = _lora_case("wraps", arch, extra, targets=targets, layers=2 if arch != "qwen2_moe" else 4)
    kinds: dict[str, set[str]] = {"Linear": set(), "ParamWrapper": set()}
    for name, module in build(case).named_modules():
        for kind in kinds:
            if isinstance(module, getattr(peft.tuners.lora, kind)) and ".base_layer" not in name:
                kinds[kind].add(name)
    assert all(any(n.endswith(s) for n in kinds["Linear"]) for s in linears), kinds["Linear"]
    assert {".".join(n.split(".")[-2:]) for n in kinds["ParamWrapper"]} == wrapped
    if arch == "qwen2_moe":
        assert not any(".experts" in n or n.endswith("mlp.gate") for n in kinds["Linear"])
    if arch == "qwen3_moe":  # layer 1 keeps Qwen3MoeMLP, whose gate/up/down_proj PEFT no longer targets
        assert not kinds["Linear"]


# Qwen3-MoE's experts under PEFT 0.21.2's ParamWrapper (timeline/hf_moe_lora.py): the MLP names moved to the experts'
# 3-D gate_up_proj (twice the rank) and down_proj, each forward's parametrized weight (a whole expert stack) saved
QWEN3_EXPERT_CASES = [
    ("experts-fp32", QWEN3, {"targets": MLP}),
    ("experts-bf16-ckpt", QWEN3, {"targets": MLP, "dtype": "bfloat16", "checkpointing": True}),
    ("experts-autocast-ckpt", QWEN3, {"targets": MLP, "autocast": True, "checkpointing": True}),
    ("down-fp32", QWEN3, {"targets": ("down_proj",)}),
    ("gate-up-bf16", QWEN3, {"targets": ("gate_proj", "up_proj"), "dtype": "bfloat16"}),
    ("qv-experts-dense-fp32", QWEN3_DENSE, {"targets": ("q_proj", "v_proj", *MLP)}),
    ("experts-dense-bf16-ckpt", QWEN3_DENSE, {"targets": MLP, "dtype": "bfloat16", "checkpointing": True}),
]


@pytest.mark.parametrize(
    ("tag", "extra", "fields"),
    [pytest.param(*c, marks=[pytest.mark.slow] if i else [], id=c[0]) for i, c in enumerate(QWEN3_EXPERT_CASES)],
)
def test_lora_on_qwen3_moes_experts_equals_the_trainers(tag: str, extra: tuple, fields: dict) -> None:
    pytest.importorskip("peft")
    import hf_peft_steps

    case = _lora_case(tag, "qwen3_moe", extra, **fields)
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), _lora_peak(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
def test_lora_on_qwen3_moes_experts_under_ddp_equals_rank_0s_peak() -> None:
    pytest.importorskip("peft")
    import hf_ddp_steps

    case = _lora_case("ddp-experts-bf16", "qwen3_moe", QWEN3_DENSE, targets=("q_proj", *MLP), dtype="bfloat16")
    measured, predicted = hf_ddp_steps.measure(case), _lora_peak(case, hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# all-linear over Mixtral and Qwen3-MoE: the attention's lora.Linear, ParamWrapper on the experts and on the router's
# 2-D weight (hf_moe_lora.router_delta: B @ A under the Trainer's autocast too, W + delta read by the router's F.linear)
ALL_LINEAR_CASES = [
    ("all-linear-fp32", "mixtral", MIXTRAL, {}),
    ("all-linear-bf16", "mixtral", MIXTRAL, {"dtype": "bfloat16"}),
    ("all-linear-autocast", "mixtral", MIXTRAL, {"autocast": True}),
    ("bf16-autocast-ckpt", "mixtral", MIXTRAL4, {"dtype": "bfloat16", "autocast": True, "checkpointing": True}),
    ("all-linear-dense-fp32", "qwen3_moe", QWEN3_DENSE, {}),
    ("all-linear-dense-autocast-ckpt", "qwen3_moe", QWEN3_DENSE, {"autocast": True, "checkpointing": True}),
    ("all-linear-bf16-save-head", "qwen3_moe", QWEN3, {"dtype": "bfloat16", "modules_to_save": ("lm_head",)}),
]


@pytest.mark.parametrize(
    ("tag", "arch", "extra", "fields"),
    [
        pytest.param(*c, marks=[pytest.mark.slow] if i else [], id=f"{c[1]}-{c[0]}")
        for i, c in enumerate(ALL_LINEAR_CASES)
    ],
)
def test_all_linear_over_mixtral_and_qwen3_moe_equals_the_trainers(tag: str, arch: str, extra: tuple, fields: dict):
    pytest.importorskip("peft")
    import hf_peft_steps

    case = _lora_case(tag, arch, extra, targets=("all-linear",), **fields)
    measured, predicted = hf_peft_steps.measure(case, steps=STEPS), _lora_peak(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
def test_all_linear_over_mixtral_under_ddp_equals_rank_0s_peak() -> None:
    pytest.importorskip("peft")
    import hf_ddp_steps

    case = _lora_case("ddp-all-linear", "mixtral", MIXTRAL, targets=("all-linear",), autocast=True)
    measured, predicted = hf_ddp_steps.measure(case), _lora_peak(case, hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"
