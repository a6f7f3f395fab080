"""The op-level run of ``transformers.Trainer`` over a PEFT LoRA / QLoRA model of the families beyond Llama's
layout (``timeline/hf_lora.py`` over ``timeline/hf_families.py`` and ``hf_gemma.py``: Qwen3, Phi-3, OLMo 2,
Gemma 2, Gemma 3) against the real Trainer on CPU: the peak of live storages over three optimizer steps,
counted by ``StorageTracker`` (tests/accuracy/hf_peft_steps.py), equal to the byte on every case.

Each family has one case in the default run (a few seconds each) and the rest under ``-m slow``: adapters on
q/v (Phi-3: the fused ``qkv_proj``), all-linear, dropout, ``modules_to_save`` (lm_head over Gemma's tied
embeddings: an untied copy), a bf16 base, the Trainer's ``bf16=True`` over fp32 and over a bf16 base,
gradient checkpointing, and a 4-bit base (nf4, double quantization, under the usual ``bf16=True`` recipe).
The family shapes are tests/accuracy/family_steps.py's (Gemma's head_dim and windows, the sequence short of
Gemma 3's window) at tests/accuracy/peft_steps.py's tiny sizes. As in test_timeline_hf_peft.py the run is
compared with ``inplace_accumulate=False`` (the tracker holds each storage's Python object).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
from hf_predict import hf_predict  # noqa: E402
from peft_steps import TINY, PeftCase, plan_of  # noqa: E402

from memplan.costmodel.timeline.hf_lora import HfLoraConfig  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# family_steps.py's family keys at peft_steps' tiny sizes (head_dim 32 over hidden 64); Gemma 3's window (128)
# beyond the sequence (64): transformers passes SDPA no mask; Gemma 2's eager attention masks at any window
GEMMA = (("head_dim", 32), ("query_pre_attn_scalar", 32))
EXTRA = {
    "qwen3": (("head_dim", 32),),
    "olmo2": (),
    "phi3": (("pad_token_id", 0),),  # its default pad id 32000 is outside the vocabulary
    "gemma2": (*GEMMA, ("sliding_window", 32)),
    "gemma3": (*GEMMA, ("sliding_window", 128)),
}
QV = {"phi3": ("qkv_proj",)}  # Phi-3's attention is one fused linear (PEFT matches q_proj nowhere)


def _case(arch: str, tag: str, slow: bool = True, **fields) -> PeftCase:
    base = dict(TINY, arch=arch, extra=EXTRA[arch], targets=QV.get(arch, ("q_proj", "v_proj")))
    if arch.startswith("gemma"):
        base["tied"] = True  # Gemma's configs tie the head to the embedding
    return PeftCase(f"hfpeftfam-{arch}-{tag}", **{**base, "slow": slow, **fields})


FAMILIES = tuple(EXTRA)
LM_HEAD = ("lm_head",)
# the usual QLoRA recipe: a bf16 base in nf4 with double quantization, bf16 compute, bf16=True, checkpointing
QLORA_RECIPE = dict(quant="nf4", double_quant=True, dtype="bfloat16", autocast=True, checkpointing=True)
CASES = [
    # the default run: one case per family
    _case("qwen3", "fp32-qv", slow=False),
    _case("phi3", "fp32-qkv", slow=False),
    _case("olmo2", "fp32-all-linear", slow=False, targets=("all-linear",)),
    _case("gemma2", "fp32-qv", slow=False),
    _case("gemma3", "fp32-qv", slow=False),
    # -m slow: the adapters, the dtypes, checkpointing, trained copies and 4-bit bases over each family
    *(_case(arch, "all-linear-dropout", targets=("all-linear",), dropout=0.1) for arch in FAMILIES),
    *(_case(arch, "bf16-ckpt", dtype="bfloat16", checkpointing=True) for arch in FAMILIES),
    *(
        _case(arch, "autocast-ckpt-save-head", autocast=True, checkpointing=True, modules_to_save=LM_HEAD)
        for arch in FAMILIES
    ),
    *(
        _case(arch, "autocast-bf16-base-all-linear", autocast=True, dtype="bfloat16", targets=("all-linear",))
        for arch in FAMILIES
    ),
    *(_case(arch, "qlora-recipe", **QLORA_RECIPE) for arch in FAMILIES),
    *(
        _case(arch, "qlora-nf4-fp32-all-linear", quant="nf4", compute_dtype="float32", targets=("all-linear",))
        for arch in FAMILIES
    ),
    _case("phi3", "gate-up-r16", targets=("gate_up_proj",), rank=16),
    _case("phi3", "o-down-ckpt-dropout", targets=("o_proj", "down_proj"), checkpointing=True, dropout=0.1),
    _case("qwen3", "save-embed", modules_to_save=("embed_tokens",)),
    _case("olmo2", "save-head-embed-ckpt", modules_to_save=("lm_head", "embed_tokens"), checkpointing=True),
    _case("gemma2", "mha-all-linear-ckpt", kv_heads=2, targets=("all-linear",), checkpointing=True),
    _case("gemma3", "layers6-ckpt", layers=6, checkpointing=True),  # 5 sliding layers, 1 full: two table pairs
    _case(
        "gemma3",
        "softcap-save-head",
        modules_to_save=LM_HEAD,
        extra=(*EXTRA["gemma3"], ("final_logit_softcapping", 30.0)),
    ),
]


def predict(case: PeftCase, ga: int = 1, dp: int = 1, zero: int = 0) -> int:
    """The run's peak for the case's config.json (its family read from it), on CPU's kernels, ``ga``
    micro-batches per optimizer step, on one of ``dp`` ranks (DDP; FSDP2 at ``zero`` 2 or 3)."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = plan_of(case).model_copy(update={"dp": dp, "zero": zero})
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert dp > 1 or hf_supported(model, plan, workload, device="cpu") is None, case.name
    # a 4-bit base loaded in the case's dtype, stored as its quant_storage (the plan: the recipe's)
    return hf_predict(case, plan, ga=ga).peak()[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES], ids=lambda c: c.name
)
def test_peak_equals_the_trainers(case: PeftCase) -> None:
    measured = hf_peft_steps.measure(case, steps=STEPS)
    predicted = predict(case)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_each_family_has_a_default_case_and_the_slow_ones_cover_it() -> None:
    """One case per family by default; under -m slow every family over all-linear with dropout, a bf16 base
    checkpointed, ``bf16=True`` over fp32 and over bf16 with a trained head, and two 4-bit bases."""
    for arch in FAMILIES:
        mine = [c for c in CASES if c.arch == arch]
        assert sum(not c.slow for c in mine) == 1, arch
        assert {c.precision for c in mine} >= {"fp32", "bf16", "bf16-mixed"}, arch
        assert any(c.checkpointing for c in mine) and any(c.dropout for c in mine), arch
        assert any(c.modules_to_save for c in mine) and {c.quant for c in mine} == {"none", "nf4"}, arch
    assert len({dataclasses.astuple(c)[1:] for c in CASES}) == len(CASES)


