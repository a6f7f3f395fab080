"""Real PEFT LoRA / QLoRA training steps on CPU, measured with MemTracker's accounting.

The loop is the ``hf`` runtime's, with AdamW over the trainable parameters only:
``out = model(input_ids=ids, labels=ids); out.loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)``. The steady-state peak is the highest total over three steps,
counted as MemTracker counts (``measure``) but by ``StorageTracker`` (``measure_live``): under
gradient checkpointing with a frozen embedding MemTracker's module hooks keep each step's input
leaf and its gradient alive, which a run without the tracker frees (storage_tracker.py).
Quantized bases (bitsandbytes) keep their quantization state (absmax, code,
second-level scales, LLM.int8 row scales) outside the parameters: those tensors are handed to
the tracker too, so the peak counts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
from dataclasses import dataclass

import torch
import transformers
from hf_steps import _CLASSES  # the tiny Llama / Mistral / Qwen2 classes the hf suite builds
from storage_tracker import StorageTracker
from torch.distributed._tools.mem_tracker import MemTracker

from memplan.specs.plan import Plan


@dataclass(frozen=True)
class PeftCase:
    name: str
    arch: str = "llama"
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 344
    vocab: int = 2000
    tied: bool = False
    batch: int = 2
    seq: int = 64
    dtype: str = "float32"  # the model's dtype (bfloat16: loaded / cast to bf16)
    autocast: bool = False  # fp32 model, forward under torch.autocast(cpu, bfloat16): bf16-mixed
    checkpointing: bool = False
    rank: int = 8
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()
    dora: bool = False  # LoraConfig(use_dora=True): PEFT's DoRA (timeline/hf_dora.py)
    quant: str = "none"  # none, nf4, fp4 (bitsandbytes 4-bit) or int8 (LLM.int8)
    double_quant: bool = False
    compute_dtype: str = "bfloat16"  # bnb_4bit_compute_dtype
    quant_storage: str = "uint8"  # bnb_4bit_quant_storage (bfloat16: FSDP's QLoRA recipe, the packed weights sharded)
    slow: bool = False
    extra: tuple = ()  # further config.json fields (a MoE family's experts), as hf_steps.Case's

    @property
    def attention(self) -> str:
        """transformers' attention: eager for Gemma 2 (``_supports_sdpa = False``: SDPA takes no soft-cap)."""
        return "eager" if self.arch == "gemma2" else "sdpa"

    @property
    def finetune(self) -> str:
        return "lora" if self.quant == "none" else "qlora"

    @property
    def precision(self) -> str:
        """memplan's precision: the compute dtype the frozen base runs in."""
        if self.quant != "none":
            # the compute dtype bitsandbytes dequantizes to; the model keeps fp32 activations over a
            # quantized base whatever it is (memory._activation_bytes), which these cases check
            return "bf16" if self.compute_dtype == "bfloat16" else "fp32"
        if self.autocast:
            return "bf16-mixed"
        return "fp32" if self.dtype == "float32" else "bf16"

    def hf_config(self) -> dict:
        config_cls, model_cls = _CLASSES[self.arch]
        cfg = config_cls(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.ffn,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            max_position_embeddings=max(self.seq, 256),
            **dict(self.extra),
        )
        data = cfg.to_dict()
        data["architectures"] = [model_cls.__name__]
        return data

    def lora_config(self):
        import peft

        targets = "all-linear" if self.targets == ("all-linear",) else list(self.targets)
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=2 * self.rank,
            target_modules=targets,
            lora_dropout=self.dropout,
            modules_to_save=list(self.modules_to_save) or None,
            use_dora=self.dora,
            task_type="CAUSAL_LM",
        )


def _config(case: PeftCase):
    config_cls, _ = _CLASSES[case.arch]
    config = config_cls(**{k: v for k, v in case.hf_config().items() if k != "architectures"})
    config._attn_implementation = case.attention
    return config


def _quantized_base(case: PeftCase):
    """A random model saved to a temporary folder and loaded back through bitsandbytes."""
    _, model_cls = _CLASSES[case.arch]
    torch.manual_seed(0)
    model = model_cls(_config(case))
    if case.quant == "int8":
        qc = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=case.quant,
            bnb_4bit_use_double_quant=case.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, case.compute_dtype),
            bnb_4bit_quant_storage=getattr(torch, case.quant_storage),
        )
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = model_cls.from_pretrained(
                folder, quantization_config=qc, dtype=getattr(torch, case.dtype), attn_implementation=case.attention
            )
    return loaded


