"""CUDA's LLM.int8 base in the op-level runs against the H200 runs of tests/data/gpu-runs/h200-2026-11-28.json
and the H100 rerun of the first with its allocator trace (h100-2026-11-28.json, gpu-traces/h100_int8_1b.pkl.gz).

Two runs over an 8-bit base (bitsandbytes 0.50.2, ``Linear8bitLt(has_fp16_weights=False,
threshold=6.0)``): the bundled trainer (``validate`` entry ``v-1b-qlora-int8``: Llama 1B, LoRA r16
all-linear, bf16, full recompute, 4 x 4,096 tokens) and transformers' Trainer over PEFT (``callback``
entry ``llama1b-lora-int8``: a random Llama 1B saved and loaded with ``load_in_8bit=True``, bf16=True,
gradient checkpointing, 2 x 2,048 tokens). Before ``int8_outliers`` both were predicted 7.1% and 2.3%
under their measured ``max_memory_allocated``: CUDA's ``MatMul8bitLt`` keeps ``subA``, the input
columns holding an |x| >= 6.0, in ``ctx.tensors`` until the graph goes, and over random weights the
down projection's ``silu(g) * u`` has thousands of them (``int8_outliers``' docstring). The CPU path
(``MatMul8bitFp``), which the run was checked against, keeps none.

The trace shows the tensor call by call (a down projection's events equal the run's) and, put into the
run, its own columns give the H100 step's peak to 33 KB, reserved exact. With the columns counted on the
real layers on CPU (benchmarks/int8_outlier_columns.py, the same random initialisation and token count;
:data:`COUNTED`) the run meets both within the issue's bound (-0.08% / 0.00% and +0.21% / 0.00%,
allocated / reserved): ``subA`` is the tensor. The estimate's own count, ``RandomInit`` (tokens
independent), is an upper estimate over random weights: the bundled trainer's step +1.06% allocated,
+2.99% reserved; the Trainer loads a checkpoint, which the estimate takes as trained (no outlier
columns): -2.34% allocated, -2.64% reserved, as before; that checkpoint was random, and since 2026-11-29 the
model says so (``random_init``, read off the live model by MemplanCallback or a folder's safetensors): +0.60% /
0.00%. Both are kept as strict xfails with those figures.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from benchmark_script import load

from memplan import api
from memplan.costmodel.allocator import AllocatorConfig
from memplan.costmodel.reserve import replay
from memplan.costmodel.timeline import hf_bnb
from memplan.costmodel.timeline.int8_outliers import RandomInit, expected_columns, is_down_projection, silu_product_tail
from memplan.costmodel.timeline.trainer import supported, trainer_run
from memplan.specs.resolve import resolve_job

DATA = Path(__file__).parents[1] / "data"
RUNS = json.loads((DATA / "gpu-runs" / "h200-2026-11-28.json").read_text())
LLAMA_1B = str(DATA / "gpu-traces" / "llama1b.config.json")
ALLOCATED, RESERVED = 0.005, 0.01  # issue 27's bound on each run

# The down projections' outlier columns, layer by layer, counted by benchmarks/int8_outlier_columns.py
# on CPU (torch 2.13.0+cpu, 2026-11-28; seed 0) over 4 x 4,096 and 2 x 2,048 random tokens, on the bundled
# trainer's Llama (transformers' has the same layers and initialisation). The other linears counted none,
# but for one column in layer 13's q, k, v and gate / up inputs at 16k tokens (64 KiB each: left out).
COUNTED = {
    16384: (3076, 3844, 3925, 3950, 3976, 4004, 3981, 3969, 3928, 3969, 3990, 4004, 4052, 3860, 3992, 3961),
    4096: (919, 1324, 1295, 1295, 1283, 1351, 1324, 1305, 1390, 1313, 1354, 1377, 1351, 1356, 1290, 1295),
}


@dataclass(frozen=True)
class Counted:
    """The down projections' counted columns by layer index, none elsewhere (as ``RandomInit.columns``)."""

    by_layer: tuple[int, ...]

    def columns(self, name: str, tokens: int, cols: int) -> int:
        if not is_down_projection(name):
            return 0
        return self.by_layer[int(re.search(r"layers\.(\d+)\.", name).group(1))]