def test_phi3_adapters_are_peft_s_over_the_fused_linears() -> None:
    """Over Phi-3, all-linear wraps ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` (PEFT's own
    names; q_proj matches nothing): the run's optimizer states add up to PEFT's trainable parameters."""
    from memplan.costmodel.timeline.events import ALLOC

    case = next(c for c in CASES if c.name == "hfpeftfam-phi3-all-linear-dropout")
    model = model_from_data(case.hf_config(), "x/config.json", "x")
    plan = plan_of(case)
    lora = HfLoraConfig.of(plan, model.architecture)
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert fused <= lora.targets and not lora.targets & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    events = hf_predict(case, plan).events
    states = sum(e.size for e in events if e.op == ALLOC and e.tag.endswith(("exp_avg", "exp_avg_sq")))
    peft_model = hf_peft_steps.build(case)
    trainable = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    assert states == 2 * trainable
    wrapped = {type(m).__name__ for n, m in peft_model.named_modules() if n.endswith(tuple(lora.targets))}
    names = {n.rsplit(".", 1)[-1] for n, _ in peft_model.named_modules() if n.endswith(tuple(lora.targets))}
    assert wrapped == {"Linear"} and names == fused  # peft.tuners.lora.layer.Linear over each fused linear


def _estimate(capsys, args: list[str]) -> tuple[int, dict | str]:
    import json

    from memplan.cli.app import run

    code = run(["estimate", *args, "--format", "json"])
    out, err = capsys.readouterr()
    return code, json.loads(out)["memory"] if code == 0 else err.strip()


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("phi4", ["--lora-targets", "qkv_proj,o_proj", "--seq-len", "1024"]),
        ("gemma3-12b", ["--finetune", "qlora", "--seq-len", "512"]),  # under its 1024-token window
        # past it on CPU (timeline/hf_sliding.py: CPU's masked flash kernel) and on CUDA (the memory-efficient
        # kernel over its 256-wide heads, hf_sliding.cuda_masked_sdpa)
        ("gemma3-12b", ["--seq-len", "4096", "--device", "cpu"]),
        ("gemma3-12b", ["--seq-len", "4096"]),
        pytest.param("qwen3-8b", [], marks=pytest.mark.slow),
        pytest.param("olmo2-7b", ["--lora-targets", "all-linear"], marks=pytest.mark.slow),
        pytest.param("gemma2-9b", ["--modules-to-save", "lm_head", "--seq-len", "8192"], marks=pytest.mark.slow),
        pytest.param("phi3-mini", ["--lora-targets", "all-linear", "--seq-len", "1024"], marks=pytest.mark.slow),
        pytest.param("qwen3-8b", ["--gpus", "2", "--zero", "3", "--finetune", "qlora"], marks=pytest.mark.slow),
        pytest.param("olmo2-7b", ["--gpus", "2", "--zero", "0"], marks=pytest.mark.slow),
    ],
)
def test_estimate_answers_lora_over_the_families_op_level(capsys, name: str, args: list[str]) -> None:
    """``--runtime hf --finetune lora`` over each family: the Trainer's run answers it (no phase model)."""
    code, memory = _estimate(capsys, [name, "--runtime", "hf", "--finetune", "lora", *args])
    assert code == 0, memory
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    assert memory["model_states"]["gradients"] > 0