def build(case: PeftCase):
    """The PEFT model of a case, ready to train."""
    import peft

    _, model_cls = _CLASSES[case.arch]
    if case.quant != "none":
        model = _quantized_base(case)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.checkpointing)
    else:
        torch.manual_seed(0)
        model = model_cls(_config(case)).to(getattr(torch, case.dtype))
        if case.checkpointing:
            model.gradient_checkpointing_enable()
            model.enable_input_require_grads()
    model = peft.get_peft_model(model, case.lora_config())
    model.train()
    return model


def quant_state_tensors(model) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside its quantized weights (not parameters or buffers)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        qs = getattr(weight, "quant_state", None)
        if qs is not None:
            for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
                if isinstance(t, torch.Tensor):
                    found[id(t)] = t
            if getattr(qs, "state2", None) is not None:
                for t in (qs.state2.absmax, qs.state2.code):
                    found[id(t)] = t
        scb = getattr(weight, "SCB", None)
        if isinstance(scb, torch.Tensor):
            found[id(scb)] = scb
        state = getattr(module, "state", None)
        for attr in ("SCB", "CB"):
            t = getattr(state, attr, None)
            if isinstance(t, torch.Tensor):
                found[id(t)] = t
    return list(found.values())


class _NoHook:
    """Stands for a gradient hook of a frozen parameter (MemTracker removes it on exit)."""

    def remove(self) -> None:
        pass


def _setup(case: PeftCase, model=None):
    """The model (built unless given), AdamW over its trainable parameters and the token ids."""
    if model is None:
        model = build(case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    torch.manual_seed(1)
    return model, opt, torch.randint(0, case.vocab, (case.batch, case.seq))


def _steps(case: PeftCase, model, opt, ids, steps: int, after_step=lambda: None, ga: int = 1) -> None:
    """The loop: ``out`` kept until the next forward, as ``runtime()`` says; over ``ga`` > 1 iterations an
    optimizer step, ``loss = out.loss / ga`` (hf_steps.measure_hand's accumulation)."""
    for i in range(steps * ga):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
            out = model(input_ids=ids, labels=ids)
        if ga == 1:
            out.loss.backward()
        else:
            loss = out.loss / ga
            loss.backward()
        if (i + 1) % ga == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
            after_step()


def measure(case: PeftCase, steps: int = 3, model=None) -> dict:
    """Steady-state peak bytes of a training step and MemTracker's per-category snapshot at it."""
    model, opt, ids = _setup(case, model)
    tracker = MemTracker()
    for param in model.parameters():
        if not param.requires_grad:  # MemTracker would hook every parameter's gradient
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    tracker.track_external(model, opt, *quant_state_tensors(model))
    with tracker:
        _steps(case, model, opt, ids, steps, tracker.reset_mod_stats)
    return dict(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])


def measure_live(case: PeftCase, steps: int = 3, model=None) -> int:
    """Steady-state peak bytes of the same steps counted by :class:`StorageTracker`: MemTracker's
    accounting without the module hooks that keep a checkpointed run's input leaf alive."""
    model, opt, ids = _setup(case, model)
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(*quant_state_tensors(model))
    with tracker:
        _steps(case, model, opt, ids, steps)
    return tracker.peak


_MEASURED: dict[tuple[str, int], int] = {}  # as hf_steps._MEASURED: one measurement per shape and loop


def measure_peak(case: PeftCase, steps: int = 3) -> int:
    """The measured peak the suite holds predictions to: :func:`measure_live` (MemTracker's own
    count grows by a hidden-size pair per step under checkpointing with a frozen embedding),
    measured once per shape and loop in a session."""
    key = (repr(dataclasses.replace(case, name="")), steps)
    if key not in _MEASURED:
        _MEASURED[key] = measure_live(case, steps)
    return _MEASURED[key]


def runtime() -> str:
    """The runtime profile of this loop (``out`` kept until the next forward): ``hf-loop`` where
    the ``hf`` profile describes the Trainer step, else ``hf``."""
    from memplan.costmodel.runtimes import RUNTIMES

    return "hf-loop" if "hf-loop" in RUNTIMES else "hf"


def predict_report(case: PeftCase):
    """memplan's estimate for a case (``runtime()``), from its config.json as it is."""
    from memplan.costmodel.memory import estimate_training
    from memplan.specs.loader import model_from_data
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    fields = dict(
        precision=case.precision,
        recompute="full" if case.checkpointing else "none",
        attention="flash",
        finetune=case.finetune,
        lora_rank=case.rank,
        lora_targets=case.targets,
        lora_dropout=case.dropout,
        modules_to_save=case.modules_to_save,
    )
    if case.quant != "none":
        fields.update(quant=case.quant, double_quant=case.double_quant)
    plan = Plan(**fields)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    return estimate_training(model, workload, plan, runtime=runtime(), device="cpu")


def predict_peak(case: PeftCase) -> tuple[int, str]:
    report = predict_report(case)
    return report.peak.allocated, report.peak.phase


