"""The Trainer's optimizers other than fused AdamW beyond one dense rank, against the real ``transformers.Trainer``
on CPU (transformers 5.23, accelerate 1.15, bitsandbytes 0.50.2).

- DDP (two gloo ranks, tests/accuracy/hf_ddp_steps.py): each rank's optimizer states are the one-rank run's
  (``hf_optimizers.py``, ``hf_bnb_optim.py``) beside the reducer's buckets (``hf_ddp.py``); rank 0's peak of
  live storages equal to the byte.
- FSDP2 (rank 0 under the fake process group, tests/accuracy/hf_fsdp_steps.py): SGD steps the DTensor shards
  with no state, equal to the byte; Adafactor and bitsandbytes' optimizers raise at the Trainer's first
  optimizer step, and the estimate refuses them (``specs.job.check_fsdp_optimizer``).
- MoE and MLA families (one rank, tests/accuracy/hf_steps.py): Adafactor's factored states over 3-D experts
  per expert (``hf_optimizers.Param.lead``), bitsandbytes' states over them by their element count.

bitsandbytes' CPU kernels are called as Python functions so the tracker sees their temporaries
(tests/accuracy/optim_steps.py). The gloo cases take 40-70 s each on two busy cores (the fork server's imports):
all run under ``-m slow``; of the others (5-20 s) one of each kind runs by default.
"""

from __future__ import annotations

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_ddp_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_fsdp_steps  # noqa: E402
import hf_steps  # noqa: E402
import peft_steps  # noqa: E402
from optim_steps import trained_with  # noqa: E402
from test_timeline_hf_fsdp_qlora import FAST as QLORA_FAST  # noqa: E402
from test_timeline_hf_mla import CASES as MLA_CASES  # noqa: E402
from test_timeline_hf_mla import _fp32_score_bias  # noqa: E402
from test_timeline_hf_moe import CASES as MOE_CASES  # noqa: E402

from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# test_timeline_hf_optimizers.py's shapes: the parameters dominate (the peak in the optimizer's step), and a
# small one where the activations do
PARAMS = dict(vocab=4000, hidden=128, heads=2, kv_heads=1, ffn=344, batch=1, seq=16, layers=2, loop="trainer")
SMALL = dict(PARAMS, vocab=256, hidden=64, ffn=160, batch=2, seq=64)
LORA = dict(peft_steps.TINY, rank=32, targets=("all-linear",))


def _full(tag: str, **fields) -> hf_steps.Case:
    return hf_steps.Case(f"hfoptdist-{tag}", **{**PARAMS, **fields})


def _lora(tag: str, **fields) -> peft_steps.PeftCase:
    return peft_steps.PeftCase(f"hfoptdist-lora-{tag}", **{**LORA, **fields})


def predict(case, optimizer: str, dp: int = 1, zero: int = 0) -> int:
    """The run's peak for the case (full fine-tuning or PEFT LoRA, its family from its config.json) on rank 0
    of ``dp`` (DDP, or FSDP2 at ``zero`` 2 or 3), on CPU's kernels."""
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    update = dict(optimizer=optimizer, dp=dp, zero=zero)
    if isinstance(case, peft_steps.PeftCase):  # a 4-bit base loaded in the case's dtype, as its quant_storage
        plan = peft_steps.plan_of(case).model_copy(update=update)
    else:
        recompute = "full" if case.checkpointing else "none"
        plan = Plan(precision=case.precision, autocast=case.plan_autocast, recompute=recompute, **update)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    # subclass_like: the tracker is a dispatch mode (hf_moe_ops.zeros_then_put)
    timeline = hf_predict(case, plan, subclass_like=model.moe is not None)
    return timeline.peak()[0]


def _check(case, optimizer: str, measured: int, **ranks) -> None:
    predicted = predict(case, optimizer, **ranks)
    assert predicted == measured, f"{case.name} {optimizer}: {predicted:,} B predicted, {measured:,} B measured"


