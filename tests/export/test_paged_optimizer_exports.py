"""bitsandbytes' paged optimizers through the fine-tuning exports: ``optim: paged_adamw_8bit`` (and
the other paged names) written, read back to the same plan, and taken by transformers' own
TrainingArguments and optimizer factory (PagedAdamW8bit with is_paged); the DeepSpeed note names the
bitsandbytes class."""

from __future__ import annotations

import pytest

from memplan.export import export, parse, render
from memplan.export.common import finetune_fields

L8 = "llama3-8b"
NAMES = {
    "paged-adamw-8bit": "paged_adamw_8bit",
    "paged-adamw-32bit": "paged_adamw_32bit",
    "paged-lion-8bit": "paged_lion_8bit",
    "paged-lion-32bit": "paged_lion_32bit",
}


@pytest.mark.parametrize("target", ["hf-trainer", "axolotl"])
@pytest.mark.parametrize("optimizer", list(NAMES))
def test_paged_optimizers_are_written_by_transformers_names_and_read_back(make_job, target, optimizer):
    job = make_job(L8, gpus=1, finetune="qlora", precision="bf16", recompute="full", optimizer=optimizer)
    text = export(job, target)
    assert NAMES[optimizer] in text
    back = parse(target, text)
    assert back["optimizer"] == optimizer
    want = finetune_fields(job)
    assert {k: want[k] for k in back} == back


@pytest.mark.parametrize("optimizer", list(NAMES))
def test_transformers_builds_the_paged_bitsandbytes_optimizer(make_job, tmp_path, optimizer):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    import yaml

    job = make_job(L8, gpus=1, finetune="lora", precision="bf16", optimizer=optimizer)
    args = yaml.safe_load(render(job, "hf-trainer").text)["training_arguments"]
    ta = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **args)
    assert ta.optim.value == NAMES[optimizer]
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(ta)
    assert kwargs["is_paged"] is True
    assert kwargs["optim_bits"] == (8 if optimizer.endswith("8bit") else 32)
    assert cls.__name__ == ("AdamW" if "adamw" in optimizer else "Lion")


def test_the_deepspeed_notes_name_the_paged_class(make_job):
    job = make_job(L8, gpus=8, zero=2, precision="bf16", optimizer="paged-adamw-8bit")
    notes = render(job, "deepspeed").notes
    assert any("bitsandbytes.optim.PagedAdamW8bit" in n for n in notes)
