# ruff: noqa: E501 (one case per line: a table)
"""LoRA in the bundled trainer (memplan.train.lora): each phase's measured peak (MemTracker,
steady state) against ``--runtime memplan``, within 3%, and the adapters as PEFT builds them.

fp32 cases run 2 x 160 tokens, 16-bit ones 1 x 128 (bf16 matmuls are slow on most CPUs;
trainer_cases.py). Measured 2026-11-24 on CPU (torch 2.13.0+cpu): every phase within 0.05%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainer_cases import TINY, measured_against_predicted, validate_tiny_on_cpu  # noqa: E402

from memplan.costmodel import lora as L  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402
from memplan.train.lora import HF_NAMES, LoraLinear, apply_lora, init_adapters, trainable  # noqa: E402
from memplan.train.model import Transformer  # noqa: E402
from memplan.train.runner import run  # noqa: E402
from memplan.validate.spec import RunSpec  # noqa: E402

TOLERANCE_PCT = 3.0
QV, ALL = ("q_proj", "v_proj"), ("all-linear",)

CASES = {
    "lora-qv-fp32": dict(precision="fp32", lora_targets=QV),
    "lora-all-linear-fp32": dict(precision="fp32", lora_targets=ALL),
    "lora-qv-fp32-recompute-full": dict(precision="fp32", lora_targets=QV, recompute="full"),
    "lora-all-linear-fp32-recompute-full": dict(precision="fp32", lora_targets=ALL, recompute="full"),
    "lora-qv-bf16-master": dict(precision="bf16-master", lora_targets=QV),
    "lora-all-linear-bf16-master": dict(precision="bf16-master", lora_targets=ALL),
    "lora-qv-bf16-master-recompute-full": dict(precision="bf16-master", lora_targets=QV, recompute="full"),
    "lora-all-linear-bf16-master-recompute-full": dict(precision="bf16-master", lora_targets=ALL, recompute="full"),
    "lora-all-linear-fp32-dropout": dict(precision="fp32", lora_targets=ALL, lora_dropout=0.1),
    "lora-qv-bf16-mixed-autocast": dict(precision="bf16-mixed", lora_targets=QV),
    "lora-qv-lm-head-fp32": dict(precision="fp32", lora_targets=QV, modules_to_save=("lm_head",)),
    "lora-qv-lm-head-bf16-master": dict(precision="bf16-master", lora_targets=QV, modules_to_save=("lm_head",)),
    "lora-all-linear-lm-head-fp32-recompute-full": dict(
        precision="fp32", lora_targets=ALL, modules_to_save=("lm_head",), recompute="full"
    ),
    "lora-o-down-r8-fp32-ddp2": dict(precision="fp32", lora_targets=("o_proj", "down_proj"), lora_rank=8, dp=2),
}


def _workload(plan: dict) -> TrainingWorkload:
    if plan["precision"] == "fp32":
        return TrainingWorkload(seq_len=160, micro_batch=2)
    return TrainingWorkload(seq_len=128, micro_batch=1)


@pytest.mark.parametrize("name", list(CASES))
def test_each_phase_within_3pct_of_the_memplan_runtime(name: str):
    plan = Plan(finetune="lora", **CASES[name])
    workload = _workload(CASES[name])
    measured_against_predicted(name, TINY, workload, plan, steps=2, tolerance_pct=TOLERANCE_PCT)


def _adapted(targets: tuple[str, ...], rank: int = 4) -> Transformer:
    plan = Plan(finetune="lora", lora_targets=targets, lora_rank=rank)
    model = Transformer(TINY)
    apply_lora(model, plan)
    model.init_weights(0)
    init_adapters(model)
    return model


def _peft_choice(targets: tuple[str, ...], rank: int = 4) -> tuple[set[tuple[str, str]], int]:
    """What PEFT itself wraps for the same ``LoraConfig`` on a transformers Llama of TINY's shape
    (built on the meta device): the (layer, module name) pairs of ``targeted_module_names`` and
    its trainable parameter count."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=TINY.hidden_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_attention_heads,
        num_key_value_heads=TINY.num_kv_heads,
        intermediate_size=TINY.ffn_size,
        vocab_size=TINY.vocab_size,
        tie_word_embeddings=TINY.tied_embeddings,
    )
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config)
    modules = "all-linear" if targets == ALL else list(targets)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, target_modules=modules))
    chosen = {(name.split(".")[2], name.rsplit(".", 1)[1]) for name in model.targeted_module_names}
    return chosen, model.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("targets", [QV, ALL, ("o_proj", "gate_proj")])
