"""Fine-tuning exports: ``--to hf-trainer`` (TrainingArguments / SFTConfig, LoraConfig,
BitsAndBytesConfig, from_pretrained kwargs in one YAML) and ``--to axolotl``.

- round trips over a grid of plans (full, LoRA, QLoRA nf4 / fp4 with and without double
  quantization, int8, q/v and all-linear targets, modules_to_save, recomputation, precisions,
  ZeRO 0/2/3 with dp > 1, DeepSpeed and FSDP);
- each hf-trainer section built with its real class (transformers, PEFT, bitsandbytes, Accelerate's
  DeepSpeed plugin), the adapters applied to a small Llama;
- axolotl's keys against its schema (axolotl does not install here);
- refusals naming the field, and the one-line CLI errors.
"""

from __future__ import annotations

import json

import pytest
import yaml

from memplan.cli.app import run
from memplan.errors import MemplanError
from memplan.export import TARGETS, export, parse, render
from memplan.export.common import finetune_fields

L8 = "llama3-8b"
FT = ("hf-trainer", "axolotl")
CLI = "command line"

# plan flags, export options; every case exported to both targets unless the target is named
GRID = [
    (dict(gpus=1, precision="bf16"), {}),
    (dict(gpus=8, zero=3, precision="bf16-master", recompute="full"), {}),
    (dict(gpus=1, finetune="lora", precision="bf16"), {}),
    (dict(gpus=1, finetune="lora", lora_rank=64, lora_targets=("all-linear",), lora_dropout=0.05,
          modules_to_save=("lm_head",), recompute="full", precision="bf16"), {}),
    (dict(gpus=1, finetune="qlora", precision="bf16", recompute="full"), {}),
    (dict(gpus=1, finetune="lora", lora_dora=True, precision="bf16", recompute="full"), {}),  # PEFT's use_dora
    (dict(gpus=1, finetune="qlora", quant="fp4", precision="bf16"), {}),
    (dict(gpus=1, finetune="qlora", quant="nf4", double_quant=False, precision="bf16"), {}),
    (dict(gpus=1, finetune="qlora", quant="fp4", double_quant=True, lora_targets=("all-linear",), precision="bf16"),
     {}),
    (dict(gpus=1, finetune="lora", quant="int8", precision="bf16", lora_targets=("q_proj", "k_proj", "v_proj")), {}),
    (dict(gpus=1, finetune="qlora", quant="int8", precision="bf16"), {}),  # reads back as lora (8-bit base)
    (dict(gpus=1, finetune="lora", quant="nf4", precision="bf16"), {}),  # reads back as qlora (4-bit base)
    (dict(gpus=1, finetune="qlora", precision="fp32"), {}),
    # a bfloat16 model without the Trainer's bf16=True (autocast off): the plan's, or hf-loop's recipe
    (dict(gpus=1, finetune="lora", precision="bf16", autocast=False, recompute="full"), {}),
    (dict(gpus=1, finetune="qlora", precision="bf16", autocast=False), {}),
    (dict(gpus=1, finetune="lora", quant="int8", precision="bf16", autocast=False), {}),
    (dict(gpus=1, finetune="lora", precision="bf16", runtime="hf-loop"), {}),
    (dict(gpus=1, finetune="lora", precision="bf16-master"), {}),  # fp32 master weights: DeepSpeed stage 0
    (dict(gpus=8, zero=2, finetune="lora", precision="bf16-mixed", seq_len=4096, micro_batch=2, global_batch=64), {}),
    (dict(gpus=8, zero=3, finetune="qlora", lora_targets=("all-linear",), precision="bf16-master", recompute="full"),
     {}),
    (dict(gpus=8, zero=3, finetune="lora", precision="bf16", offload_optimizer="cpu", offload_params="cpu"), {}),
    (dict(gpus=8, zero=2, finetune="lora", precision="fp16-master", optimizer="adamw-8bit", quant="int8"), {}),
    (dict(gpus=16, zero=3, finetune="qlora", precision="bf16-mixed", recompute="full"), {"sharding": "fsdp"}),
    (dict(gpus=8, zero=2, finetune="lora", precision="fp32", attention="eager"), {"sharding": "fsdp"}),
    # DoRA and QDoRA under FSDP2 (tests/unit/test_timeline_hf_dora_fsdp.py): use_dora / peft_use_dora with fsdp
    (dict(gpus=8, zero=3, finetune="lora", lora_dora=True, precision="bf16-mixed", recompute="full"),
     {"sharding": "fsdp"}),
    (dict(gpus=8, zero=2, finetune="qlora", lora_dora=True, precision="bf16-mixed", recompute="full"),
     {"sharding": "fsdp"}),
    (dict(gpus=8, zero=3, finetune="lora", precision="bf16-mixed", offload_optimizer="cpu", offload_params="cpu"),
     {"sharding": "fsdp"}),
    (dict(gpus=2, finetune="lora", precision="bf16", optimizer="sgd", offload_activations="cpu"), {}),
    (dict(gpus=1, finetune="lora", precision="bf16", optimizer="adafactor", recompute="full"),
     {"gradient_clipping": 0.3}),
]  # fmt: skip
# plain-Trainer precisions axolotl has no flag for (it loads bf16 weights whenever bf16 is on)
HF_ONLY = [
    (dict(gpus=1, finetune="qlora", precision="bf16-mixed", recompute="full"), {}),
    (dict(gpus=8, finetune="lora", precision="bf16-mixed", lora_targets=("all-linear",)), {}),
    (dict(gpus=1, finetune="lora", quant="int8", precision="bf16-mixed"), {}),
]
CASES = [(t, flags, opts) for flags, opts in GRID for t in FT] + [("hf-trainer", f, o) for f, o in HF_ONLY]


