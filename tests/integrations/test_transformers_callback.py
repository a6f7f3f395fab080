"""``MemplanCallback`` on the CPU, in a real ``transformers.Trainer``: it estimates the run from
the live model, its PEFT config and the ``TrainingArguments``, trains three steps, and compares
the prediction with the live tensor bytes of steps 2-3 (issue 28, item 3).

The measured side is the storages PyTorch's dispatcher creates and frees during each step
(``integrations/live_bytes.py``, MemTracker's accounting without its hooks), plus the
parameters, gradients and optimizer states at the step's start; the prediction is the op-level
run's ``peak.allocated`` for ``--runtime hf`` on CPU's kernels (``memory.model == "op-level"``). The
two are independent: one counts what ran, the other replays the Trainer's tensors from the model's
dimensions.
"""

from __future__ import annotations

import logging
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memplan.api import estimate  # noqa: E402
from memplan.integrations.transformers import MemplanCallback, trainer_plan  # noqa: E402
from memplan.specs.loader import load_gpu  # noqa: E402

B, S, VOCAB = 2, 128, 4000


def _config():
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=344, vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def _model(lora: bool = False, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).to(dtype)
    if lora:
        import peft

        config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    return model


def _args(out: str, **kw):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=B, max_steps=3, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **kw,
    )  # fmt: skip


def _train(model, callback: MemplanCallback, **kw) -> transformers.Trainer:
    ids = torch.randint(0, VOCAB, (B, S))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=model, args=_args(out, **kw), train_dataset=rows, callbacks=[callback])
        trainer.train()
    return trainer