def test_trainable_parameters_are_the_adapters_peft_builds(targets: tuple[str, ...]):
    model = _adapted(targets)
    params = trainable(list(model.parameters()))
    chosen, peft_trainable = _peft_choice(targets)
    assert sum(p.numel() for p in params) == peft_trainable == L.trainable_params(TINY, targets, 4, ())
    assert all(p.dtype == torch.float32 for p in params)
    wrapped = {
        (name.split(".")[1], HF_NAMES[name.split(".", 2)[2]])
        for name, m in model.named_modules()
        if isinstance(m, LoraLinear)
    }
    assert wrapped == chosen
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == sum(p.numel() for p in Transformer(TINY).parameters())


def test_adapters_start_as_the_base_and_train():
    """lora_B zeros: the adapted model computes the base model's logits; lora_A Kaiming-uniform
    (a = sqrt(5): bound 1 / sqrt(in)); one step moves only the adapters."""
    base = Transformer(TINY)
    base.init_weights(0)
    model = _adapted(QV)
    ids = torch.randint(0, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
    layer = model.layers["0"].attention.wq
    assert layer.lora_A.abs().max() <= 1 / math.sqrt(TINY.hidden_size)
    assert layer.lora_A.abs().max() > 0 and not layer.lora_B.any()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(trainable(list(model.parameters())), lr=1e-2)
    model(ids).float().logsumexp(-1).mean().backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        (dict(finetune="qlora", precision="bf16-mixed"), "precision"),
        (dict(finetune="lora", quant="int8", precision="bf16-mixed"), "precision"),
        (dict(finetune="lora", modules_to_save=("embed_tokens",)), "modules_to_save"),
        (dict(finetune="lora", tp=2), "tp"),
        (dict(finetune="lora", pp=2), "pp"),
        (dict(finetune="lora", dp=2, zero=3), "zero"),
    ],
)
def test_what_the_trainer_cannot_run_is_refused_in_one_line(plan: dict, field: str):
    spec = RunSpec(model=TINY, workload=TrainingWorkload(seq_len=32, micro_batch=1), plan=Plan(**plan))
    record = run(spec)
    assert record.status == "unsupported"
    assert record.reason.startswith(f"{field}: ") and "\n" not in record.reason


def test_a_trained_lm_head_copy_over_tied_embeddings_is_refused():
    tied = TINY.model_copy(update=dict(name="tiny-tied", tied_embeddings=True))
    plan = Plan(finetune="lora", modules_to_save=("lm_head",))
    record = run(RunSpec(model=tied, workload=TrainingWorkload(seq_len=32, micro_batch=1), plan=plan))
    assert record.status == "unsupported" and record.reason.startswith("modules_to_save: ")


def test_lm_head_copy_starts_as_the_original_and_is_the_one_trained():
    """PEFT's ModulesToSaveWrapper: the original frozen, a trainable copy of the same values."""
    plan = Plan(finetune="lora", lora_targets=QV, modules_to_save=("lm_head",))
    model = Transformer(TINY)
    apply_lora(model, plan)
    model.init_weights(0)
    init_adapters(model)
    head = model.output
    assert torch.equal(head.trained.weight, head.original_module.weight)
    assert head.trained.weight.requires_grad and not head.original_module.weight.requires_grad
    n = sum(p.numel() for p in trainable(list(model.parameters())))
    assert n == L.trainable_params(TINY, QV, plan.lora_rank, ("lm_head",))


def test_validate_cli_runs_lora_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    result = validate_tiny_on_cpu(
        tmp_path, monkeypatch, capsys, "--finetune", "lora", "--lora-targets", "all-linear", "--lora-rank", "4"
    )
    assert result["status"] == "ok"
    assert abs(result["error_pct"]) <= TOLERANCE_PCT