def _job(make_job, flags):
    return make_job(L8, **flags)


@pytest.mark.parametrize(("target", "flags", "opts"), CASES)
def test_export_reads_back_to_the_same_plan(make_job, target, flags, opts):
    job = _job(make_job, flags)
    exported = render(job, target, **opts)
    back = parse(target, exported.text)
    assert set(back) == set(TARGETS[target].CARRIES)
    want = finetune_fields(job)
    assert {k: want[k] for k in back} == back


def test_lora_over_a_4_bit_base_is_qlora_and_over_an_8_bit_one_lora(make_job):
    for target in FT:
        nf4 = parse(target, export(make_job(L8, gpus=1, finetune="lora", quant="nf4", precision="bf16"), target))
        assert (nf4["finetune"], nf4["quant"]) == ("qlora", "nf4")
        int8 = parse(target, export(make_job(L8, gpus=1, finetune="qlora", quant="int8", precision="bf16"), target))
        assert (int8["finetune"], int8["quant"]) == ("lora", "int8")


# ---- hf-trainer: every section through its real class ----


def _sections(job, **opts):
    return yaml.safe_load(render(job, "hf-trainer", **opts).text)


def _training_arguments(tmp_path, monkeypatch, args, dp):
    transformers = pytest.importorskip("transformers")
    # DeepSpeed's train_batch_size must agree with the Trainer's world size: the plan's dp
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: dp))
    # use_cpu: TrainingArguments refuses bf16 without a bf16-capable GPU otherwise
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **args)


@pytest.mark.parametrize(("flags", "opts"), [c for c in GRID + HF_ONLY])
def test_training_arguments_take_the_section(make_job, tmp_path, monkeypatch, flags, opts):
    job = _job(make_job, flags)
    cfg = _sections(job, **opts)
    args = cfg["training_arguments"]
    p, f = job.plan, finetune_fields(job)
    ta = _training_arguments(tmp_path, monkeypatch, args, p.dp)
    assert ta.per_device_train_batch_size == f["micro_batch"]
    assert ta.gradient_accumulation_steps == f["gradient_accumulation"]
    assert ta.optim.value == args["optim"]
    assert ta.max_grad_norm == opts.get("gradient_clipping", 1.0)
    if "deepspeed" in args:
        ds = ta.hf_deepspeed_config
        assert ds.mismatches == []  # batch, accumulation, clipping, fp16 / bf16 agree with the Trainer's
        from accelerate.utils import DeepSpeedPlugin

        # what Accelerate makes of the config under the Trainer's mixed precision: the plan's precision
        plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(args["deepspeed"])))
        plugin.set_mixed_precision(ta.mixed_precision)
        from memplan.export import deepspeed

        final = deepspeed.parse(json.dumps(plugin.deepspeed_config))
        assert final["precision"] == p.precision
        assert final["zero"] == p.zero
    elif "fsdp" in args:
        plugin = ta.fsdp_plugin_args
        assert plugin["fsdp_version"] == 2
        assert plugin["reshard_after_forward"] == (p.zero == 3)
        assert plugin.get("cpu_offload", False) == (p.offload_params == "cpu")
        assert plugin["activation_checkpointing"] == (p.recompute == "full")
        assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
        assert not ta.gradient_checkpointing
    else:
        assert ta.gradient_checkpointing == (p.recompute == "full")