def _bundled_plan() -> dict:
    """``v-1b-qlora-int8``'s validate arguments as plan and workload fields."""
    args = RUNS["validate"]["v-1b-qlora-int8"]["args"][1:]
    fields = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        key = flag.removeprefix("--").replace("-", "_")
        fields[key] = int(value) if value.isdigit() else value
    fields["lora_targets"] = [fields["lora_targets"]]
    return fields


def _bundled(outliers=None) -> tuple[int, int]:
    """The bundled trainer's op-level run on CUDA, replayed: (max allocated, max reserved)."""
    fields = _bundled_plan()
    job = resolve_job(LLAMA_1B, None, dict(fields, global_batch=fields["micro_batch"]), inference=False)
    assert supported(job.model, job.workload, job.plan) is None
    if outliers is None:
        timeline = trainer_run(job.model, job.workload, job.plan)
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RandomInit, "columns", lambda self, name, tokens, cols: outliers.columns(name, tokens, cols))
            timeline = trainer_run(job.model, job.workload, job.plan)
    result = replay(timeline, AllocatorConfig(expandable_segments=False))  # the run's default allocator
    return result.max_allocated, result.max_reserved


def _trainer_plan() -> tuple[dict, dict]:
    """The callback's resolved plan, as a plan and a workload ``api.estimate`` takes."""
    plan = dict(RUNS["callback"]["llama1b-lora-int8"]["plan"])
    workload = {k: plan.pop(k) for k in ("seq_len", "micro_batch", "global_batch")}
    for derived in ("runtime", "world_size", "gpus_per_node", "nodes", "attention_kernel", "kind"):
        plan.pop(derived)
    plan.pop("gradient_accumulation")
    plan.pop("autocast")  # bf16-mixed: autocast by definition
    return plan, workload


def _trainer(outliers=None, random_init: float | None = None) -> tuple[int, int]:
    """``api.estimate`` of the Trainer's run on the h200 profile: (allocated, reserved); ``random_init``:
    the checkpoint random, normal(0, that std), as MemplanCallback reads a live model's since 2026-11-29."""
    plan, workload = _trainer_plan()
    model = api.model_spec(LLAMA_1B)[0].model_copy(update={"random_init": random_init})
    with pytest.MonkeyPatch.context() as mp:
        if outliers is not None:
            mp.setattr(hf_bnb.Bnb8bit, "of", classmethod(lambda cls, p, m=None: cls(outliers=outliers)))
        result = api.estimate(model, plan=plan, workload=workload, gpu="h200", runtime="hf", device="cuda")
    assert result.memory.model == "op-level"
    return result.memory.peak.allocated, result.memory.peak.reserved


def _assert_within(name: str, predicted: tuple[int, int], measured: tuple[int, int]) -> None:
    (pa, pr), (ma, mr) = predicted, measured
    assert abs(pa / ma - 1) <= ALLOCATED, f"{name}: allocated {pa:,} predicted, {ma:,} measured ({pa / ma - 1:+.2%})"
    assert abs(pr / mr - 1) <= RESERVED, f"{name}: reserved {pr:,} predicted, {mr:,} measured ({pr / mr - 1:+.2%})"


def _measured(entry: dict) -> tuple[int, int]:
    return entry["measured_allocated"], entry["measured_reserved"]


BUNDLED = _measured(RUNS["validate"]["v-1b-qlora-int8"])
TRAINER = _measured(RUNS["callback"]["llama1b-lora-int8"])


# the H100 rerun of v-1b-qlora-int8 with its allocator trace (tests/data/gpu-runs/h100-2026-11-28.json)
H100 = json.loads((DATA / "gpu-runs" / "h100-2026-11-28.json").read_text())["validate"]["v-1b-qlora-int8-snap"]
TRACE = DATA / "gpu-traces" / "h100_int8_1b.pkl.gz"
TOKENS, FFN = 16384, 8192