# Tiny Llama / Mistral / Qwen2 configurations (bf16 kept tiny: bf16 matmuls are slow on CPUs
# without AMX). Each runs in a few seconds on 2 cores.
TINY = dict(vocab=256, hidden=64, heads=2, kv_heads=1, ffn=160, batch=2, seq=64, rank=4, layers=2)
CASES = [
    PeftCase("lora-fp32-qv", **TINY),
    PeftCase("lora-fp32-qv-3layers", slow=True, **{**TINY, "layers": 3}),
    PeftCase("lora-fp32-qv-dropout", slow=True, **TINY, dropout=0.1),
    PeftCase("lora-fp32-attn", slow=True, **TINY, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    PeftCase("lora-fp32-mlp", slow=True, **TINY, targets=("gate_proj", "up_proj", "down_proj")),
    PeftCase("lora-fp32-all-linear", **TINY, targets=("all-linear",)),
    PeftCase("lora-fp32-o", slow=True, **TINY, targets=("o_proj",)),
    PeftCase("lora-fp32-up", slow=True, **TINY, targets=("up_proj",)),
    PeftCase("lora-fp32-down", slow=True, **TINY, targets=("down_proj",)),
    PeftCase("lora-fp32-save-head", **TINY, modules_to_save=("lm_head",)),
    PeftCase("lora-fp32-tied-save-head", **TINY, tied=True, modules_to_save=("lm_head",)),
    PeftCase("lora-fp32-ckpt", **TINY, checkpointing=True),
    PeftCase("lora-bf16-qv", **TINY, dtype="bfloat16"),
    PeftCase("lora-bf16-all-linear-dropout", **TINY, dtype="bfloat16", targets=("all-linear",), dropout=0.1),
    PeftCase("lora-bf16-ckpt", **TINY, dtype="bfloat16", checkpointing=True),
    PeftCase("lora-autocast-qv", **TINY, autocast=True),
    PeftCase("lora-autocast-ckpt", **TINY, autocast=True, checkpointing=True),
    PeftCase("mistral-lora-fp32-qv", **TINY, arch="mistral"),
    PeftCase("qwen2-lora-fp32-tied", **TINY, arch="qwen2", tied=True),
    PeftCase(
        "qwen2-lora-bf16-attn", **TINY, arch="qwen2", dtype="bfloat16", targets=("q_proj", "k_proj", "v_proj", "o_proj")
    ),
    PeftCase("qlora-nf4-fp32", **TINY, quant="nf4", compute_dtype="float32"),
    PeftCase("qlora-nf4-dq-bf16", **TINY, quant="nf4", double_quant=True),
    PeftCase("qlora-fp4-bf16-all-linear", **TINY, quant="fp4", targets=("all-linear",)),
    PeftCase("lora-fp32-ckpt-vocab", slow=True, **{**TINY, "vocab": 512, "layers": 3}, checkpointing=True),
    PeftCase("lora-fp32-ckpt-all-linear-dropout", **TINY, checkpointing=True, targets=("all-linear",), dropout=0.1),
    PeftCase("qlora-int8", **TINY, quant="int8"),
]


def _autocast_precision(case: PeftCase, dtype: str, runtime: str) -> str:
    """The precision of an autocast case: the Trainer's ``bf16`` over a bf16 or quantized base."""
    return "bf16" if runtime == "hf" and (case.quant != "none" or dtype == "bf16") else "bf16-mixed"


def plan_of(case: PeftCase, runtime: str = "hf") -> Plan:
    """memplan's plan for a case under ``runtime``; the Trainer's ``bf16=True`` is ``bf16`` over a bf16
    or quantized base (the exporters' recipe) and ``bf16-mixed`` over an fp32 one, the hand loop's
    autocast ``bf16-mixed``; without it over a 4-bit base the precision is the compute dtype's. Under
    ``bf16`` the plan's ``autocast`` says whether the case runs ``bf16=True`` (a bf16 base without it:
    off)."""
    if case.quant != "none":
        dtype = "fp32" if case.compute_dtype == "float32" else "bf16"
        fields = dict(finetune="qlora", quant=case.quant, double_quant=case.double_quant)
    else:
        dtype = "fp32" if case.dtype == "float32" else "bf16"
        fields = dict(finetune="lora")
    precision = _autocast_precision(case, dtype, runtime) if case.autocast else dtype
    return Plan(
        precision=precision,
        autocast=case.autocast if precision == "bf16" else None,
        recompute="full" if case.checkpointing else "none",
        lora_rank=case.rank,
        lora_targets=case.targets,
        lora_dropout=case.dropout,
        modules_to_save=case.modules_to_save,
        lora_dora=case.dora,
        **fields,
    )