@pytest.mark.parametrize(("flags", "opts"), [c for c in GRID + HF_ONLY if c[0].get("finetune", "full") != "full"])
def test_lora_and_quantization_sections_build_peft_and_bitsandbytes_configs(make_job, flags, opts):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    job = _job(make_job, flags)
    cfg = _sections(job, **opts)
    p = job.plan
    lora = peft.LoraConfig(**cfg["lora"])
    assert lora.r == p.lora_rank and lora.lora_dropout == p.lora_dropout
    assert lora.task_type == "CAUSAL_LM"
    want_targets = "all-linear" if p.lora_targets == ("all-linear",) else set(p.lora_targets)
    assert lora.target_modules == want_targets
    assert tuple(lora.modules_to_save or ()) == p.modules_to_save
    if p.quant == "none":
        assert "quantization" not in cfg
        return
    bnb = transformers.BitsAndBytesConfig(**cfg["quantization"])
    if p.quant == "int8":
        assert bnb.load_in_8bit and not bnb.load_in_4bit
    else:
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == p.quant
        assert bnb.bnb_4bit_use_double_quant == p.double_quant
        import torch

        want = torch.float32 if p.precision == "fp32" else torch.bfloat16
        assert bnb.bnb_4bit_compute_dtype == want


TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128,
)  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        dict(gpus=1, finetune="lora", precision="bf16", recompute="full"),
        dict(gpus=1, finetune="lora", lora_targets=("all-linear",), modules_to_save=("lm_head",), precision="bf16"),
        dict(gpus=1, finetune="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), precision="bf16-mixed"),
        dict(gpus=1, precision="bf16", attention="eager"),
    ],
)
def test_model_and_lora_sections_apply_to_a_small_llama(make_job, flags):
    """``from_config(**model)`` (dtype, attn_implementation) and ``get_peft_model(LoraConfig(**lora))``:
    the adapters land on the modules the plan names and only they (and modules_to_save) train."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch

    job = _job(make_job, flags)
    cfg = _sections(job)
    model_kwargs = {k: v for k, v in cfg["model"].items() if k != "pretrained_model_name_or_path"}
    model_kwargs["dtype"] = getattr(torch, model_kwargs["dtype"])
    config = transformers.LlamaConfig(**TINY_LLAMA)
    model = transformers.AutoModelForCausalLM.from_config(config, **model_kwargs)
    assert model.dtype == model_kwargs["dtype"]
    assert model.config._attn_implementation == cfg["model"]["attn_implementation"]
    p = job.plan
    if p.finetune == "full":
        assert "lora" not in cfg
        return
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**cfg["lora"]))
    trainable = {n for n, q in peft_model.named_parameters() if q.requires_grad}
    wrapped = {n.split(".lora_")[0].split(".")[-1] for n in trainable if ".lora_" in n}
    linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert wrapped == (linear if p.lora_targets == ("all-linear",) else set(p.lora_targets))
    saved = {n for n in trainable if ".lora_" not in n}
    assert all("lm_head" in n for n in saved) and bool(saved) == bool(p.modules_to_save)
    ids = torch.randint(0, 256, (1, 8))
    peft_model(input_ids=ids, labels=ids).loss.backward()


# TRL SFTConfig's own fields (trl/trainer/sft_config.py, huggingface/trl 016013e8); TRL is not installed here
SFT_CONFIG_FIELDS = {
    "model_init_kwargs", "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc",
    "eos_token", "max_length", "truncation_mode", "shuffle_dataset", "packing", "packing_strategy", "padding_free",
    "pad_to_multiple_of", "eval_packing", "completion_only_loss", "assistant_only_loss", "loss_type",
    "activation_offloading",
}  # fmt: skip


@pytest.mark.parametrize(("flags", "bf16"), [(dict(autocast=False), False), ({}, True), (dict(autocast=True), True)])
def test_a_bf16_model_without_autocast_is_written_without_bf16(make_job, flags, bf16):
    """Precision bf16 is a bfloat16 model either way; the Trainer's ``bf16`` (axolotl's ``bf16``, else its
    non-AMP ``bfloat16``) is the plan's ``autocast``, on by default under ``--runtime hf``."""
    job = make_job(L8, gpus=1, finetune="lora", precision="bf16", **flags)
    cfg = _sections(job)
    assert cfg["model"]["dtype"] == "bfloat16" and cfg["training_arguments"]["bf16"] is bf16
    axolotl = yaml.safe_load(render(job, "axolotl").text)
    assert axolotl["bf16"] is bf16 and axolotl.get("bfloat16", False) is not bf16