# --- DDP: rank 0 of two gloo ranks -----------------------------------------------------------------------
DDP_FULL = [
    pytest.param(_full("ddp-fp32"), "paged-adamw-8bit", id="paged-adamw-8bit-fp32", marks=pytest.mark.slow),
    pytest.param(_full("ddp-bf16", dtype="bfloat16"), "adafactor", id="adafactor-bf16", marks=pytest.mark.slow),
    pytest.param(_full("ddp-fp32"), "sgd", id="sgd-fp32", marks=pytest.mark.slow),
    pytest.param(
        _full("ddp-ckpt", checkpointing=True), "paged-lion-32bit", id="lion-32bit-ckpt", marks=pytest.mark.slow
    ),
    pytest.param(
        _full("ddp-tied-bf16", tied=True, dtype="bfloat16"), "adamw-8bit", id="8bit-tied", marks=pytest.mark.slow
    ),
    pytest.param(_full("ddp-small", **SMALL), "adafactor", id="adafactor-small", marks=pytest.mark.slow),
]
DDP_OTHER = [
    (_lora("ddp-save-head", modules_to_save=("lm_head",)), "paged-adamw-8bit"),
    (_lora("ddp-ckpt", checkpointing=True), "adafactor"),
    (_lora("ddp-qlora-nf4-dq", quant="nf4", double_quant=True), "adamw-8bit"),
    (next(c for c in MOE_CASES if c.name == "hfmoe-mixtral-fp32"), "adafactor"),
    (next(c for c in MOE_CASES if c.name == "hfmoe-qwen3_moe-bf16"), "paged-lion-8bit"),
]


@pytest.mark.parametrize(("case", "optimizer"), DDP_FULL)
def test_ddp_full_fine_tuning_equals_rank_0s_peak(case: hf_steps.Case, optimizer: str) -> None:
    _check(case, optimizer, hf_ddp_steps.measure(case, optim=optimizer), dp=hf_ddp_steps.WORLD)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "optimizer"), DDP_OTHER, ids=lambda c: getattr(c, "name", c))
def test_ddp_lora_and_moe_equal_rank_0s_peak(case, optimizer: str) -> None:
    _check(case, optimizer, hf_ddp_steps.measure(case, optim=optimizer), dp=hf_ddp_steps.WORLD)


# --- FSDP2: rank 0 under the fake process group ----------------------------------------------------------
def _fsdp_measure(case, optimizer: str, seen: bool = True, reshard: bool = True) -> int:
    """Rank 0's peak under the Trainer's FSDP2 with ``optim`` set (``seen``: bitsandbytes' CPU kernels as Python
    functions; unset, their custom ops as the Trainer calls them, on CPU as on CUDA)."""
    training_args = hf_steps.training_args

    def with_optim(*args, **kwargs):
        out = training_args(*args, **kwargs)
        stack.enter_context(trained_with(out, optimizer, seen))
        return out

    import contextlib
    from unittest import mock

    with contextlib.ExitStack() as stack, mock.patch.object(hf_steps, "training_args", with_optim):
        return hf_fsdp_steps.measure(case, reshard=reshard)


