"""Real transformers training steps on CPU, measured by live storages at the dispatcher.

Each case runs one of two loops (``Case.loop``):

- ``"trainer"`` (``--runtime hf``): ``transformers.Trainer`` itself, driven for three steps
  on an in-memory dataset with its defaults (fused AdamW, ``max_grad_norm=1.0``,
  ``model.zero_grad()``); its ``training_step`` keeps only the loss of ``model(**inputs)``
  and lets the outputs go before ``accelerator.backward(loss)``;
- ``"hand"`` (``--runtime hf-loop``): the transformers course's hand-written loop,
  ``out = model(input_ids=ids, labels=ids); out.loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)`` with ``AdamW(foreach=True)``, which keeps ``out`` (logits,
  DynamicCache) until the next forward returns; with ``Case.ga`` > 1 the loss is divided
  (``loss = out.loss / ga; loss.backward()``) and the optimizer steps every ``ga`` iterations.

The steady-state peak is the highest total of live tensor storages over three steps (the first
step allocates the optimizer states lazily), counted by ``StorageTracker``: MemTracker's
accounting (each storage an op creates, from creation to finalisation, plus the parameters and
optimizer states) without MemTracker's module hooks, which keep references that the loop without
a tracker would free (issue 28: "a measurement that keeps no extra references alive").
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

import torch
import transformers
from storage_tracker import StorageTracker

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    # the families of docs/models.md (issue 18), text models
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
}


@dataclass(frozen=True)
class Case:
    name: str
    arch: str = "llama"
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 688
    vocab: int = 8000
    tied: bool = False
    batch: int = 2
    seq: int = 128
    dtype: str = "float32"
    checkpointing: bool = False
    attention: str = "sdpa"
    autocast: bool = False  # forward under torch.autocast(bfloat16) (bf16=True): over fp32, bf16-mixed
    slow: bool = False  # runs under ``-m slow`` only; a smaller twin runs by default (see below)
    # the device predicted for: "cuda" cases run on CPU with SDPA forced to the backend CUDA's
    # dispatch picks (attention.sdpa_backend), which the CPU has for the math path
    device: str = "cpu"
    # "hand": the hand-written loop that keeps ``out`` (runtime hf-loop); "trainer": transformers.Trainer (hf)
    loop: str = "hand"
    # further config.json fields of the family, as (key, value) pairs (MLA ranks, windows, experts)
    extra: tuple[tuple[str, object], ...] = ()
    # the hand loop's gradient accumulation: iterations per optimizer step (``loss = out.loss / ga``)
    ga: int = 1

    @property
    def runtime(self) -> str:
        return "hf" if self.loop == "trainer" else "hf-loop"

    @property
    def precision(self) -> str:
        """memplan's precision: autocast (the Trainer's ``bf16=True``) over a bf16 model is ``bf16``
        (with :attr:`plan_autocast`), over an fp32 one ``bf16-mixed``; a bf16 model without it is
        ``bf16`` with ``autocast`` off."""
        if self.autocast:
            return "bf16" if self.dtype == "bfloat16" else "bf16-mixed"
        return "fp32" if self.dtype == "float32" else "bf16"

    @property
    def plan_autocast(self) -> bool | None:
        """The plan's ``autocast``: said for a bf16 model (the runtime's recipe is not the case's
        under the Trainer without ``bf16=True``, nor under the hand loop with it), else None."""
        return self.autocast if self.precision == "bf16" else None

    def hf_config(self) -> dict:
        """The config.json transformers would write for this case."""
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


def cuda_backend(case: Case) -> str:
    """The kernel SDPA runs for this case on an H100 under torch 2.11 (memplan's dispatch model)."""
    from memplan.costmodel.attention import sdpa_backend

    dtype = "bf16" if case.autocast or case.dtype == "bfloat16" else "fp32"
    return sdpa_backend("cuda", dtype, case.hidden // case.heads, case.heads, case.kv_heads, enable_gqa=True)


def forced_backend(case: Case):
    """For a ``device="cuda"`` case, SDPA forced on CPU to the backend CUDA would run (the math
    path: the CPU has no flash-for-fp32-GQA alternative to it); else no forcing."""
    import contextlib

    if case.device != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = cuda_backend(case)
    if backend != "math":
        raise ValueError(f"{case.name}: CUDA runs {backend}, which the CPU cannot force")
    return sdpa_kernel(SDPBackend.MATH)


def _model(case: Case):
    torch.manual_seed(0)
    config_cls, model_cls = _CLASSES[case.arch]
    config = config_cls(**{k: v for k, v in case.hf_config().items() if k != "architectures"})
    config._attn_implementation = case.attention
    return model_cls(config).to(getattr(torch, case.dtype))


# measured peaks by (case less its name, steps): the accuracy suite and the op-level run's tests
# (tests/unit/test_timeline_hf*.py) measure many of the same shapes in one session; a peak is a
# function of the shapes and the loop alone (storage sizes, not values), so each is measured once
_MEASURED: dict[tuple[str, int], int] = {}


def measure_peak(case: Case, steps: int = 3) -> int:
    """Steady-state peak bytes of a training step: live storages (module docstring); measured
    once per shape and loop in a session (:data:`_MEASURED`)."""
    key = (repr(dataclasses.replace(case, name="")), steps)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_peak(case, steps)
    return _MEASURED[key]


def _measure_peak(case: Case, steps: int) -> int:
    if case.loop == "trainer":
        return _measure_trainer(case, steps)
    if case.loop != "hand":
        raise ValueError(f"{case.name}: unknown loop {case.loop!r}")
    return measure_hand(case, steps)


def measure_hand(case: Case, steps: int, prepare=None) -> int:
    """The hand-written loop (module docstring) for ``steps`` steps under ``StorageTracker``;
    ``prepare(model)``, if given, runs before the optimizer is built (DeepSeek-V3's fp32 score
    bias, as ``from_pretrained`` keeps it: tests/unit/test_timeline_hf_loop_families.py)."""
    model = _model(case)
    if prepare is not None:
        prepare(model)
    if case.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    tracker = StorageTracker()
    tracker.track_module(model)
    tracker.track(ids)
    with tracker, forced_backend(case):
        for i in range(steps * case.ga):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
                out = model(input_ids=ids, labels=ids)
            if case.ga == 1:
                out.loss.backward()
            else:  # gradient accumulation as accelerate's docs and the transformers course write it
                loss = out.loss / case.ga
                loss.backward()
            if (i + 1) % case.ga == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tracker.peak


def _measure_trainer(case: Case, steps: int, prepare=None) -> int:
    """``transformers.Trainer(...).train()`` for ``steps`` steps under ``StorageTracker``, with the
    Trainer's defaults (optimizer, gradient clipping, zero_grad); bf16-mixed cases set
    ``bf16=True`` (accelerate's autocast over the fp32 model), bf16 cases train a bf16 model.
    ``prepare(model, args, ids)``, if given, runs before the Trainer is built (a MoE test's router
    weights and learning rate; tests/unit/test_timeline_hf_moe.py)."""
    model = _model(case)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    rows = [{"input_ids": row, "labels": row} for row in ids] * steps
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, case, steps)
        if prepare is not None:
            prepare(model, args, ids)
        tracker = StorageTracker()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        tracker.track_module(model)
        with tracker, forced_backend(case):
            trainer.train()
    return tracker.peak


# Tiny Llama / Mistral / Qwen2 configurations: fp32 and bf16, GQA and MHA, tied and untied,
# with and without gradient checkpointing, vocabulary- and layer-dominated shapes.
LAYERS = dict(layers=8, vocab=512, batch=4, seq=192, hidden=192, heads=6, kv_heads=2, ffn=512)  # layer-dominated
VOCAB = dict(vocab=32000, hidden=128, heads=4, kv_heads=4, ffn=344, batch=4, seq=256)  # vocabulary-dominated
EAGER = dict(attention="eager", layers=4, vocab=512, batch=4, seq=256, hidden=128, heads=4, ffn=344)
WIDE = dict(layers=6, batch=4, seq=160, hidden=256, ffn=704, vocab=1024)
MATH = dict(layers=4, vocab=512, batch=2, seq=384, hidden=128, heads=4, kv_heads=2, ffn=344)  # s x s-dominated

# bf16 matmuls are slow on CPUs without avx512_bf16 / AMX (PyTorch falls back to ATen's own
# GEMM, 0.4 to 2 GFLOP/s on most layouts: a CI machine took 130-140 s for each bf16 vocab case),
# so the heavy bf16 and bf16-mixed cases run under ``-m slow`` and the default suite runs each as
# a twin named <case>-small, at a smaller shape that keeps what the case is about: the same
# precision, flags, layers and heads per KV head, the same peak phase and largest category
# (test_each_slow_case_has_a_smaller_default_twin):
# - BASE_SMALL (for the Case defaults) and the *_SMALL layer shapes halve batch, hidden, heads
#   and KV heads, ffn and vocab: activations (b s h), parameters (h^2 and V h) and logits
#   (b s V) keep their shares of the peak;
# - VOCAB_SMALL keeps the 32000 vocabulary and the sequence and cuts batch, hidden and ffn by 4
#   (heads by 2): the logits (b s V) stay as large against the embedding and head (V h) as in
#   VOCAB and dominate the peak as much (94% in vocab-bf16-tied-small against 92% at VOCAB,
#   80% in autocast-vocab-small against 78%).
BASE_SMALL = dict(hidden=128, heads=2, kv_heads=2, ffn=344, vocab=4000, batch=1)
LAYERS_SMALL = dict(layers=8, vocab=256, batch=2, seq=192, hidden=96, heads=3, kv_heads=1, ffn=256)
VOCAB_SMALL = dict(vocab=32000, hidden=32, heads=2, kv_heads=2, ffn=86, batch=1, seq=256)
EAGER_SMALL = dict(attention="eager", layers=4, vocab=256, batch=2, seq=256, hidden=64, heads=2, ffn=172)
WIDE_SMALL = dict(layers=6, batch=2, seq=160, hidden=128, ffn=352, vocab=512)

HAND = [
    Case("llama-fp32-mha"),
    Case("llama-bf16-mha", dtype="bfloat16", slow=True),
    Case("llama-bf16-mha-small", **BASE_SMALL, dtype="bfloat16"),
    Case("llama-fp32-gqa", kv_heads=2),
    Case("llama-bf16-gqa-ckpt", kv_heads=2, dtype="bfloat16", checkpointing=True, slow=True),
    Case("llama-bf16-gqa-ckpt-small", **{**BASE_SMALL, "kv_heads": 1}, dtype="bfloat16", checkpointing=True),
    Case("llama-fp32-ckpt", checkpointing=True),
    Case("llama-fp32-tied", tied=True),
    Case("llama-bf16-tied-ckpt", tied=True, dtype="bfloat16", checkpointing=True, slow=True),
    Case("llama-bf16-tied-ckpt-small", **BASE_SMALL, tied=True, dtype="bfloat16", checkpointing=True),
    Case("llama-fp32-eager", attention="eager", kv_heads=2),
    Case("eager-layers-fp32", **EAGER, kv_heads=2),
    Case("eager-layers-bf16", **EAGER, kv_heads=2, dtype="bfloat16", slow=True),
    Case("eager-layers-bf16-small", **EAGER_SMALL, kv_heads=1, dtype="bfloat16"),
    Case("layers-fp32", **LAYERS),
    Case("layers-bf16", **LAYERS, dtype="bfloat16", slow=True),
    Case("layers-bf16-small", **LAYERS_SMALL, dtype="bfloat16"),
    Case("layers-fp32-ckpt", **LAYERS, checkpointing=True),
    Case("vocab-fp32", **VOCAB),
    Case("vocab-bf16-tied", **{**VOCAB, "kv_heads": 2}, dtype="bfloat16", tied=True, slow=True),
    Case("vocab-bf16-tied-small", **{**VOCAB_SMALL, "kv_heads": 1}, dtype="bfloat16", tied=True),
    Case("params-fp32", layers=4, hidden=512, heads=8, kv_heads=8, ffn=1376, batch=1, seq=32),
    Case("mistral-bf16-gqa", arch="mistral", kv_heads=2, dtype="bfloat16", slow=True),
    Case("mistral-bf16-gqa-small", **{**BASE_SMALL, "kv_heads": 1}, arch="mistral", dtype="bfloat16"),
    Case("mistral-fp32-ckpt", arch="mistral", kv_heads=2, checkpointing=True, layers=4, batch=4),
    Case("qwen2-fp32-gqa", arch="qwen2", kv_heads=2),
    Case("qwen2-bf16-tied", arch="qwen2", kv_heads=2, tied=True, dtype="bfloat16", slow=True),
    Case("qwen2-bf16-tied-small", **{**BASE_SMALL, "kv_heads": 1}, arch="qwen2", tied=True, dtype="bfloat16"),
    # bf16-mixed: what the transformers Trainer's bf16=True does (autocast over an fp32 model)
    Case("autocast-base", autocast=True, slow=True),
    Case("autocast-base-small", **BASE_SMALL, autocast=True),
    Case("autocast-vocab", **VOCAB, autocast=True, slow=True),
    Case("autocast-vocab-small", **VOCAB_SMALL, autocast=True),
    Case("autocast-layers-gqa", **LAYERS, autocast=True, slow=True),
    Case("autocast-layers-gqa-small", **LAYERS_SMALL, autocast=True),
    Case("autocast-layers-gqa4", **WIDE, heads=8, kv_heads=2, autocast=True, slow=True),
    Case("autocast-layers-gqa4-small", **WIDE_SMALL, heads=4, kv_heads=1, autocast=True),
    Case("autocast-layers-mha", **WIDE, heads=4, kv_heads=4, autocast=True, slow=True),
    Case("autocast-layers-mha-small", **WIDE_SMALL, heads=2, kv_heads=2, autocast=True),
    # CUDA's kernels, reproduced on CPU by forcing SDPA's backend: fp32 with GQA runs the math path
    # on CUDA (flash and cuDNN need fp16/bf16, the memory-efficient kernel takes no enable_gqa)
    Case("cuda-math-fp32-gqa", **MATH, device="cuda"),
    Case("cuda-math-layers-fp32", **LAYERS, device="cuda"),
    Case("cuda-math-fp32-gqa-ckpt", **MATH, checkpointing=True, device="cuda"),
]
# every case again through transformers.Trainer (runtime hf), named trainer-<case>: a slow case's
# trainer variant is slow too, with its twin trainer-<case>-small in the default suite
TRAINER = [dataclasses.replace(c, name=f"trainer-{c.name}", loop="trainer") for c in HAND]
CASES = HAND + TRAINER


def predict_peak(case: Case) -> tuple[int, str]:
    """memplan's peak.allocated for a case (``--runtime hf`` for the Trainer's loop, ``hf-loop``
    for the hand-written one), from its config.json as it is."""
    report = predict_report(case)
    return report.peak.allocated, report.peak.phase


def predict_report(case: Case):
    """memplan's estimate for a case with its loop's runtime (``Case.runtime``: hf for the
    Trainer, hf-loop for the hand-written loop), from its config.json as it is."""
    from memplan.costmodel.memory import estimate_training
    from memplan.specs.loader import model_from_data
    from memplan.specs.plan import Plan
    from memplan.specs.workload import TrainingWorkload

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = Plan(
        precision=case.precision,
        autocast=case.plan_autocast,
        recompute="full" if case.checkpointing else "none",
        attention="eager" if case.attention == "eager" else "flash",
    )
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch, global_batch=case.batch * case.ga)
    return estimate_training(model, workload, plan, runtime=case.runtime, device=case.device)


def training_args(out: str, case, steps: int, ga: int = 1) -> transformers.TrainingArguments:
    """The ``TrainingArguments`` every CPU harness of the Trainer runs: the case's batch, ``bf16``
    (autocast) and checkpointing, ``ga`` micro-batches an update, ``steps`` updates, the defaults'
    optimizer and clipping, nothing logged or saved, no loader workers."""
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=case.batch,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        learning_rate=1e-4,
        use_cpu=True,
        bf16=case.autocast,
        gradient_checkpointing=case.checkpointing,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