def test_sft_section_is_sft_config_fields(make_job):
    for flags, opts in GRID + HF_ONLY:
        cfg = _sections(_job(make_job, flags), **opts)
        assert set(cfg["sft"]) <= SFT_CONFIG_FIELDS
        assert cfg["sft"]["loss_type"] in ("nll", "dft", "chunked_nll")


def test_hf_trainer_notes_say_what_the_script_must_do(make_job):
    qlora = render(make_job(L8, gpus=1, finetune="qlora", precision="bf16-mixed", recompute="full"), "hf-trainer")
    text = " ".join(qlora.notes)
    assert "prepare_model_for_kbit_training" in text and "enable_input_require_grads" in text
    assert "get_peft_model" in text and "SFTConfig(**training_arguments, **sft)" in text
    bf16 = render(make_job(L8, gpus=1, finetune="qlora", precision="bf16"), "hf-trainer")
    text = " ".join(bf16.notes)  # as the estimate: unquantized weights fp32, adapters fp32 (PEFT's defaults)
    assert "prepare_model_for_kbit_training" in text and "autocast_adapter_dtype=True" in text
    lora = render(make_job(L8, gpus=1, finetune="lora", precision="bf16", recompute="full"), "hf-trainer")
    assert "enable_input_require_grads" in " ".join(lora.notes)
    offload = render(make_job(L8, gpus=1, finetune="lora", precision="bf16", offload_activations="cpu"), "hf-trainer")
    assert "save_on_cpu" in " ".join(offload.notes)
    for exported in (qlora, bf16, lora, offload):
        for note in exported.notes:
            assert note.split()[0] in exported.text


# ---- axolotl: keys against its schema ----

# axolotl-ai-cloud/axolotl 067b021c, src/axolotl/utils/schemas/: the top-level keys memplan may write
# (config.py AxolotlInputConfig, peft.py LoraConfig, training.py, model.py) and FSDPConfig's (fsdp.py);
# documented in docs/config-reference.qmd (generated from those models)
AXOLOTL_KEYS = {
    "base_model", "load_in_8bit", "load_in_4bit", "bnb_config_kwargs", "adapter", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_target_linear", "lora_modules_to_save", "peft_use_dora",
    "sequence_len", "pad_to_sequence_len", "sample_packing", "micro_batch_size", "gradient_accumulation_steps",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading", "bf16", "bfloat16", "fp16",
    "optimizer",
    "max_grad_norm", "attn_implementation", "deepspeed", "fsdp_version", "fsdp_config",
}  # fmt: skip
AXOLOTL_FSDP_KEYS = {
    "fsdp_version", "activation_checkpointing", "offload_params", "sync_module_states", "cpu_ram_efficient_loading",
    "cpu_offload_pin_memory", "use_orig_params", "state_dict_type", "final_state_dict_type", "auto_wrap_policy",
    "transformer_layer_cls_to_wrap", "min_num_params", "reshard_after_forward", "mixed_precision_policy",
}  # fmt: skip


@pytest.mark.parametrize(("flags", "opts"), GRID)
def test_axolotl_keys_are_axolotl_config_keys(make_job, tmp_path, monkeypatch, flags, opts):
    job = _job(make_job, flags)
    cfg = yaml.safe_load(render(job, "axolotl", **opts).text)
    assert set(cfg) <= AXOLOTL_KEYS, set(cfg) - AXOLOTL_KEYS
    assert set(cfg.get("fsdp_config") or {}) <= AXOLOTL_FSDP_KEYS
    p = job.plan
    # axolotl's validation (schemas/peft.py): qlora needs load_in_4bit and no load_in_8bit; a quantized base an adapter
    if cfg.get("adapter") == "qlora":
        assert cfg["load_in_4bit"] and not cfg.get("load_in_8bit")
    if cfg.get("load_in_4bit") or cfg.get("load_in_8bit"):
        assert cfg.get("adapter") in ("lora", "qlora")
    assert isinstance(cfg["bf16"], bool)  # axolotl's default is "auto"
    assert not (cfg.get("fsdp_config", {}).get("activation_checkpointing") and cfg["gradient_checkpointing"])
    if "bnb_config_kwargs" in cfg:  # axolotl updates its BitsAndBytesConfig kwargs with these
        transformers = pytest.importorskip("transformers")
        bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, **cfg["bnb_config_kwargs"])
        assert (bnb.bnb_4bit_quant_type, bnb.bnb_4bit_use_double_quant) == (p.quant, p.double_quant)
    if "deepspeed" in cfg:  # axolotl hands it to TrainingArguments with its batch keys
        args = dict(
            per_device_train_batch_size=cfg["micro_batch_size"],
            gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
            max_grad_norm=cfg["max_grad_norm"],
            bf16=cfg["bf16"],
            fp16=cfg["fp16"],
            deepspeed=cfg["deepspeed"],
        )
        assert _training_arguments(tmp_path, monkeypatch, args, p.dp).hf_deepspeed_config.mismatches == []