FSDP_SGD = [
    pytest.param(_full("fsdp-sgd-small", **SMALL), 3, id="full-small-zero3"),
    pytest.param(_full("fsdp-sgd-bf16", dtype="bfloat16"), 2, id="bf16-zero2", marks=pytest.mark.slow),
    pytest.param(_full("fsdp-sgd-autocast", autocast=True), 3, id="bf16-true-zero3", marks=pytest.mark.slow),
    pytest.param(_lora("fsdp-sgd"), 3, id="lora-zero3", marks=pytest.mark.slow),
    pytest.param(QLORA_FAST[0], 3, id="qlora-nf4-zero3", marks=pytest.mark.slow),
    pytest.param(
        next(c for c in MOE_CASES if c.name == "hfmoe-mixtral-fp32"), 3, id="mixtral-zero3", marks=pytest.mark.slow
    ),
    pytest.param(
        next(c for c in MOE_CASES if c.name == "hfmoe-qwen3_moe-bf16"), 2, id="qwen3-moe-zero2", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("case", "zero"), FSDP_SGD)
def test_fsdp2_sgd_equals_rank_0s_peak(case, zero: int) -> None:
    measured = _fsdp_measure(case, "sgd", reshard=zero >= 3)
    _check(case, "sgd", measured, dp=hf_fsdp_steps.WORLD, zero=zero)


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ("adafactor", "got mixed torch.Tensor and DTensor"),
        pytest.param("paged-adamw-32bit", "does not have a sharding strategy", marks=pytest.mark.slow),
        # the embedding first, its states 32-bit by the Trainer's override: the same custom op
        pytest.param("adamw-8bit", "does not have a sharding strategy", marks=pytest.mark.slow),
    ],
)
def test_fsdp2_refuses_what_the_trainer_cannot_step(capsys, optimizer: str, message: str) -> None:
    """The real Trainer raises at its first optimizer step over DTensor parameters (bitsandbytes' kernels
    through their custom ops, as the Trainer calls them), and the estimate refuses the plan in one line."""
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        _fsdp_measure(_full("fsdp-refused", **SMALL), optimizer, seen=False)
    from memplan.errors import MemplanError
    from memplan.specs.job import check_fsdp_optimizer

    with pytest.raises(MemplanError, match=f"optimizer {optimizer} cannot step the Trainer's FSDP2"):
        check_fsdp_optimizer(Plan(dp=8, zero=3, optimizer=optimizer, precision="bf16"), "hf")
    # fp32 masters are DeepSpeed's ZeRO under the Trainer (the exporters' DeepSpeed configs): plain fp32 partitions
    check_fsdp_optimizer(Plan(dp=8, zero=3, optimizer=optimizer, precision="bf16-master"), "hf")


def test_the_cli_refuses_fsdp2_with_an_optimizer_it_cannot_step(capsys) -> None:
    from memplan.cli.app import run

    args = ["estimate", "llama3-8b", "--gpus", "8", "--zero", "3", "--runtime", "hf", "--optimizer", "paged-adamw-8bit"]
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "cannot step the Trainer's FSDP2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert run([*args[:5], "0", *args[6:]]) == 0  # --zero 0: DDP
    capsys.readouterr()


# --- MoE and MLA families on one rank ----------------------------------------------------------------------
def _family(name: str) -> hf_steps.Case:
    return next(c for c in MOE_CASES + MLA_CASES if c.name == name)


