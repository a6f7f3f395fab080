"""PEFT DoRA (``LoraConfig(use_dora=True)``) under the Trainer's FSDP2 (``timeline/hf_dora.py`` over
``hf_fsdp_peft.HfFsdpPeft``) against the real ``transformers.Trainer`` on CPU: rank 0 of two (or four) under torch's
fake process group (tests/accuracy/hf_fsdp_steps.py), the peak of live storages over three optimizer steps from
``trainer.train()`` on (the sharding included), equal to the byte.

What DoRA adds under FSDP2: each ``lora_magnitude_vector`` (a trained fp32 vector, one element per output feature,
registered after ``lora_B``) is one more parameter of its decoder layer's ``fully_shard`` group, sharded on dim 0
(padded to a multiple of the ranks), all-gathered with the adapters at the layer's forward (in bf16 under
``bf16=True``'s policy, with the adapters), and reduce-scattered with them; the weight norm reads the unsharded base
weight the group's all-gather made. Cases: fp32, bf16 and ``bf16=True`` (over fp32 and bf16 bases), ``full_shard``
and ``shard_grad_op``, the Trainer's checkpointing, accelerate's (``fsdp_config["activation_checkpointing"]``) and
torch's reentrant one, dropout, all linears, ``modules_to_save`` (``lm_head``, ``embed_tokens``), tied embeddings,
gradient accumulation, SGD, four ranks, the model loaded on the CPU (``cpu_ram_efficient_loading``), the dense
families, and QDoRA over 4-bit bases stored as the FSDP recipe's float dtype (nf4 / fp4, double quantization, the
usual recipe). Two Trainer cases run by default (a few seconds), the rest under ``-m slow``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

import hf_fsdp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402
from estimate_json import estimate_memory  # noqa: E402
from hf_predict import hf_predict  # noqa: E402
from test_timeline_hf_peft_families import _case as _family_case  # noqa: E402

from memplan.costmodel.timeline.events import ALLOC  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402

STEPS = 3
AL = ("all-linear",)
QDORA = dict(quant="nf4", quant_storage="bfloat16")  # the FSDP recipe: the packed weights stored as bf16, sharded
RECIPE = dict(**QDORA, dtype="bfloat16", double_quant=True, autocast=True, checkpointing=True)
# the Trainer's checkpointing kwargs under both names (gradient_checkpointing is activation_checkpointing's alias)
REENTRANT = {
    "gradient_checkpointing_kwargs": {"use_reentrant": True},
    "activation_checkpointing_kwargs": {"use_reentrant": True},
}
CPU_LOAD = {"cpu_ram_efficient_loading": True}


@dataclasses.dataclass(frozen=True)
class Run:
    """A case and how it runs: ``zero`` 3 (``full_shard``) or 2 (``shard_grad_op``), micro-batches a step, ranks,
    the plan's further fields, ``hf_fsdp_steps.run``'s further arguments, ``hf_predict``'s."""

    case: peft_steps.PeftCase
    zero: int = 3
    ga: int = 1
    dp: int = hf_fsdp_steps.WORLD
    plan: tuple = ()
    measure: tuple = ()
    predict: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.case.name}-z{self.zero}-ga{self.ga}-dp{self.dp}"


def _case(name: str, **fields) -> peft_steps.PeftCase:
    return peft_steps.PeftCase(f"hfdorafsdp-{name}", **{**peft_steps.TINY, "dora": True, **fields})


def _family(arch: str, **fields) -> peft_steps.PeftCase:
    return dataclasses.replace(_family_case(arch, "fsdp", dora=True, **fields), name=f"hfdorafsdp-{arch}")