# ---- refusals ----

REFUSALS = [
    # target, flags, opts, field, words in the reason
    (dict(gpus=2, tp=2, finetune="qlora"), {}, "plan.tp", "tensor parallelism"),
    (dict(gpus=2, pp=2, finetune="lora"), {}, "plan.pp", "pipeline"),
    (dict(gpus=2, cp=2, finetune="lora"), {}, "plan.cp", "context parallelism"),
    (dict(gpus=8, precision="fp8"), {}, "plan.precision", "bf16 and fp16"),
    (dict(gpus=1, finetune="lora", recompute="selective"), {}, "plan.recompute", "whole decoder layers"),
    (dict(gpus=1, finetune="lora", recompute="selective-op"), {}, "plan.recompute", "whole decoder layers"),
    (dict(gpus=1, finetune="lora", recompute="full", recompute_layers=4), {}, "plan.recompute_layers", "every"),
    (dict(gpus=8, zero=3, finetune="lora", offload_params="nvme", offload_optimizer="nvme"), {}, "plan.offload_params",
     "--nvme-path"),
    (dict(gpus=8, zero=2, finetune="lora", offload_optimizer="nvme"), {}, "plan.offload_optimizer", "NVMe"),
    (dict(gpus=8, zero=3, finetune="lora", quant="int8", precision="bf16-master"), {}, "plan.quant", "8-bit"),
    (dict(gpus=8, zero=1, finetune="lora"), {"sharding": "fsdp"}, "plan.zero", "ZeRO-2"),
    (dict(gpus=8, zero=3, finetune="lora", precision="bf16-master"), {"sharding": "fsdp"}, "plan.precision", "fp32"),
    (dict(gpus=8, zero=3, finetune="lora", precision="bf16-mixed", offload_optimizer="cpu"), {"sharding": "fsdp"},
     "plan.offload_params", "together"),
    (dict(gpus=8, zero=2, finetune="lora", offload_optimizer="cpu", optimizer="sgd"), {}, "plan.offload_optimizer",
     "CPU Adam"),
    (dict(gpus=1, finetune="lora", attention="triton"), {}, "plan.attention", "bundled trainer"),
    (dict(gpus=1, finetune="lora"), {"sharding": "zero"}, "--sharding", "zero"),
    (dict(gpus=8, zero=2, finetune="lora", precision="bf16", autocast=False), {}, "plan.autocast", "DeepSpeed"),
]  # fmt: skip
AXOLOTL_REFUSALS = [
    (dict(gpus=1, finetune="qlora", precision="bf16-mixed"), {}, "plan.precision", "torch_autocast"),
    (dict(gpus=1, finetune="lora", quant="int8", precision="fp32"), {}, "plan.precision", "float16"),
]


@pytest.mark.parametrize(
    ("target", "flags", "opts", "field", "reason"),
    [(t, *case) for case in REFUSALS for t in FT] + [("axolotl", *case) for case in AXOLOTL_REFUSALS],
)
def test_inexpressible_fine_tuning_plan_is_refused(make_job, target, flags, opts, field, reason):
    model = "mixtral-8x7b" if "ep" in flags else L8
    job = make_job(model, **flags)
    with pytest.raises(MemplanError) as err:
        export(job, target, **opts)
    assert err.value.field == field, err.value
    assert reason in err.value.reason, err.value.reason
    if field.startswith("plan.") and field != "plan.attention":
        assert f"{target} cannot express" in err.value.reason