FAMILIES = [
    pytest.param("hfmoe-mixtral-fp32", "adafactor", id="mixtral-adafactor"),  # was 6,912 B under: the experts' states
    pytest.param("hfmla-fp32", "adafactor", id="deepseek-v3-adafactor", marks=pytest.mark.slow),  # was 5,376 B under
    pytest.param("hfmoe-mixtral-fp32", "sgd", id="mixtral-sgd", marks=pytest.mark.slow),
    pytest.param("hfmoe-mixtral-fp32", "adamw-8bit", id="mixtral-8bit", marks=pytest.mark.slow),
    pytest.param("hfmoe-mixtral-fp32", "paged-lion-32bit", id="mixtral-lion-32bit", marks=pytest.mark.slow),
    pytest.param("hfmoe-mixtral-bf16-ckpt", "paged-lion-8bit", id="mixtral-lion-8bit-bf16", marks=pytest.mark.slow),
    pytest.param("hfmoe-mixtral-autocast", "adafactor", id="mixtral-adafactor-autocast", marks=pytest.mark.slow),
    pytest.param("hfmoe-qwen3_moe-bf16", "adafactor", id="qwen3-moe-adafactor-bf16", marks=pytest.mark.slow),
    pytest.param("hfmoe-qwen3_moe-dense-fp32", "adamw-8bit", id="qwen3-moe-dense-8bit", marks=pytest.mark.slow),
    pytest.param("hfmoe-qwen2_moe-fp32", "adafactor", id="qwen2-moe-adafactor", marks=pytest.mark.slow),
    pytest.param("hfmoe-qwen2_moe-fp32", "paged-adamw-8bit", id="qwen2-moe-8bit", marks=pytest.mark.slow),
    pytest.param("hfmla-fp32", "paged-adamw-8bit", id="deepseek-v3-8bit", marks=pytest.mark.slow),
    pytest.param("hfmla-bf16-ckpt", "adafactor", id="deepseek-v3-adafactor-bf16-ckpt", marks=pytest.mark.slow),
    pytest.param("hfmla-autocast", "paged-adamw-32bit", id="deepseek-v3-32bit-autocast", marks=pytest.mark.slow),
    pytest.param("hfmla-wide-fp32", "adafactor", id="deepseek-v3-wide-adafactor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "optimizer"), FAMILIES)
def test_moe_and_mla_families_equal_the_trainers(name: str, optimizer: str) -> None:
    case = _family(name)

    def prepare(model, args, ids) -> None:
        _fp32_score_bias(model, args, ids)  # DeepSeek-V3's router bias as from_pretrained keeps it (else none)
        stack.enter_context(trained_with(args, optimizer))

    import contextlib

    with contextlib.ExitStack() as stack:
        measured = hf_steps._measure_trainer(case, STEPS, prepare)
    _check(case, optimizer, measured)


def test_adafactor_keeps_a_3d_experts_factored_states_per_expert() -> None:
    """Adafactor's states of Mixtral's experts (``gate_up_proj`` (E, 2f, h)): a row state of E x 2f and a column
    state of E x h elements (``grad_shape[:-2] + grad_shape[-1:]``), as the real optimizer makes them."""
    from memplan.costmodel.timeline.autograd import Tape
    from memplan.costmodel.timeline.events import ALLOC, Builder
    from memplan.costmodel.timeline.hf_optimizers import Adafactor, Param

    e, f, h = 4, 32, 16
    weight = torch.nn.Parameter(torch.zeros(e, 2 * f, h))
    weight.grad = torch.ones_like(weight)
    real = transformers.optimization.Adafactor([weight], lr=1e-3, scale_parameter=False, relative_step=False)
    real.step()
    shapes = {k: v.numel() for k, v in real.state[weight].items() if torch.is_tensor(v) and v.dim()}
    b = Builder()
    Adafactor().step(Tape(b), [Param("experts", e * 2 * f * h, 4, e * 2 * f, h, lead=e)], {}, first=True)
    made = [ev.size // 4 for ev in b.build().events if ev.op == ALLOC and ev.tag == "experts.exp_avg_sq"]
    assert shapes == {"exp_avg_sq_row": e * 2 * f, "exp_avg_sq_col": e * h}
    assert made == [shapes["exp_avg_sq_row"], shapes["exp_avg_sq_col"]]


def test_the_estimate_follows_the_optimizers_beyond_one_dense_rank(capsys) -> None:
    """``--dp 2 --zero 0`` (DDP) with a paged 8-bit optimizer, ``--zero 3`` with SGD and Mixtral with SGD or
    Adafactor: the op-level run answers; DDP's paged states per rank are one rank's."""
    base = ["llama3-8b", "--runtime", "hf", "--precision", "bf16", "--seq-len", "1024"]
    one = _estimate(capsys, [*base, "--optimizer", "paged-adamw-8bit"])
    ddp = _estimate(capsys, [*base, "--optimizer", "paged-adamw-8bit", "--dp", "2", "--zero", "0"])
    assert ddp["model"] == "op-level" and ddp["model_reason"] is None
    assert ddp["paged_optimizer_states"] == one["paged_optimizer_states"] > 0
    assert ddp["model_states"]["optimizer_states"] == one["model_states"]["optimizer_states"]
    sgd = _estimate(capsys, [*base, "--optimizer", "sgd", "--dp", "8", "--zero", "3"])
    assert sgd["model"] == "op-level" and sgd["model_states"]["optimizer_states"] == 0
    for optimizer in ("sgd", "adafactor"):
        moe = _estimate(capsys, ["mixtral-8x7b", "--runtime", "hf", "--precision", "bf16", "--optimizer", optimizer])
        assert moe["model"] == "op-level" and moe["model_reason"] is None, optimizer