@pytest.mark.parametrize(
    ("lora", "checkpointing"),
    [(False, False), (True, False), (False, True)],
    ids=["full", "lora", "checkpointing"],
)
def test_the_callback_predicts_trains_and_compares(caplog, lora, checkpointing):
    callback = MemplanCallback(seq_len=S)
    with caplog.at_level(logging.INFO, logger="memplan"):
        trainer = _train(_model(lora), callback, gradient_checkpointing=checkpointing)
    assert trainer.state.global_step == 3
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    # the plan it read from the live objects
    assert result.plan["finetune"] == ("lora" if lora else "full")
    assert result.plan["recompute"] == ("full" if checkpointing else "none")
    assert result.plan["precision"] == "fp32" and result.plan["optimizer"] == "adamw"
    if lora:
        assert result.plan["lora_rank"] == 8 and set(result.plan["lora_targets"]) == {"q_proj", "v_proj"}
    assert comparison.device == "cpu" and comparison.steps == (2, 3)
    assert comparison.predicted_allocated == result.memory.peak.allocated
    # the bound for the Trainer's steps on CPU
    assert abs(comparison.allocated_error) <= 0.02, comparison
    assert comparison.reserved_error is None  # the CPU has no caching allocator
    assert any("steps 2-3 on cpu: allocated predicted" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bf16", [False, True], ids=["bf16-model", "bf16-model-bf16-true"])
def test_a_bf16_model_is_predicted_with_or_without_the_trainers_bf16(bf16):
    """LoRA over a bfloat16 model: without ``bf16=True`` the plan is ``bf16`` with ``autocast`` off (the
    forward as the model's dtype runs it), with it ``autocast`` on (accelerate's autocast: PEFT's fp32
    adapters run in bf16); each prediction within the issue's bound of the measured steps."""
    callback = MemplanCallback(seq_len=S)
    trainer = _train(_model(lora=True, dtype=torch.bfloat16), callback, bf16=bf16)
    assert trainer.state.global_step == 3
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert (result.plan["precision"], result.plan["autocast"]) == ("bf16", bf16)
    assert abs(comparison.allocated_error) <= 0.02, comparison
    # the op-level run on CPU tells the two apart (the phase model was +1.5% with bf16=True): what
    # the callback's meter leaves out is the batches fetched before each step begins (its docstring)
    assert result.memory.model == "op-level" and 0 <= comparison.allocated_error <= 0.001, comparison


def _mixtral(targets: list[str]):
    """A tiny Mixtral (4 experts, top 2: tests/unit/test_timeline_hf_moe.py's shape, where the experts' tensors
    and not the logits decide the peak) with PEFT LoRA on ``targets``."""
    import peft

    cfg = transformers.MixtralConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
        vocab_size=MOE_VOCAB, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    return peft.get_peft_model(transformers.MixtralForCausalLM(cfg), config)


MOE_VOCAB, MOE_SEQ = 64, 64


def test_lora_over_a_tiny_mixtral_is_predicted_by_the_run():
    """PEFT LoRA on a Mixtral's attention linears: the estimate is the Trainer's op-level run (not the phase
    model, whose LoRA layer counts a dense MLP), within the issue's bound of the measured steps: 4,112 B (0.11%)
    above them on CPU, about the two batches of token ids and labels (4,096 B) alive before a step begins, which
    the callback's meter leaves out (as in the bf16 cases above)."""
    callback = MemplanCallback(seq_len=MOE_SEQ)
    ids = torch.randint(0, MOE_VOCAB, (B, MOE_SEQ))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        args = _args(out)
        model = _mixtral(["q_proj", "k_proj", "v_proj", "o_proj"])
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        trainer.train()
    assert trainer.state.global_step == 3
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert result.plan["finetune"] == "lora" and set(result.plan["lora_targets"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    assert result.memory.model == "op-level" and result.memory.model_reason is None
    assert comparison.predicted_allocated == result.memory.peak.allocated
    assert abs(comparison.allocated_error) <= 0.02 and 0 <= comparison.allocated_error <= 0.002, comparison


@pytest.mark.parametrize(
    ("build", "targets"),
    [
        (lambda: _qwen3_moe(["gate_proj", "up_proj", "down_proj"]), ("down_proj", "gate_proj", "up_proj")),
        (lambda: _qwen3_moe("all-linear"), ("all-linear",)),
        (lambda: _mixtral("all-linear"), ("all-linear",)),
    ],
    ids=["qwen3-moe-experts", "qwen3-moe-all-linear", "mixtral-all-linear"],
)
def test_lora_on_the_experts_through_target_parameters_is_predicted_by_the_run(build, targets):
    """PEFT 0.21 moves the MLP names (Qwen3-MoE) and all-linear's MLP and router (Mixtral, Qwen3-MoE) to
    ``target_parameters`` (``lora.ParamWrapper``); the callback reads them back as the plan's targets, and the
    estimate is the Trainer's op-level run (``timeline/hf_moe_lora.py``), within the issue's bound of the
    measured steps and, as in the attention-only case above, a little above them: 3,088 B (Qwen3-MoE, both) and
    4,112 B (Mixtral) on CPU, about the batches alive before a step begins, which the callback's meter leaves
    out."""
    callback = MemplanCallback(seq_len=MOE_SEQ)
    ids = torch.randint(0, MOE_VOCAB, (B, MOE_SEQ))
    rows = [{"input_ids": r, "labels": r} for r in ids] * 4
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=build(), args=_args(out), train_dataset=rows, callbacks=[callback])
        trainer.train()
    assert trainer.state.global_step == 3
    result, comparison = callback.result, callback.comparison
    assert result is not None and comparison is not None
    assert result.plan["finetune"] == "lora" and tuple(sorted(result.plan["lora_targets"])) == targets
    assert result.memory.model == "op-level" and result.memory.model_reason is None
    assert abs(comparison.allocated_error) <= 0.02 and 0 <= comparison.allocated_error <= 0.002, comparison


def test_a_run_that_will_not_fit_is_warned_with_changes_that_would(caplog):
    """A GPU whose allocator can hold 90% of what the run reserves: the warning names the
    verdict and the changes that fit (memplan's ranked suggestions)."""
    model = _model()
    with tempfile.TemporaryDirectory() as out:
        inputs = trainer_plan(model, _args(out), seq_len=S)
    base = load_gpu("rtx-4090")
    # as the callback estimates: on the model's device (the CPU's run: reserved = allocated)
    config, plan, workload, device = inputs["config"], inputs["plan"], inputs["workload"], inputs["device"]
    first = estimate(config, plan=plan, workload=workload, gpu=base, runtime="hf", device=device)
    capacity = first.memory.overhead + int(first.memory.peak.reserved * 0.9)
    small = base.model_copy(update={"memory_bytes": capacity, "torch_capacity_bytes": capacity})
    callback = MemplanCallback(seq_len=S, gpu=small)
    with caplog.at_level(logging.INFO, logger="memplan"):
        trainer = _train(model, callback)
    assert trainer.state.global_step == 3  # a warning, not a stop
    assert callback.result is not None and not callback.result.fits
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "memplan"]
    assert len(warned) == 1 and "will not fit" in warned[0] and "changes that fit: " in warned[0], warned


class _Custom(torch.nn.Module):
    """A model memplan has no description of: no transformers config."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):  # noqa: ANN001, ANN201
        logits = self.out(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_custom_model_is_one_warning_and_training_goes_on(caplog):
    callback = MemplanCallback(seq_len=S)
    with caplog.at_level(logging.INFO, logger="memplan"):
        trainer = _train(_Custom(), callback)
    assert trainer.state.global_step == 3 and callback.result is None and callback.comparison is None
    warned = [r.getMessage() for r in caplog.records if r.name == "memplan"]
    assert warned == ["memplan: no estimate for this run (model: _Custom has no transformers config to describe it); "
                      "training goes on"]  # fmt: skip


def _ia3():
    import peft

    config = peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(_model(), config)


def _layer0_only():
    import peft

    config = peft.LoraConfig(r=4, target_modules=["model.layers.0.self_attn.q_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(_model(), config)


def _router_adapter():
    """peft 0.21 moves an MoE block's targets (Mixtral's router ``gate``) to ``target_parameters``
    (utils/transformers_weight_conversion.py, ``_convert_peft_config_moe``): ``target_modules`` no longer
    names it, and a plan read from it alone would miss the router's adapters (-3.0% on this model)."""
    return _mixtral(["q_proj", "gate"])