@pytest.mark.parametrize(
    ("name", "args", "reason"),
    [
        ("phi3-mini", [], "q_proj, v_proj matches no linear layer of phi3-mini; valid: qkv_proj, o_proj, gate_up_proj"),
        ("gemma2-9b", ["--runtime", "memplan"], "modelled under --runtime hf or hf-loop alone"),
        # the hand-written loop's run follows them too (test_timeline_hf_loop_peft_families.py); Megatron does not
        ("olmo2-7b", ["--runtime", "megatron"], "modelled under --runtime hf or hf-loop alone"),
        # Phi-3's window past on CUDA: cuDNN takes the mask (96-wide heads on an H100), not followed
        (
            "phi3-mini",
            ["--lora-targets", "qkv_proj", "--seq-len", "4096"],
            "does not follow sliding or chunked attention",
        ),
    ],
)
def test_lora_the_run_does_not_follow_is_one_line(capsys, name: str, args: list[str], reason: str) -> None:
    """What the run does not follow over these families is refused (their LoRA has no phase model): one
    line on stderr, exit 2."""
    code, err = _estimate(capsys, [name, "--runtime", "hf", "--finetune", "lora", *args])
    assert code == 2 and len(err.splitlines()) == 1 and reason in err, err


# gradient accumulation (the update's batches fetched together) and DDP (two gloo ranks, rank 0's peak:
# tests/accuracy/hf_ddp_steps.py; PEFT's model always under find_unused_parameters) over the families
GA = [
    (_case("qwen3", "ga2-autocast-ckpt", autocast=True, checkpointing=True), 2),
    (_case("gemma2", "ga3-bf16-all-linear", dtype="bfloat16", targets=("all-linear",)), 3),
]
DDP = [
    (_case("phi3", "ddp-all-linear", targets=("all-linear",)), 1),
    (_case("gemma3", "ddp-ckpt-save-head", checkpointing=True, modules_to_save=LM_HEAD), 1),
    (_case("olmo2", "ddp-qlora-recipe", **QLORA_RECIPE), 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), GA, ids=lambda c: getattr(c, "name", str(c)))
