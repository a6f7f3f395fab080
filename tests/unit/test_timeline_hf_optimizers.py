"""The Trainer's optimizers other than fused AdamW in the op-level run (``timeline/hf_optimizers.py``,
``timeline/hf_bnb_optim.py``) against the real ``transformers.Trainer`` on CPU.

``TrainingArguments(optim=...)`` with ``sgd``, ``adafactor`` and bitsandbytes' ``adamw_bnb_8bit``,
``paged_adamw_8bit``, ``paged_adamw_32bit``, ``paged_lion_8bit``, ``paged_lion_32bit`` (bitsandbytes 0.50.2
runs them on CPU through its CPU backend; paged ones fall back to ``zeros_like`` there): full fine-tuning of
a tiny Llama in fp32 and bf16, and PEFT LoRA, the peak of live storages over three steps
(``StorageTracker``, tests/accuracy/hf_steps.py's harness) equal to the byte. CUDA's paged buffers (managed
memory, outside the allocator) are checked on the run's states: which go where.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile

import pytest
from estimate_json import estimate_memory as _estimate
from hf_predict import hf_predict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_peft_steps  # noqa: E402  (tests/accuracy, on sys.path by tests/conftest.py)
import hf_steps  # noqa: E402
import optim_steps  # noqa: E402
import peft_steps  # noqa: E402
from optim_steps import kernels_seen as _kernels_seen  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402

from memplan.costmodel.timeline.autograd import Tape  # noqa: E402
from memplan.costmodel.timeline.events import ALLOC, Builder, Category  # noqa: E402
from memplan.costmodel.timeline.hf_bnb_optim import BnbOptimizer  # noqa: E402
from memplan.costmodel.timeline.hf_optimizers import Param, trainer_optimizer  # noqa: E402
from memplan.costmodel.timeline.hf_support import hf_supported  # noqa: E402
from memplan.costmodel.timeline.hf_trainer import hf_plan_run  # noqa: E402
from memplan.specs.loader import model_from_data  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402
from memplan.specs.workload import TrainingWorkload  # noqa: E402

STEPS = 3
# the Trainer's optimizers other than its default, by memplan's names
OPTIM = {name: optim for name, optim in optim_steps.OPTIM.items() if name != "adamw"}
# full fine-tuning: the embedding and head (16,384 elements: 8-bit states but the embedding's, 32-bit
# under the Trainer's override), the layers' matrices (8,192 to 16,384) and norms (64: under 4,096)
FULL = dict(vocab=256, hidden=64, heads=2, kv_heads=1, ffn=160, batch=2, seq=64, layers=2, loop="trainer")
# the parameters dominate (a 4,000-token vocabulary, 16 tokens a step): the peak is in the optimizer's step
PARAMS = dict(FULL, vocab=4000, hidden=128, ffn=344, batch=1, seq=16)
# LoRA rank 32 on all linears: each adapter 2,048 to 5,120 elements, on both sides of 4,096
LORA = dict(peft_steps.TINY, rank=32, targets=("all-linear",))

PARAMS_LORA = dict(vocab=4000, hidden=128, batch=1, seq=16, modules_to_save=("lm_head",))


def _full(optimizer: str, tag: str, **fields) -> tuple[hf_steps.Case, str]:
    return hf_steps.Case(f"hfopt-full-{optimizer}-{tag}", **{**FULL, **fields}), optimizer


def _lora(optimizer: str, tag: str, **fields) -> tuple[peft_steps.PeftCase, str]:
    return peft_steps.PeftCase(f"hfopt-lora-{optimizer}-{tag}", **{**LORA, **fields}), optimizer


BF16 = dict(dtype="bfloat16")
FULL_CASES = [
    _full("sgd", "fp32"),
    _full("sgd", "bf16-ckpt", **BF16, checkpointing=True),
    _full("adafactor", "fp32"),
    _full("adafactor", "bf16", **BF16),
    _full("adafactor", "tied-ckpt", tied=True, checkpointing=True),
    _full("adamw-8bit", "fp32"),
    _full("adamw-8bit", "bf16", **BF16),
    _full("paged-adamw-8bit", "tied", tied=True),
    _full("paged-adamw-32bit", "fp32"),
    _full("paged-adamw-32bit", "bf16", **BF16),
    _full("paged-lion-8bit", "fp32"),
    _full("paged-lion-8bit", "bf16", **BF16),
    _full("paged-lion-32bit", "fp32"),
    *(_full(optimizer, "params-fp32", **PARAMS) for optimizer in OPTIM),
    *(_full(optimizer, "params-bf16", **PARAMS, **BF16) for optimizer in OPTIM),
]
LORA_CASES = [
    _lora("sgd", "fp32"),
    _lora("adafactor", "fp32"),
    _lora("adafactor", "save-head", modules_to_save=("lm_head",)),
    _lora("paged-adamw-8bit", "fp32"),
    _lora("paged-adamw-8bit", "save-embed", modules_to_save=("embed_tokens",)),
    _lora("paged-adamw-32bit", "ckpt", checkpointing=True),
    _lora("paged-lion-8bit", "autocast", autocast=True),
    _lora("adamw-8bit", "qlora-nf4-dq", quant="nf4", double_quant=True),
    *(_lora(o, "params-save-head", **PARAMS_LORA) for o in ("adafactor", "adamw-8bit", "paged-lion-32bit")),
]


def _train(model, case, optimizer: str, rows: list, ga: int = 1) -> int:
    """``Trainer.train()`` with ``optim`` set, its peak of live storages (the earlier cases' cyclic garbage
    collected first, so that no collection of it falls inside the run). bitsandbytes' ``GlobalOptimManager``
    is reset as a new process finds it: it keeps each override by (group, index) too (``check_overrides``:
    ``index2config``), so an earlier case's embedding override would give this case's parameter at the same
    place 32-bit states (a process that trains twice sees that; the run follows one training)."""
    gc.collect()
    tracker = StorageTracker()
    with tempfile.TemporaryDirectory() as out:
        args = hf_steps.training_args(out, case, STEPS, ga)
        with optim_steps.trained_with(args, optimizer):  # optim set, the manager reset, the CPU kernels seen
            trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
            tracker.track_module(model)
            if isinstance(case, peft_steps.PeftCase):
                tracker.track(*peft_steps.quant_state_tensors(model))
            with tracker:
                trainer.train()
    return tracker.peak


def _measure_full(case: hf_steps.Case, optimizer: str) -> int:
    model = hf_steps._model(case)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    return _train(model, case, optimizer, [{"input_ids": row, "labels": row} for row in ids] * STEPS)


def _measure_lora(case: peft_steps.PeftCase, optimizer: str) -> int:
    model = hf_peft_steps.build(case)
    torch.manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.batch * STEPS, case.seq))
    return _train(model, case, optimizer, [{"input_ids": row, "labels": row} for row in ids])


def _predict(model, plan: Plan, case) -> int:
    workload = TrainingWorkload(seq_len=case.seq, micro_batch=case.batch)
    assert hf_supported(model, plan, workload, device="cpu") is None, case.name
    return hf_predict(case, plan).peak()[0]


def _predict_full(case: hf_steps.Case, optimizer: str) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = Plan(precision=case.precision, recompute="full" if case.checkpointing else "none", optimizer=optimizer)
    return _predict(model, plan, case)


def _predict_lora(case: peft_steps.PeftCase, optimizer: str) -> int:
    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    plan = peft_steps.plan_of(case).model_copy(update={"optimizer": optimizer})
    return _predict(model, plan, case)  # a 4-bit base loaded in the case's dtype (hf_predict.case_quant)


# the default suite's cases (a Trainer run each, ~3-15 s on 2 busy cores): each kind of step decides the peak
# (SGD's none, Adafactor's bf16 casts and factors, bitsandbytes' 8-bit AdamW with the embedding's 32-bit
# override, its 32-bit Lion, LoRA with a trained head); the rest run under ``-m slow``
DEFAULT = {
    "hfopt-full-sgd-params-fp32",
    "hfopt-full-adafactor-params-bf16",
    "hfopt-full-paged-adamw-8bit-params-fp32",
    "hfopt-full-paged-lion-32bit-params-fp32",
    "hfopt-lora-adafactor-params-save-head",
}


def _params(cases: list) -> list:
    return [pytest.param(*c, marks=() if c[0].name in DEFAULT else pytest.mark.slow, id=c[0].name) for c in cases]


@pytest.mark.parametrize(("case", "optimizer"), _params(FULL_CASES))
def test_full_fine_tuning_peak_equals_the_trainers(case: hf_steps.Case, optimizer: str) -> None:
    measured, predicted = _measure_full(case, optimizer), _predict_full(case, optimizer)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


@pytest.mark.parametrize(("case", "optimizer"), _params(LORA_CASES))
def test_lora_peak_equals_the_trainers(case: peft_steps.PeftCase, optimizer: str) -> None:
    measured, predicted = _measure_lora(case, optimizer), _predict_lora(case, optimizer)
    assert predicted == measured, f"{case.name}: {predicted:,} B predicted, {measured:,} B measured"


def test_every_optimizer_is_measured_where_its_step_decides_the_peak() -> None:
    """Each optimizer has a full fine-tuning case in fp32 and in bf16 at the parameter-dominated shape, and
    the default cases name real ones."""
    names = {c.name for c, _ in FULL_CASES + LORA_CASES}
    assert DEFAULT <= names
    for dtype in ("fp32", "bf16"):
        assert {o for c, o in FULL_CASES if c.name.endswith(f"params-{dtype}")} == set(OPTIM)


def test_the_harness_sees_bitsandbytes_cpu_temporaries() -> None:
    """Under :func:`_kernels_seen` the tracker counts the CPU kernels' temporaries inside one ``step()`` of
    a 1 Mi-element fp32 parameter as ``torch.profiler``'s memory events do (12 MiB for 32-bit AdamW: the
    scaled gradient, the square root and the denominator; 20 MiB for 8-bit: the two dequantized states
    too), and without it none."""
    import bitsandbytes as bnb
    from torch.profiler import ProfilerActivity, profile

    for bits, temporaries in ((32, 12 << 20), (8, 20 << 20)):
        p = torch.nn.Parameter(torch.zeros(1024, 1024))
        p.grad = torch.ones_like(p)
        opt = bnb.optim.AdamW([p], optim_bits=bits)
        opt.step()  # the states
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt.step()
        live = peak = 0
        for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if event.name() == "[memory]":
                live += event.nbytes()
                peak = max(peak, live)
        seen, held = [], [p, p.grad, *(v for v in opt.state[p].values() if torch.is_tensor(v))]
        for patched in (False, True):
            tracker = StorageTracker()
            tracker.track(*held)
            with contextlib.ExitStack() as stack:
                if patched:
                    stack.enter_context(_kernels_seen())
                with tracker:
                    opt.step()
            seen.append(tracker.peak - sum(t.untyped_storage().nbytes() for t in held))
        assert seen == [0, temporaries] and temporaries <= peak < temporaries + 1024, (bits, seen, peak)


# --- CUDA, from bitsandbytes' source (no GPU here): where each state goes ---------------------------------
EMBED = Param("model.embed_tokens.weight", 32000 * 4096, 2, 32000, 4096, embedding=True)
MATRIX = Param("q_proj.weight", 4096 * 4096, 2, 4096, 4096)
ADAPTER = Param("q_proj.lora_A.weight", 16 * 4096, 4, 16, 4096)  # 65,536 elements: under 1e5, not paged
NORM = Param("norm.weight", 4096, 2, 4096)  # not under min_8bit_size (4,096): 8-bit states
BIAS = Param("k_proj.bias", 1024, 2, 1024)  # under it: fp32 states
PARAMS_CUDA = [EMBED, MATRIX, ADAPTER, NORM, BIAS]


def _states_on(optimizer: str, cuda: bool = True) -> tuple[Builder, BnbOptimizer]:
    """The optimizer built and stepped three times over :data:`PARAMS_CUDA` on a tape of its own."""
    b = Builder()
    tape, opt = Tape(b), trainer_optimizer(optimizer, cuda=cuda)
    opt.create(tape)
    for k in range(3):
        opt.step(tape, PARAMS_CUDA, {}, first=k == 0)
        b.mark(f"step{k}")
    return b, opt


def _allocated(b: Builder) -> dict[str, int]:
    return {e.tag: e.size for e in b.build().events if e.op == ALLOC}


def _blocks(p: Param) -> int:
    return -(-p.numel // 256)


def test_paged_adamw_8bit_puts_large_buffers_in_managed_memory_on_cuda() -> None:
    """``paged_adamw_8bit`` on CUDA: the embedding's 32-bit states (the Trainer's override) and the matrix's
    uint8 states in managed memory (1e5 elements or more); the absmaxes, the maps and the small
    parameters' states in the allocator; the step's kernel allocates nothing."""
    b, opt = _states_on("paged-adamw-8bit")
    assert opt.managed == 2 * EMBED.numel * 4 + 2 * MATRIX.numel
    allocated = _allocated(b)
    expected = {"bnb.qmap.dynamic": 1024, "bnb.qmap.udynamic": 1024}
    for p in (MATRIX, ADAPTER, NORM):
        expected |= {f"{p.name}.absmax{k}": 4 * _blocks(p) for k in (1, 2)}
    for p, itemsize in ((ADAPTER, 1), (NORM, 1), (BIAS, 4)):
        expected |= {f"{p.name}.state{k}": p.numel * itemsize for k in (1, 2)}
    assert allocated == expected
    assert all(e.category == Category.OPTIMIZER_STATES for e in b.build().events if e.op == ALLOC)


def test_without_paging_every_state_is_in_the_allocator() -> None:
    """``adamw_bnb_8bit``: the same states, all in the caching allocator."""
    b, opt = _states_on("adamw-8bit")
    paged_b, paged = _states_on("paged-adamw-8bit")
    assert opt.managed == 0
    assert sum(_allocated(b).values()) == sum(_allocated(paged_b).values()) + paged.managed


def test_paged_lion_32bit_keeps_one_fp32_state_and_no_maps() -> None:
    b, opt = _states_on("paged-lion-32bit")
    assert opt.managed == 4 * (EMBED.numel + MATRIX.numel)
    assert _allocated(b) == {f"{p.name}.state1": 4 * p.numel for p in (ADAPTER, NORM, BIAS)}


def test_on_cpu_nothing_is_paged() -> None:
    """bitsandbytes falls back to ``zeros_like`` on CPU: the paged optimizer's states are all the run's."""
    b, opt = _states_on("paged-adamw-32bit", cuda=False)
    assert opt.managed == 0
    states = {t: s for t, s in _allocated(b).items() if ".state" in t}
    assert sum(states.values()) == 2 * 4 * sum(p.numel for p in PARAMS_CUDA)


def test_the_estimate_reports_the_runs_paged_states_apart(capsys) -> None:
    """``memplan estimate --runtime hf --optimizer paged-adamw-8bit``: the op-level run answers, its
    managed bytes are ``paged_optimizer_states`` (in neither peak), the rest of its states in
    ``model_states``; on CPU nothing is paged."""
    from memplan.specs.loader import load_model

    args = ["llama3-8b", "--runtime", "hf", "--precision", "bf16", "--seq-len", "1024", "--finetune", "full"]
    memory = _estimate(capsys, [*args, "--optimizer", "paged-adamw-8bit"])
    assert memory["model"] == "op-level" and memory["model_reason"] is None
    plan = Plan(precision="bf16", finetune="full", optimizer="paged-adamw-8bit")
    run = hf_plan_run(load_model("llama3-8b"), TrainingWorkload(seq_len=1024, micro_batch=1), plan)
    assert memory["paged_optimizer_states"] == run.managed > 0
    plain = _estimate(capsys, [*args, "--optimizer", "adamw-8bit"])
    paged_states = memory["model_states"]["optimizer_states"] + run.managed
    assert plain["model_states"]["optimizer_states"] == paged_states
    on_cpu = _estimate(capsys, [*args, "--optimizer", "paged-adamw-8bit", "--device", "cpu"])
    assert on_cpu["paged_optimizer_states"] == 0


def test_what_the_run_does_not_follow_stays_on_the_phase_model(capsys) -> None:
    args = ["--runtime", "hf-loop", "--optimizer", "sgd"]
    memory = _estimate(capsys, ["llama3-8b", "--precision", "bf16", "--seq-len", "1024", *args])
    assert memory["model"] == "phase" and "under the hf-loop runtime" in memory["model_reason"]


def test_lora_over_an_moe_model_with_another_optimizer_is_followed() -> None:
    """Full fine-tuning of an MoE model with another optimizer is followed (test_timeline_hf_optimizers_dist.py),
    and PEFT over one with it (test_timeline_hf_optimizers_peft_moe.py)."""
    from memplan.specs.loader import load_model

    workload = TrainingWorkload(seq_len=512, micro_batch=1)
    assert hf_supported(load_model("mixtral-8x7b"), Plan(precision="bf16", optimizer="sgd"), workload) is None
    plan = Plan(precision="bf16", optimizer="sgd", finetune="lora", lora_targets=("q_proj", "v_proj"))
    assert hf_supported(load_model("mixtral-8x7b"), plan, workload) is None