@functools.cache
def _down_projection_calls() -> list[list[tuple[str, int]]]:
    """The trace's down projection calls, each its (action, bytes) events from ``A.to(float16)``
    (tokens x 8,192 fp16, then ``row_stats``) to ``row_stats``' free: forward and re-run, step by step."""
    import gzip
    import pickle

    events = [
        e for e in pickle.load(gzip.open(TRACE))["device_traces"][0] if e["action"] in ("alloc", "free_requested")
    ]
    calls = []
    for i, e in enumerate(events):
        if e["action"] == "alloc" and e["size"] == TOKENS * FFN * 2 and events[i + 1]["size"] == TOKENS * 4:
            row_stats = events[i + 1]["addr"]
            end = next(j for j in range(i + 2, len(events)) if events[j]["addr"] == row_stats)
            calls.append([(e["action"], e["size"]) for e in events[i : end + 1]])
    return calls


def _columns(call: list[tuple[str, int]]) -> int:
    """k of one call: its ``subA`` (tokens x k fp32), the first allocation once ``abs`` and then the
    fp16 input (both tokens x 8,192 x 2 B) are freed."""
    freed = [i for i, event in enumerate(call) if event == ("free_requested", TOKENS * FFN * 2)][1]
    return next(size for action, size in call[freed:] if action == "alloc") // (TOKENS * 4)


def test_a_down_projection_allocates_what_the_trace_shows():
    """One steady down projection (the third step's sixth layer, fp32 input, k outlier columns): the
    run's allocations and frees against the trace's, byte for byte, leaving out what the run does not
    model: the sub-4-KiB scratch (``any()``'s reduction, the index's ``= 0``) and, between
    ``any(dim=0)`` and ``argwhere``'s output, the column reduction's split buffer (34,603,008 B here)
    and ``nonzero``'s count and CUB storage; and the previous call's ``state.idx`` freed before
    ``subA`` (the run frees its own, of this call's k)."""
    from memplan.costmodel.timeline.events import ALLOC

    call = _down_projection_calls()[2 * 32 + 5]
    k = _columns(call)
    measured = [(a, n) for a, n in call if n >= 4096]
    start, end = measured.index(("alloc", FFN)), measured.index(("alloc", k * 8))
    del measured[start + 1 : end]  # the reduction's buffer, nonzero's scratch
    sub_a = measured.index(("alloc", TOKENS * k * 4))
    assert measured[sub_a - 1][0] == "free_requested" and measured[sub_a - 1][1] % 8 == 0
    del measured[sub_a - 1]  # the previous call's state.idx
    fields = _bundled_plan()
    job = resolve_job(LLAMA_1B, None, dict(fields, global_batch=fields["micro_batch"]), inference=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RandomInit, "columns", lambda self, name, tokens, cols: k if is_down_projection(name) else 0)
        events = list(trainer_run(job.model, job.workload, job.plan))
    first = [i for i, e in enumerate(events) if e.op == ALLOC and e.tag.endswith("w2.input_fp16")][2 * 32 + 5]
    row_stats = events[first + 1].tensor
    last = next(j for j in range(first + 2, len(events)) if events[j].tensor == row_stats)
    predicted = [
        ("alloc" if e.op == ALLOC else "free_requested", e.size)
        for e in events[first : last + 1]
        if e.size >= 4096 and not (e.op != ALLOC and e.tag.endswith("outlier_cols"))
    ]
    assert k == 4027 and predicted == measured


def test_with_the_traces_columns_the_run_is_the_h100_run():
    """The columns each down projection kept on the H100 (its ``subA`` sizes; the last step's, 2,994 to
    4,135 a layer) put into the run: 33,280 B under the measured peak, reserved exact (with the
    second step's, -0.003%)."""
    calls = _down_projection_calls()
    assert len(calls) == 3 * 2 * 16  # warm-up and two measured steps, each a forward and a re-run
    last = tuple(_columns(c) for c in calls[2 * 32 : 2 * 32 + 16])
    _assert_within("v-1b-qlora-int8-snap", _bundled(Counted(last)), _measured(H100))