FAST = [Run(_case("fp32-qv")), Run(_case("qdora-recipe", **RECIPE))]
SLOW = [
    Run(_case("fp32-qv"), zero=2),
    Run(_case("bf16-qv", dtype="bfloat16")),
    Run(_case("bf16-true-qv", autocast=True)),
    Run(_case("bf16-true-bf16-base", autocast=True, dtype="bfloat16")),
    Run(_case("fp32-ckpt", checkpointing=True)),
    Run(_case("bf16-true-ckpt", autocast=True, checkpointing=True)),
    Run(_case("bf16-ckpt", dtype="bfloat16", checkpointing=True), zero=2),
    Run(_case("fp32-dropout", dropout=0.1)),
    Run(_case("bf16-all-linear-dropout", dtype="bfloat16", dropout=0.1, targets=AL)),
    Run(_case("bf16-true-all-linear-dropout", autocast=True, dropout=0.1, targets=AL), zero=2),
    Run(_case("qwen2-attn", arch="qwen2", targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
    Run(
        _case("qwen2-bf16-true-bf16-attn", arch="qwen2", dtype="bfloat16", autocast=True, targets=("q_proj", "v_proj"))
    ),
    Run(_case("mistral-bf16", arch="mistral", dtype="bfloat16")),
    Run(_case("lm-head", modules_to_save=("lm_head",))),
    Run(_case("bf16-true-lm-head-ckpt", autocast=True, checkpointing=True, modules_to_save=("lm_head",))),
    Run(_case("embed", modules_to_save=("embed_tokens",))),
    Run(_case("tied", tied=True)),
    Run(_case("bf16-true-ckpt-ga2", autocast=True, checkpointing=True), zero=2, ga=2),
    Run(_case("fp32-ga2"), ga=2),
    Run(_case("fsdp-ac", checkpointing=True), measure=(("fsdp_ac", True),)),
    Run(_case("fsdp-ac-bf16-true-ga2", checkpointing=True, autocast=True), zero=2, ga=2, measure=(("fsdp_ac", True),)),
    Run(_case("reentrant", checkpointing=True), plan=(("use_reentrant", True),), measure=(("args_update", REENTRANT),)),
    Run(
        _case("reentrant-bf16-true-all-linear-dropout", checkpointing=True, autocast=True, dropout=0.1, targets=AL),
        plan=(("use_reentrant", True),),
        measure=(("args_update", REENTRANT),),
    ),
    Run(_case("sgd"), plan=(("optimizer", "sgd"),), measure=(("args_update", {"optim": "sgd"}),)),
    Run(_case("dp4"), dp=4),
    Run(_case("cpu-load"), measure=(("config", CPU_LOAD),), predict=(("host_load", True),)),
    Run(
        _case("cpu-load-bf16-true-all-linear", autocast=True, targets=AL),
        zero=2,
        measure=(("config", CPU_LOAD),),
        predict=(("host_load", True),),
    ),
    Run(_family("qwen3")),
    Run(_family("phi3")),
    Run(_family("olmo2", targets=AL)),
    Run(_family("gemma2")),
    Run(_family("gemma3", checkpointing=True)),
    Run(dataclasses.replace(_family("gemma3", dtype="bfloat16", targets=AL), name="hfdorafsdp-gemma3-bf16-all-linear")),
    Run(_case("qdora-qv", **QDORA)),
    Run(_case("qdora-fp4-all-linear-dropout", quant="fp4", quant_storage="bfloat16", targets=AL, dropout=0.1), zero=2),
    Run(_case("qdora-bf16-true", **QDORA, autocast=True)),
    Run(_case("qdora-bf16-model-dq", **QDORA, dtype="bfloat16", double_quant=True)),
    Run(_case("qdora-lm-head-ga2", **QDORA, modules_to_save=("lm_head",)), ga=2),
    Run(_case("qdora-recipe", **RECIPE), zero=2, ga=2),
    Run(_case("qdora-tied-bf16-true-dq", **QDORA, tied=True, autocast=True, double_quant=True)),
]


def _measure(run: Run) -> int:
    world = dict(world=run.dp, **dict(run.measure))
    return hf_fsdp_steps.run(run.case, run.ga, STEPS, reshard=run.zero >= 3, **world).peak


def _plan(run: Run):  # noqa: ANN202
    return peft_steps.plan_of(run.case).model_copy(update=dict(dp=run.dp, zero=run.zero, **dict(run.plan)))


def _predict(run: Run) -> int:
    return hf_predict(run.case, _plan(run), ga=run.ga, **dict(run.predict)).peak()[0]


@pytest.mark.parametrize("run", FAST, ids=lambda r: r.id)
def test_dora_under_fsdp2_equals_rank_0s_peak(run: Run) -> None:
    measured, predicted = _measure(run), _predict(run)
    assert predicted == measured, f"{run.id}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize("run", SLOW, ids=lambda r: r.id)
def test_dora_variants_under_fsdp2_equal_rank_0s_peak(run: Run) -> None:
    measured, predicted = _measure(run), _predict(run)
    assert predicted == measured, f"{run.id}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_magnitudes_are_sharded_with_their_layer() -> None:
    """Each ``lora_magnitude_vector`` of the real DoRA model is a parameter of its decoder layer; the run shards it
    as ``fully_shard`` does (dim 0 padded to a multiple of the ranks: q_proj's 64 features, 32 a rank; v_proj's 32,
    16), in fp32, after its ``lora_B``'s shard."""
    import hf_peft_steps

    run = FAST[0]
    events = [e for e in hf_predict(run.case, _plan(run)).events if e.op == ALLOC and e.tag.endswith(".shard")]
    magnitudes = {
        n.removeprefix("base_model.model."): p
        for n, p in hf_peft_steps.build(run.case).named_parameters()
        if "lora_magnitude_vector" in n
    }
    assert magnitudes and all(p.dim() == 1 and p.requires_grad for p in magnitudes.values())
    tags = [e.tag for e in events]
    for name, p in magnitudes.items():
        name = name.replace(".default.weight", ".weight")
        (shard,) = [e for e in events if e.tag == f"{name}.shard"]
        assert shard.size == -(-p.numel() // run.dp) * p.element_size()
        assert tags.index(f"{name}.shard") == tags.index(name.replace("lora_magnitude_vector", "lora_B") + ".shard") + 1


def test_estimate_answers_dora_under_fsdp2_op_level(capsys) -> None:
    """``memplan estimate --lora-dora --dp 2 --zero 3 --runtime hf``: op-level (refused before), the adapters' and
    magnitudes' optimizer states half the one-rank run's, and more than plain LoRA's (the magnitudes')."""
    args = ["llama3-8b", "--runtime", "hf", "--precision", "bf16", "--finetune", "lora", "--seq-len", "512"]
    one = estimate_memory(capsys, [*args, "--lora-dora"])
    two = estimate_memory(capsys, [*args, "--lora-dora", "--dp", "2", "--zero", "3"])
    lora = estimate_memory(capsys, [*args, "--dp", "2", "--zero", "3"])
    assert two["model"] == "op-level" and two["model_reason"] is None
    states = [m["model_states"]["optimizer_states"] for m in (one, two, lora)]
    assert abs(2 * states[1] - states[0]) <= 1024 and states[1] > states[2]
    assert two["peak"]["allocated"] > lora["peak"]["allocated"]


@pytest.mark.parametrize(
    ("plan", "reason"),
    [
        (dict(quant="int8"), "LLM.int8"),
        (dict(offload_activations="cpu"), "PEFT's DoRA over activation offload"),
    ],
)
def test_what_stays_refused_under_fsdp2_says_so_in_one_line(plan: dict, reason: str) -> None:
    from memplan.api import estimate

    full = {"finetune": "lora", "lora_dora": True, "dp": 2, "zero": 3, **plan}
    with pytest.raises(MemplanError) as err:
        estimate("llama3-8b", full, {"seq_len": 512}, runtime="hf", device="cpu")
    assert reason in str(err.value) and "\n" not in str(err.value)