@pytest.mark.parametrize(
    "flags",
    [dict(gpus=8, zero=3, finetune="lora", quant="int8"), dict(gpus=8, zero=2, finetune="lora", quant="int8")],
)
def test_an_int8_base_under_the_trainers_fsdp2_is_refused_before_export(make_job, flags):
    """The Trainer cannot run it (``specs.job.check_fsdp_int8``, tests/unit/test_timeline_hf_fsdp_int8.py): the
    job itself is refused, on --quant, before any exporter is asked."""
    with pytest.raises(MemplanError) as err:
        make_job(L8, **flags)
    assert err.value.field == "--quant" and "8-bit" in err.value.reason and "FSDP2" in err.value.reason


@pytest.mark.parametrize("target", ["deepspeed", "accelerate", "torchtitan", "megatron", "fsdp2"])
def test_full_training_targets_refuse_adapters_and_activation_offload(make_job, target):
    with pytest.raises(MemplanError) as err:
        export(make_job(L8, gpus=8, zero=3, precision="bf16-mixed", finetune="qlora"), target)
    assert err.value.field == "plan.finetune" and "hf-trainer or axolotl" in err.value.reason
    with pytest.raises(MemplanError) as err:
        export(make_job(L8, gpus=8, zero=3, precision="bf16-mixed", offload_activations="cpu"), target)
    assert err.value.field == "plan.offload_activations"


@pytest.mark.parametrize("target", FT)
def test_inference_workloads_are_refused(target):
    from memplan.specs.resolve import resolve_job

    job = resolve_job(L8, None, {"batch": 8}, inference=True)
    with pytest.raises(MemplanError) as err:
        export(job, target)
    assert err.value.field == "workload.kind"


# ---- the CLI ----


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def error_line(capsys, *args: object) -> str:
    """The one-line error contract (tests/cli/test_bad_input.py): exit 2, nothing on stdout, one
    ``memplan: error: SOURCE: FIELD: reason`` line; returns the text after the prefix."""
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "" and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("memplan: error: ")
    return err.removeprefix("memplan: error: ").rstrip("\n")


BASE = ["export", "--model", L8]


@pytest.mark.parametrize("target", FT)
@pytest.mark.parametrize(
    ("args", "head", "reason"),
    [
        (["--gpus", "2", "--finetune", "qlora", "--tp", "2"], f"{CLI}: --tp: ", "cannot express tp=2"),
        (["--gpus", "8", "--finetune", "lora", "--zero", "3", "--quant", "int8"], f"{CLI}: --quant: ", "8-bit"),
        (["--gpus", "1", "--finetune", "lora", "--recompute", "selective"], f"{CLI}: --recompute: ", "whole decoder"),
        (["--gpus", "8", "--zero", "2", "--sharding", "fsdp", "--precision", "bf16"], f"{CLI}: --precision: ", "FSDP"),
        (["--gpus", "1", "--finetune", "lora", "--attention", "triton"], f"{CLI}: --attention: ", "triton"),
        (
            ["--gpus", "1", "--finetune", "lora", "--lora-targets", "q_proj,,v_proj"],
            f"{CLI}: --lora-targets: ",
            "empty",
        ),
        (["--gpus", "1", "--finetune", "full", "--lora-rank", "8"], f"{CLI}: --lora-rank: ", "lora or qlora"),
        (["--gpus", "1", "--finetune", "lora", "--sharding", "zero9"], f"{CLI}: --sharding: ", "zero9"),
    ],
)
def test_bad_fine_tuning_export_is_one_line_naming_the_flag(capsys, target, args, head, reason):
    message = error_line(capsys, *BASE, "--to", target, *args)
    assert message.startswith(head), message
    assert reason in message, message


def test_cli_writes_the_yaml_and_the_notes(capsys, tmp_path):
    out = tmp_path / "run.yaml"
    args = ["--finetune", "qlora", "--lora-targets", "all-linear", "--modules-to-save", "lm_head"]
    args += ["--precision", "bf16-mixed", "--recompute", "full"]
    code = run([*BASE, "--gpus", "1", *args, "--to", "hf-trainer", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert all(line.startswith("memplan: note: ") for line in err.splitlines())
    back = parse("hf-trainer", out.read_text())
    assert back["finetune"] == "qlora" and back["lora_targets"] == ("all-linear",)
    assert back["modules_to_save"] == ("lm_head",)
    code = run([*BASE, "--gpus", "8", "--zero", "3", "--finetune", "lora", "--precision", "bf16-mixed",
                "--sharding", "fsdp", "--to", "axolotl"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0
    cfg = yaml.safe_load(text)
    assert cfg["fsdp_version"] == 2 and cfg["adapter"] == "lora" and cfg["base_model"] == "meta-llama/Meta-Llama-3-8B"
