"""An LLM.int8 base under the Trainer's FSDP2: the real Trainer cannot run it, and the estimate refuses it.

Rank 0 of two under torch's fake process group on CPU (tests/accuracy/hf_fsdp_steps.py), a tiny Llama loaded with
``BitsAndBytesConfig(load_in_8bit=True)`` and PEFT LoRA on q/v (tests/accuracy/peft_steps.py), the Trainer's
``fsdp=True`` with ``fsdp_config={"version": 2, ...}`` (transformers 5.23, accelerate 1.15, bitsandbytes 0.50.2):
``fully_shard`` turns each ``Int8Params`` into a DTensor shard and gathers it back before the forward as a plain
``nn.Parameter`` (``FSDPParam.init_unsharded_param``), so ``Linear8bitLt.forward`` raises at its first
``self.weight.CB``::

    File ".../bitsandbytes/nn/modules.py", line 1182, in forward
        if self.weight.CB is not None:
    AttributeError: 'Parameter' object has no attribute 'CB'

``specs.job.check_fsdp_int8`` refuses such a plan in one line (exit 2). The ``full_shard`` case runs by default
(about 3 s); ``shard_grad_op`` under ``-m slow``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_fsdp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import peft_steps  # noqa: E402

from memplan.errors import MemplanError  # noqa: E402
from memplan.specs.job import check_fsdp_int8  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

CASE = peft_steps.PeftCase("hffsdp-int8-qv", **{**peft_steps.TINY, "quant": "int8"})


@pytest.mark.parametrize("zero", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_the_trainer_cannot_run_an_int8_base_under_fsdp2(zero: int) -> None:
    with pytest.raises(AttributeError, match="'Parameter' object has no attribute 'CB'"):
        hf_fsdp_steps.measure(CASE, reshard=zero >= 3)


def test_the_plan_is_refused_in_one_line(capsys) -> None:
    from memplan.cli.app import run

    for zero in (2, 3):
        with pytest.raises(MemplanError, match=r"8-bit \(LLM.int8\) base cannot run under the Trainer's FSDP2"):
            check_fsdp_int8(Plan(dp=2, zero=zero, finetune="qlora", quant="int8", precision="bf16"), "hf")
    # DDP runs it (hf_ddp.py), the bundled trainer and DeepSpeed's ZeRO (a master-weight precision) are not this path
    check_fsdp_int8(Plan(dp=2, zero=0, finetune="qlora", quant="int8", precision="bf16"), "hf")
    check_fsdp_int8(Plan(dp=2, zero=3, finetune="qlora", quant="int8", precision="bf16"), "memplan")
    check_fsdp_int8(Plan(dp=2, zero=3, finetune="qlora", quant="nf4", precision="bf16"), "hf")
    args = ["estimate", "llama3-8b", "--runtime", "hf", "--finetune", "qlora", "--quant", "int8", "--gpus", "2"]
    assert run([*args, "--zero", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "cannot run under the Trainer's FSDP2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    )
    assert run([*args, "--zero", "0"]) == 0
    capsys.readouterr()