def test_peak_with_gradient_accumulation(case: PeftCase, ga: int) -> None:
    measured = hf_peft_steps.measure(case, ga=ga, steps=STEPS)
    predicted = predict(case, ga=ga)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ga"), DDP, ids=lambda c: getattr(c, "name", str(c)))
def test_lora_under_ddp_equals_rank_0s_peak(case: PeftCase, ga: int) -> None:
    import hf_ddp_steps

    measured = hf_ddp_steps.measure(case, ga)
    predicted = predict(case, ga=ga, dp=hf_ddp_steps.WORLD)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


# the Trainer's FSDP2 (rank 0 of two under the fake process group: tests/accuracy/hf_fsdp_steps.py), (case, zero)
FSDP = [
    (_case("phi3", "fsdp-all-linear", targets=("all-linear",)), 3),
    (_case("gemma2", "fsdp-ckpt", checkpointing=True), 3),
    (_case("olmo2", "fsdp-autocast-shard-grad-op", autocast=True), 2),
    # FSDP's QLoRA recipe: the packed weights stored as bf16 (bnb_4bit_quant_storage) and sharded
    (_case("gemma3", "fsdp-qlora-recipe", **QLORA_RECIPE, quant_storage="bfloat16"), 3),
    (_case("qwen3", "fsdp-qlora-recipe", **QLORA_RECIPE, quant_storage="bfloat16"), 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "zero"), FSDP, ids=lambda c: getattr(c, "name", str(c)))
def test_lora_under_fsdp_equals_rank_0s_peak(case: PeftCase, zero: int) -> None:
    import hf_fsdp_steps

    measured = hf_fsdp_steps.measure(case, 1, STEPS, reshard=zero >= 3)
    predicted = predict(case, dp=hf_fsdp_steps.WORLD, zero=zero)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_the_callback_reads_phi3_s_fused_adapters_and_the_run_predicts_them() -> None:
    """``MemplanCallback`` over a tiny Phi-3 with PEFT's all-linear: the plan names Phi-3's own linears (what PEFT
    resolved all-linear to), the estimate is the Trainer's op-level run, and the measured steps are within the
    issue's 2%: 2,277,852 B predicted against 2,273,740 B measured on CPU (as over Mixtral,
    tests/integrations/test_transformers_callback.py)."""
    import tempfile

    import peft
    import peft_steps
    import transformers

    from memplan.integrations.transformers import MemplanCallback

    case = next(c for c in CASES if c.name == "hfpeftfam-phi3-all-linear-dropout")
    config = peft.LoraConfig(r=case.rank, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.Phi3ForCausalLM(peft_steps._config(case)), config)
    callback = MemplanCallback(seq_len=case.seq)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=case.batch, max_steps=3, use_cpu=True, report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        trainer.train()
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert sorted(result.plan["lora_targets"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert result.memory.model == "op-level" and result.memory.model_reason is None
    # +4,112 B (0.18%): the two batches of ids and labels alive before a step, which the callback's meter leaves out
    assert 0 <= comparison.allocated_error <= 0.002, comparison


@pytest.mark.slow
def test_tune_over_phi3_lora_ladders_the_lengths_the_run_follows(capsys, tmp_path, monkeypatch) -> None:
    """``memplan tune`` over LoRA on phi3-mini: its micro-batch ladder has rows up to the lengths short of the
    2047-token window and none past it (the run declines those, and no phase model answers this LoRA); before,
    the ladder's first length past the window stopped the search with the refusal."""
    import json

    from memplan.cli.app import run

    monkeypatch.chdir(tmp_path)
    args = ["phi3-mini", "--runtime", "hf", "--finetune", "lora", "--lora-targets", "qkv_proj,o_proj", "--gpus", "1"]
    args += ["--seq-len", "1024", "--trials", "2", "--max-micro-batch", "1", "--gpu", "a100-40gb", "--format", "json"]
    code = run(["tune", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    ladder = json.loads(out)["micro_batch_ladder"]
    assert [row["seq_len"] for row in ladder] == [512, 1024]