def _qwen3_moe(targets, **lora):
    """A tiny Qwen3-MoE (8 experts, top 2) with PEFT LoRA on ``targets``: PEFT 0.21 converts its MLP names to
    ``target_parameters`` on the experts (``gate_up_proj`` at twice the rank, ``down_proj``)."""
    import peft

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=128, vocab_size=MOE_VOCAB, max_position_embeddings=256, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM", **lora)
    return peft.get_peft_model(transformers.Qwen3MoeForCausalLM(cfg), config)


def _expert_rank_pattern():
    """A rank of the user's on the experts' ``down_proj``: the run builds ``r`` there."""
    return _qwen3_moe(["down_proj"], rank_pattern={"down_proj": 16})


def _dense_parameter_adapter():
    """``target_parameters`` named by the user on a dense model: PEFT wraps ``q_proj.weight`` in ``ParamWrapper``,
    which memplan follows only where PEFT's conversion puts it (Mixtral's and Qwen3-MoE's experts and router)."""
    import peft

    config = peft.LoraConfig(r=4, target_modules=[], target_parameters=["q_proj.weight"], task_type="CAUSAL_LM")
    return peft.get_peft_model(_model(), config)


def _gptq():
    model = _model()
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    return model


@pytest.mark.parametrize(
    ("build", "kw", "field", "reason"),
    [
        (_ia3, {}, "peft", "PEFT method IA3 is not one memplan models (LoRA)"),
        (_layer0_only, {}, "peft.target_modules", "targets some q_proj layers and not others"),
        (_router_adapter, {}, "peft.target_parameters", "an adapter on the router (gate.weight) is followed"),
        (_expert_rank_pattern, {}, "peft.rank_pattern", "rank_pattern {'down_proj': 16} is not followed"),
        (_dense_parameter_adapter, {}, "peft.target_parameters", "adapters on parameters (q_proj.weight, PEFT's"),
        (_gptq, {}, "config.quantization_config", "quantization 'gptq' is not one memplan models"),
        (_model, {"optim": "adagrad"}, "optim", "optimizer 'adagrad' is not one memplan models"),
        (_model, {}, "seq_len", "no sequence length: pass MemplanCallback(seq_len=...)"),
    ],
    ids=[
        "peft-method",
        "layer-subset",
        "router-parameters",
        "expert-rank",
        "dense-parameters",
        "quantization",
        "optimizer",
        "no-seq-len",
    ],
)
def test_each_input_it_cannot_read_is_one_line_naming_the_field(caplog, build, kw, field, reason):
    """Bad input never raises inside training: one warning line, field and reason, no estimate."""
    callback = MemplanCallback(seq_len=None if field == "seq_len" else S)
    with tempfile.TemporaryDirectory() as out, caplog.at_level(logging.INFO, logger="memplan"):
        args = _args(out, **kw)
        callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=build())
    assert callback.result is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "memplan"]
    assert line.startswith(f"memplan: no estimate for this run ({field}: {reason}") and "\n" not in line