def test_the_plans_are_the_ones_the_runs_predicted_then():
    """Without outlier columns the runs give the figures the GPU check predicted (``predicted_then``):
    the plans here are the measured runs' plans."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RandomInit, "columns", lambda self, name, tokens, cols: 0)
        bundled = _bundled()
    then = RUNS["validate"]["v-1b-qlora-int8"]["predicted_then"]
    assert bundled == (then["allocated"], then["reserved"])
    then = RUNS["callback"]["llama1b-lora-int8"]["predicted_then"]
    assert _trainer() == (then["allocated"], then["reserved"])


def test_the_bundled_trainer_with_the_counted_columns_meets_the_h200_run():
    _assert_within("v-1b-qlora-int8", _bundled(Counted(COUNTED[16384])), BUNDLED)


def test_the_trainer_with_the_counted_columns_meets_the_h200_run():
    _assert_within("llama1b-lora-int8", _trainer(Counted(COUNTED[4096])), TRAINER)


@pytest.mark.xfail(
    strict=True,
    reason="+1.06% allocated, +2.99% reserved: RandomInit counts 4,543 outlier columns per down projection "
    "(tokens independent) where the real layers hold 3,076 to 4,052; the tokens' shared component is not modelled",
)
def test_the_bundled_trainers_int8_step_on_the_h200():
    _assert_within("v-1b-qlora-int8", _bundled(), BUNDLED)


@pytest.mark.xfail(
    strict=True,
    reason="+0.60% allocated, 0.00% reserved: the check loaded a random checkpoint (norms at one: random_init "
    "0.02, read off the live model by MemplanCallback); RandomInit counts 1,500 outlier columns per down "
    "projection (tokens independent) where the real layers held 919 to 1,390 (COUNTED[4096])",
)
def test_the_trainers_int8_step_on_the_h200():
    _assert_within("llama1b-lora-int8", _trainer(random_init=0.02), TRAINER)


def test_a_random_checkpoint_meets_the_trainers_run_within_issue_28s_bound():
    """Issue 28's bound for Trainer runs kept outside the project (allocated 2%, reserved 5%): the random
    checkpoint read as random is within it, read as trained it is not."""
    (ma, mr), (ta, _), (ra, rr) = TRAINER, _trainer(), _trainer(random_init=0.02)
    assert abs(ta / ma - 1) > 0.02  # -2.34%: no outlier columns
    assert abs(ra / ma - 1) <= 0.02 and abs(rr / mr - 1) <= 0.05


@pytest.fixture(scope="module")
def bench():
    """benchmarks/int8_outlier_columns.py, as a module."""
    return load("int8_outlier_columns")


def test_random_init_counts_the_real_layers_outliers_from_above(bench):
    """Two random layers of the 1B shape (a 1,000-token vocabulary) over 512 tokens on CPU: only
    the down projections see an |x| >= 6.0, at the element rate ``silu_product_tail`` gives (here
    5.0e-5 and 4.3e-5 against 4.9e-5), in fewer columns than independent tokens would fill (124 and
    148 against 204: the tokens' shared component)."""
    pytest.importorskip("torch")
    counted = bench.count(LLAMA_1B, 512, 1, layers=2, vocab_size=1000)
    predicted = counted["predicted_w2"]
    assert predicted == RandomInit(2048).columns("layers.0.feed_forward.w2.weight", 512, 8192) == 204
    rates = [layer["w2"][1] for layer in counted["layers"].values()]
    assert sum(rates) / len(rates) == pytest.approx(silu_product_tail(0.02 * math.sqrt(2048)), rel=0.1)
    for layer in counted["layers"].values():
        assert predicted / 2 <= layer["w2"][0] <= predicted
        assert all(columns == 0 for name, (columns, _) in layer.items() if name != "w2")


def test_only_the_down_projection_counts_and_wider_inputs_count_more():
    model = RandomInit(2048)
    names = ("layers.3.feed_forward.w1.weight", "model.layers.3.self_attn.q_proj", "layers.3.attention.wo.weight")
    assert [model.columns(n, 16384, 8192) for n in names] == [0, 0, 0]
    assert model.columns("model.layers.3.mlp.down_proj", 16384, 8192) == 4543
    assert model.columns("model.layers.3.mlp.down_proj", 4096, 8192) == 1500
    assert RandomInit(128).columns("layers.0.feed_forward.w2.weight", 16384, 344) == 0  # sigma 0.23: none
    assert expected_columns(10, 1, 0.5) == 5 and expected_columns(10, 10**9, 1e-3) == 10