def test_all_linear_is_read_as_the_layer_kinds_peft_resolved_it_to():
    """PEFT resolves ``target_modules="all-linear"`` to every adapted module's full name
    (``model.layers.0.self_attn.q_proj``, ...); the plan names the kinds of layer (found on an H200
    run, where the callback gave no estimate for the usual QLoRA recipe)."""
    import peft

    config = peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(_model(), config)
    assert not isinstance(model.peft_config["default"].target_modules, str)  # resolved to full names
    with tempfile.TemporaryDirectory() as out:
        plan = trainer_plan(model, _args(out), seq_len=S)["plan"]
    assert sorted(plan["lora_targets"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"])  # fmt: skip


def test_measure_steps_must_leave_a_step_after_the_first():
    from memplan.errors import MemplanError

    with pytest.raises(MemplanError, match="must be a whole number >= 2"):
        MemplanCallback(seq_len=S, measure_steps=1)


# The GPU case runs in a process of its own, as a user's training does: max_memory_reserved counts
# the segments a process's caching allocator holds, and under pytest earlier tests in the same worker
# leave segments cached or pinned by small live tensors (an H200 run of 2026-11-28 under pytest-xdist
# measured 274,726,912 B reserved against 96,468,992 B predicted, allocated within 0.5%; the same
# Trainer runs in processes of their own were within 0.1%: docs/accuracy-gpu.md).
_CUDA_RUN = """
import json, sys
import torch, transformers
sys.path.insert(0, sys.argv[3])
from test_transformers_callback import B, S, VOCAB, _model
from memplan.integrations.transformers import MemplanCallback

out, lora = sys.argv[1], sys.argv[2] == "1"
model = _model(lora).to("cuda", torch.bfloat16)
callback = MemplanCallback(seq_len=S, snapshot=out + "/run.pickle")
rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, VOCAB, (B, S))] * 4
args = transformers.TrainingArguments(
    output_dir=out, per_device_train_batch_size=B, max_steps=3, report_to=[], save_strategy="no",
    logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
)
transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
print(json.dumps(callback.comparison.model_dump() if callback.comparison else None))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora", [False, True], ids=["full-bf16", "lora-bf16"])
def test_on_cuda_the_callback_measures_the_allocator_peaks(tmp_path, lora):
    """On CUDA: the Trainer's peaks against ``max_memory_allocated`` / ``max_memory_reserved``
    (issue 28's bounds: allocated within 2%, reserved within 5%), and the snapshot for explain."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from memplan.integrations.transformers import Comparison

    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_RUN, str(tmp_path), "1" if lora else "0", here],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    c = Comparison.model_validate(json.loads(done.stdout.strip().splitlines()[-1]))
    assert c.device == "cuda" and c.measured_reserved
    assert abs(c.allocated_error) <= 0.02, c
    assert abs(c.reserved_error or 0) <= 0.05, c
    assert (tmp_path / "run.pickle").stat().st_size > 0
