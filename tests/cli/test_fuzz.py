"""CLI fuzz test (issue 20): flags, plan files and budgets files from hypothesis, run in-process.

Whatever the input, a run ends one of three ways: exit 0; exit 1, a legitimate "does not fit" or
failed check (never an internal error); or exit 2, nothing on stdout and exactly one stderr line,
``memplan: error: ...``. Never a traceback. The default profile keeps the file to a few seconds
per test and is derandomized so CI sees the same inputs every run; ``-m slow`` runs a bigger one.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.cli.app import run

PREFIX = "memplan: error: "
ROOT = Path(__file__).parents[2]
MODELS = sorted(p.stem for p in (ROOT / "profiles" / "models").glob("*.yaml"))
GPUS = sorted(p.stem for p in (ROOT / "profiles" / "gpus").glob("*.yaml"))
SMALL_MODELS = ["llama3-8b", "qwen2.5-7b", "mistral-7b", "phi3-mini", "mixtral-8x7b", "gemma2-9b"]
# the big MoE profiles take 0.5-2.5 s an estimate: only the slow profile draws them
QUICK_MODELS = [m for m in MODELS if m not in ("deepseek-v3", "qwen3-30b-a3b", "llama4-scout", "deepseek-v2-lite")]

FUZZ = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.function_scoped_fixture]}
SLOW = settings(max_examples=600, **FUZZ)


# ---------------------------------------------------------------------------------------------
# values


def mix(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """One of ``strategies``, a strategy given n times drawn n times as often (``st.one_of`` drops repeats)."""
    return st.sampled_from(strategies).flatmap(lambda strategy: strategy)


def _argv_text(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    """Text a shell can pass: no surrogates, no NUL (argv cannot hold one)."""
    return st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=min_size, max_size=max_size
    )


BAD_NUMBERS = ["", " ", "nan", "NaN", "inf", "-inf", "1e3", "1.5", "0x10", "abc", "１２", "٣", "2 ", "--", "-", "1_0"]
INTS = mix(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([0, -1, 3, 7, 64, 2**31, 2**63, 10**30]),
    st.integers(-(10**6), 10**6),
).map(str)
INT_VALUES = mix(INTS, INTS, INTS, INTS, st.sampled_from(BAD_NUMBERS), _argv_text())
FLOAT_VALUES = mix(
    st.sampled_from(["0", "0.1", "0.5", "0.99", "1", "-0.1", "nan", "inf", "-inf", "1e308", "1e-320", "", "x"]),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    _argv_text(),
)

INT_FLAGS = [
    "--dp", "--tp", "--pp", "--virtual-stages", "--cp", "--ep", "--zero", "--recompute-layers", "--lora-rank",
    "--micro-batch", "--global-batch", "--seq-len", "--batch", "--context", "--block-size", "--gpus", "--nodes",
    "--prefill-chunk",
]  # fmt: skip
CHOICE_FLAGS = {
    "--pp-schedule": ["1f1b", "interleaved", "gpipe"],
    "--recompute": ["none", "selective", "selective-op", "full"],
    "--precision": ["fp32", "bf16-mixed", "bf16-master", "fp16-master", "bf16", "fp8"],
    "--optimizer": [
        "adamw",
        "sgd",
        "adafactor",
        "adamw-8bit",
        "paged-adamw-8bit",
        "paged-adamw-32bit",
        "paged-lion-8bit",
    ],
    "--fp8-recipe": ["auto", "tensorwise", "rowwise", "delayed", "nope"],
    "--host-memory": ["512GiB", "1GiB", "0", "-1GiB", "1e30GiB", "lots", ""],
    "--offload-optimizer": ["none", "cpu", "nvme"],
    "--offload-params": ["none", "cpu", "nvme"],
    "--attention": ["flash", "eager", "triton"],
    "--runtime": ["memplan", "hf", "hf-loop", "megatron"],
    "--offload-activations": ["none", "cpu"],
    "--finetune": ["full", "lora", "qlora"],
    "--quant": ["none", "int8", "nf4", "fp4"],
    "--kv-dtype": ["fp32", "bf16", "fp16", "fp8", "int8"],
    "--allocator": ["default", "expandable"],
    "--device": ["cuda", "cpu"],
    "--format": ["table", "json"],
    "--gpu": [*GPUS, "afile", "adir", "plan.yaml", "nope"],
    "--lora-targets": ["q_proj,v_proj", "all-linear", "q_proj", "all-linear,q_proj", "q_proj,q_proj", "nope", ","],
    "--modules-to-save": ["lm_head", "embed_tokens", "nope", ""],
    # output paths: only the cheap refusals (a drawn timeline would cost seconds)
    "--timeline": ["t.jpg", "adir", "adir/", "nope/t.html", "", "afile/t.html"],
}
SWITCHES = ["--sequence-parallel", "--no-sequence-parallel", "--inference", "--double-quant", "--no-double-quant",
            "--no-calibration", "--calibration", "--fp8-all-gather", "--no-fp8-all-gather", "--lora-dora",
            "--help"]  # fmt: skip


def _choice(flag: str) -> st.SearchStrategy[str]:
    valid = st.sampled_from(CHOICE_FLAGS[flag])
    return mix(valid, valid, valid, _argv_text())


def _flag() -> st.SearchStrategy[list[str]]:
    int_flag = st.tuples(st.sampled_from(INT_FLAGS), INT_VALUES).map(list)
    choice_flag = st.sampled_from(sorted(CHOICE_FLAGS)).flatmap(lambda f: _choice(f).map(lambda v: [f, v]))
    float_flag = FLOAT_VALUES.map(lambda v: ["--lora-dropout", v])
    switch = st.sampled_from(SWITCHES).map(lambda s: [s])
    garbage = mix(st.just(["--no-such-flag"]), st.just(["--tp"]), _argv_text(max_size=6).map(lambda t: [t]))
    joined = int_flag.map(lambda f: [f"{f[0]}={f[1]}"])  # click reads --tp=2 as --tp 2
    return mix(int_flag, int_flag, choice_flag, choice_flag, choice_flag, float_flag, switch, switch, garbage, joined)


def _estimate_argv(models: list[str]) -> st.SearchStrategy[list[str]]:
    paths = st.sampled_from(["afile", "adir", "plan.yaml", "nope.yaml", "config.json", "/dev/null", ""])
    model = mix(
        st.sampled_from(SMALL_MODELS),
        st.sampled_from(SMALL_MODELS),
        st.sampled_from(models),
        paths,
        _argv_text(max_size=20),
    )
    return st.tuples(model, st.lists(_flag(), max_size=5)).map(
        lambda t: ["estimate", t[0], *(a for f in t[1] for a in f)]
    )


ESTIMATE_ARGV = _estimate_argv(QUICK_MODELS)


# ---------------------------------------------------------------------------------------------
# files

PLAN_FIELDS = {
    "dp": [1, 2, 8], "tp": [1, 2, 4, 8], "sequence_parallel": [True, False], "pp": [1, 2, 4],
    "pp_schedule": ["1f1b", "interleaved", "gpipe"], "virtual_stages": [1, 2], "cp": [1, 2], "ep": [1, 2, 8],
    "zero": [0, 1, 2, 3], "offload_optimizer": ["none", "cpu", "nvme"], "offload_params": ["none", "cpu"],
    "recompute": ["none", "selective", "full"], "recompute_layers": [1, 4], "precision": ["bf16-mixed", "fp8"],
    "optimizer": ["adamw", "sgd", "adamw-8bit"], "attention": ["flash", "eager"], "finetune": ["full", "lora", "qlora"],
    "lora_rank": [8, 16], "lora_targets": [["q_proj", "v_proj"], ["all-linear"]], "lora_dropout": [0.0, 0.1],
    "modules_to_save": [["lm_head"]], "quant": ["none", "nf4"], "double_quant": [True, False],
    "offload_activations": ["none", "cpu"],
}  # fmt: skip
WORKLOAD_FIELDS = {
    "kind": ["training", "inference"], "seq_len": [512, 2048, 4096], "micro_batch": [1, 2], "global_batch": [8, 64],
    "batch": [1, 8], "prompt_tokens": [128, 2048], "generated_tokens": [0, 256], "kv_dtype": ["bf16", "fp8"],
    "block_size": [16],
}  # fmt: skip
TOP_FIELDS = {
    "model": ["llama3-8b", "llama3-8b", "qwen2.5-7b"], "gpu": GPUS[:3], "gpus": [1, 2, 8], "nodes": [1, 2],
    "runtime": ["memplan", "hf", "megatron"], "allocator": ["default", "expandable"],
}  # fmt: skip

WRONG = mix(
    st.sampled_from([None, True, False, 0, -1, 2.5, 1e300, float("nan"), float("inf"), 10**30, "", "2", "∞", [], {}]),
    st.lists(st.integers(0, 4), max_size=2),
    st.dictionaries(st.sampled_from(["a", "tp"]), st.integers(0, 2), max_size=1),
    st.text(max_size=8),
    st.integers(),
)


def _section(fields: dict[str, list]) -> st.SearchStrategy[dict]:
    """A mapping of mostly known keys with mostly valid values; now and then an unknown key or a wrong value."""
    known = st.sampled_from(sorted(fields))
    key = mix(known, known, known, known, known, st.text(min_size=1, max_size=8))

    def value_for(k: str) -> st.SearchStrategy[object]:
        if k not in fields:
            return WRONG
        valid = st.sampled_from(fields[k])
        return mix(valid, valid, valid, WRONG)

    pair = key.flatmap(lambda k: value_for(k).map(lambda v: (k, v)))
    return st.lists(pair, max_size=4).map(dict)


def _plan_mapping() -> st.SearchStrategy[dict]:
    top = _section(TOP_FIELDS)
    nested = st.fixed_dictionaries(
        {},
        optional={
            "plan": mix(_section(PLAN_FIELDS), _section(PLAN_FIELDS), WRONG),
            "workload": mix(_section(WORKLOAD_FIELDS), _section(WORKLOAD_FIELDS), WRONG),
        },
    )
    return st.tuples(top, nested).map(lambda t: {**t[0], **t[1]})


def _dump(data: object) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


# raw YAML texts a serializer never writes: duplicates, tags, aliases, wrong nesting, odd scalars
RAW_PLAN_TEXTS = [
    "", "\n", "---\n", "~\n", "null\n", "[]\n", "42\n", "'plan'\n", "plan\n", "---\n---\n", "plan: {}\n---\nplan: {}\n",
    "plan: {tp: 2}\nplan: {tp: 4}\n", "plan:\n  tp: 2\n  tp: 2\n", "gpus: 8\ngpus: 8\n",
    "plan: !!python/object/apply:os.system ['true']\n", "plan: !!binary aGVsbG8=\n", "plan: !custom {tp: 2}\n",
    "plan: !!set {tp, pp}\n", "plan: !!omap [{tp: 2}]\n", "gpus: !!float 8\n", "gpus: !!str 8\n",
    "plan: &a {tp: 2}\nworkload: *a\n", "plan: {<<: {tp: 2}, pp: 2}\n", "a: &a [*a]\n",
    "plan: {tp: 0o10}\n", "plan: {tp: 0x8}\n", "plan: {tp: 1_0}\n", "plan: {tp: .inf}\n", "plan: {tp: .nan}\n",
    "plan: {tp: 2e0}\n", "plan: {tp: 2019-01-01}\n", "plan: {zero: yes}\n", "plan: {sequence_parallel: on}\n",
    "plan: {lora_targets: q_proj}\n", "plan: {lora_targets: []}\n", "plan: {lora_targets: [1, 2]}\n",
    "plan: {modules_to_save: [[lm_head]]}\n", "plan: {lora_dropout: .nan}\n", "plan: {lora_dropout: 1}\n",
    "plan: {lora_dropout: '0.1'}\n", "plan: {plan: {tp: 2}}\n", "plan: [tp, 2]\n", "workload: {kind: serving}\n",
    "workload: {kind: [training]}\n", "workload: {kind: inference, seq_len: 4096}\n", "workload: {kind: null}\n",
    "? [a, b]\n: 1\n", "? {a: 1}\n: 1\n", "1: 2\n", "null: 2\n", "plan: {1: 2}\n", "plan: {null: 2}\n",
    "plan: {? [a]: 1}\n", "model: [llama3-8b]\n", "model: 1\n", "gpu: {name: x}\n", "gpu: ''\n", "gpu: nope\n",
    "gpu: /\n", "gpu: .\n", "plan: {tp: 2}\n\x00\n", "plan: {tp: 2", "\t- a\n", "%YAML 1.1\n---\nplan: {}\n",
    "%TAG ! tag:x,2000:\n---\nplan: !a {}\n", "\ufeffplan: {tp: 2}\n", "plan: {tp: 2}  # é ☃ 😀\n",
]  # fmt: skip

PLAN_TEXTS = mix(
    _plan_mapping().map(_dump),
    _plan_mapping().map(_dump),
    st.sampled_from(RAW_PLAN_TEXTS),
    st.lists(st.sampled_from(RAW_PLAN_TEXTS), min_size=2, max_size=3).map("".join),
    st.text(max_size=40),
)
PLAN_BYTES = mix(
    PLAN_TEXTS.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),
    st.sampled_from([b"\xff\xfe\x00p", bytes(range(128, 256)), b"plan: {tp: 2}\n\xff", "plan: é\n".encode("latin-1")]),
)

GOOD_BUDGETS = st.sampled_from(
    ["70GiB", "75GB", "80 GiB", "1KiB", 10**9, {"fits": True}, {"fits": True, "headroom": "10%"}]
    + [{"fits": True, "headroom": "4GiB"}, {"fits": True, "headroom": 0}, {"fits": True, "headroom": 0.1}]
)
BUDGET_VALUES = mix(
    GOOD_BUDGETS,
    GOOD_BUDGETS,
    GOOD_BUDGETS,
    GOOD_BUDGETS,
    st.sampled_from(["70G", "70", 70, 0, -1, "0GiB", "-1GiB", "1e30GiB", "nanGiB", "infGiB", "1e400GiB", "GiB"]),
    st.sampled_from([{"fits": False}, {"fits": "yes"}, {"headroom": "10%"}, {"fits": True, "headroom": "100%"}]),
    st.sampled_from([{"fits": True, "headroom": "-1%"}, {"fits": True, "headroom": "nan%"}, {"fits": True, "x": 1}]),
    st.sampled_from([{"fits": True, "headroom": "1e400GiB"}, {"fits": True, "headroom": 1e300}, True, None, []]),
    WRONG,
)
ENTRY_FIELDS = {
    "name": ["a", "b", "", "é"], "model": SMALL_MODELS[:3] + ["nope", "model.yaml", ""], "gpu": GPUS[:3] + ["nope"],
    "gpus": [1, 2, 8], "nodes": [1, 2], "runtime": ["memplan", "hf", "megatron"], "metric": ["reserved", "allocated"],
    "allocator": ["default", "expandable"],
}  # fmt: skip
THRESHOLDS = mix(
    *[st.sampled_from(["2%", "10%", "1GiB"])] * 4,
    st.sampled_from(["2%", "0%", "99%", "100%", "-2%", "two%", "nan%", "inf%", "1e400%", "%", "4GiB", "0", 0, 0.02]),
    WRONG,
)


def _entry() -> st.SearchStrategy[dict]:
    base = st.fixed_dictionaries(
        {
            "name": st.sampled_from(["a", "b"]),
            "model": st.sampled_from(SMALL_MODELS[:2]),
            "budget": BUDGET_VALUES,
            "gpus": st.sampled_from([8, 8, 8, 1]),
            "plan": mix(*[st.just({"zero": 3})] * 4, _section(PLAN_FIELDS), WRONG),
        },
        optional={
            "workload": mix(st.just({"seq_len": 2048}), _section(WORKLOAD_FIELDS), WRONG),
        },
    )
    more = mix(st.just({}), st.just({}), _section(ENTRY_FIELDS))
    return st.tuples(base, more).map(lambda t: {**t[0], **t[1]})


BUDGETS_MAPPINGS = st.fixed_dictionaries(
    {"entries": mix(*[st.lists(_entry(), min_size=1, max_size=2)] * 4, st.lists(_entry(), max_size=0), WRONG)},
    optional={"metric": mix(*[st.sampled_from(["reserved", "allocated"])] * 4, WRONG), "threshold": THRESHOLDS},
)
BUDGETS_MAPPINGS = mix(
    *[BUDGETS_MAPPINGS] * 4, BUDGETS_MAPPINGS.flatmap(lambda d: WRONG.map(lambda v: {**d, "extra": v}))
)
RAW_BUDGETS = [
    "", "entries:\n", "entries: []\n", "entries: {}\n", "entries: [1]\n", "entries: [null]\n", "entries: [[]]\n",
    "entries:\n- {name: a, model: llama3-8b, budget: 70GiB}\n- {name: a, model: llama3-8b, budget: 70GiB}\n",
    "entries:\n- {name: a, name: b, model: llama3-8b, budget: 70GiB}\n",
    "entries:\n- {name: a, model: llama3-8b, budget: !!binary aGVsbG8=}\n",
    "entries:\n- {name: a, model: llama3-8b, budget: 70GiB, plan: {tp: 3}}\n",
    "entries:\n- {name: a, model: llama3-8b, budget: 70GiB, workload: {kind: inference, batch: 0}}\n",
    "entries:\n- {name: a, model: ../../../../etc/passwd, budget: 70GiB}\n",
    "entries:\n- {name: a, model: /, budget: 70GiB}\n", "entries:\n- {name: a, model: ., budget: 70GiB}\n",
    "entries:\n- &e {name: a, model: llama3-8b, budget: 70GiB}\n- *e\n",
]  # fmt: skip
BUDGETS_BYTES = mix(
    *[BUDGETS_MAPPINGS.map(_dump).map(str.encode)] * 6,
    st.sampled_from(RAW_BUDGETS).map(str.encode),
    st.sampled_from(RAW_PLAN_TEXTS).map(str.encode),
    st.binary(max_size=32),
)


# ---------------------------------------------------------------------------------------------
# the property


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A tmp cwd with a directory and a file for the path flags to trip on; MEMPLAN_HOME there too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMPLAN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MEMPLAN_DEBUG", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    return tmp_path


def memplan(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(argv)
    return code, out.getvalue(), err.getvalue()


def check_outcome(argv: list[str], code: int, out: str, err: str) -> None:
    """Exit 0, 1 (a legitimate no / failed check) or 2 (one error line); never a traceback."""
    context = f"argv={argv!r}\nexit={code}\nstdout={out[-2000:]!r}\nstderr={err[-2000:]!r}"
    assert code in (0, 1, 2), context
    assert "Traceback" not in out and "Traceback" not in err, context
    assert "internal error" not in err, context
    if code == 2:
        assert out == "", context
        assert err.endswith("\n") and err.count("\n") == 1 and err.startswith(PREFIX), context
        assert err[len(PREFIX) :].strip(), context
    else:  # warnings and notes are fine; an error line is not
        assert PREFIX not in err, context
    if code == 1:  # a legitimate no: the report that says why is on stdout
        assert out.strip(), context


def fuzz_run(argv: list[str]) -> tuple[int, str, str]:
    code, out, err = memplan(argv)
    check_outcome(argv, code, out, err)
    return code, out, err


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# (a) estimate flags


@settings(max_examples=100, **FUZZ)
@given(argv=ESTIMATE_ARGV)
def test_estimate_flags(workdir, argv):
    fuzz_run(argv)


@pytest.mark.slow
@SLOW
@given(argv=_estimate_argv(MODELS))
def test_estimate_flags_slow(workdir, argv):
    fuzz_run(argv)


# ---------------------------------------------------------------------------------------------
# (b) plan files


PLAN_ARGV = st.tuples(st.sampled_from(["llama3-8b", "llama3-8b", "qwen2.5-7b"]), st.lists(_flag(), max_size=2)).map(
    lambda t: ["estimate", t[0], "--plan", "plan.yaml", *(a for f in t[1] for a in f)]
)


@settings(max_examples=120, **FUZZ)
@given(data=PLAN_BYTES, argv=PLAN_ARGV)
def test_plan_files(workdir, data, argv):
    _write(workdir / "plan.yaml", data)
    fuzz_run(argv)


@pytest.mark.slow
@SLOW
@given(data=PLAN_BYTES, argv=PLAN_ARGV)
def test_plan_files_slow(workdir, data, argv):
    _write(workdir / "plan.yaml", data)
    fuzz_run(argv)


# ---------------------------------------------------------------------------------------------
# (c) budgets files


CHECK_ARGV = st.lists(
    st.sampled_from([["--format", "json"], ["--format", "markdown"], ["--junit", "j.xml"], ["--markdown", "m.md"],
                     ["--baseline", "base.json"], ["--baseline", "base.json", "--update-baseline"],
                     ["--allocator", "expandable"], ["--device", "cpu"]]),
    max_size=2,
).map(lambda fs: ["check", "budgets.yaml", *(a for f in fs for a in f)])  # fmt: skip
BASELINES = st.sampled_from([None, b"", b"{}", b'{"version": 1, "entries": {}}', b"[]", b"\xff", b'{"version": 2}',
                             b'{"version": 1, "entries": {"a": {"metric": "reserved", "bytes": -1}}}',
                             b'{"version": 1, "entries": {"a": {"metric": "reserved", "bytes": 1}}}'])  # fmt: skip


@settings(max_examples=100, **FUZZ)
@given(data=BUDGETS_BYTES, argv=CHECK_ARGV, baseline=BASELINES)
def test_budgets_files(workdir, data, argv, baseline):
    _write(workdir / "budgets.yaml", data)
    base = workdir / "base.json"
    base.unlink(missing_ok=True)
    if baseline is not None:
        _write(base, baseline)
    fuzz_run(argv)


@pytest.mark.slow
@SLOW
@given(data=BUDGETS_BYTES, argv=CHECK_ARGV, baseline=BASELINES)
def test_budgets_files_slow(workdir, data, argv, baseline):
    _write(workdir / "budgets.yaml", data)
    base = workdir / "base.json"
    base.unlink(missing_ok=True)
    if baseline is not None:
        _write(base, baseline)
    fuzz_run(argv)


# ---------------------------------------------------------------------------------------------
# (d) export and tune, kept cheap


EXPORT_TARGETS = ["deepspeed", "accelerate", "torchtitan", "megatron", "fsdp2", "hf-trainer", "axolotl"]
EXPORT_FLAGS = mix(
    _flag().filter(lambda f: f[0] not in ("--timeline", "--inference", "--batch", "--context", "--kv-dtype")),
    st.tuples(st.sampled_from(["--gradient-clipping"]), FLOAT_VALUES).map(list),
    st.tuples(st.sampled_from(["--sharding"]), st.sampled_from(["deepspeed", "fsdp", "x"])).map(list),
    st.tuples(st.sampled_from(["--torchtitan-form"]), st.sampled_from(["python", "toml", "x"])).map(list),
    st.tuples(st.sampled_from(["--torchtitan-model"]), st.sampled_from(["llama3:8B", "x", "", ":"])).map(list),
    st.tuples(st.sampled_from(["--nvme-path"]), st.sampled_from(["/nvme", "", "rel"])).map(list),
    st.tuples(st.sampled_from(["-o", "--output"]), st.sampled_from(["out.cfg", "adir", "afile/x", ""])).map(list),
)
EXPORT_ARGV = st.tuples(
    st.sampled_from(EXPORT_TARGETS + ["nope", ""]),
    mix(st.just(["--model", "llama3-8b"]), st.just(["plan.yaml"]), st.just(["plan.yaml", "--model", "qwen2.5-7b"])),
    st.lists(EXPORT_FLAGS, max_size=4),
).map(lambda t: ["export", "--to", t[0], *t[1], *(a for f in t[2] for a in f)])


@settings(max_examples=80, **FUZZ)
@given(argv=EXPORT_ARGV, plan=PLAN_BYTES)
def test_export(workdir, argv, plan):
    _write(workdir / "plan.yaml", plan)
    fuzz_run(argv)


TUNE_FLAGS = mix(
    st.sampled_from([["--exhaustive"], ["--trials", "2", "--no-exhaustive"], ["--format", "json"], ["--top", "1"]]),
    st.sampled_from([["--allow-offload"], ["--objective", "memory"], ["--objective", "pareto"], ["--margin", "2GiB"]]),
    st.sampled_from([["--margin", "-5%"], ["--margin", "nan%"], ["--margin", "x"], ["--global-batch", "8-4"]]),
    st.sampled_from([["--global-batch", "8-16"], ["--global-batch", "x"], ["--precision", "bf16,nope"]]),
    st.sampled_from([["--seq-len", "512"], ["--max-micro-batch", "2"], ["--export", "deepspeed"], ["--export", "x"]]),
    st.sampled_from([["--finetune", "lora"], ["--finetune", "qlora", "--allow-quantization"], ["--max-cp", "2"]]),
    st.sampled_from([["--storage", "nope://"], ["--storage", ""], ["--study", ""], ["--out", "adir"]]),
    st.sampled_from([["--memory-limit", "2GiB"], ["--memory-limit", "1e400GiB"], ["--memory-limit", "0GiB"]]),
)
TUNE_ARGV = st.tuples(
    st.sampled_from(["llama3-8b", "phi3-mini", "nope"]),
    st.sampled_from(["1", "2", "0", "x"]),
    st.lists(TUNE_FLAGS, max_size=3),
).map(lambda t: ["tune", t[0], "--gpus", t[1], "--out", "p.yaml", *(a for f in t[2] for a in f)])


@settings(max_examples=12, **FUZZ)
@given(argv=TUNE_ARGV)
def test_tune(workdir, argv):
    if "--trials" not in argv and "--exhaustive" not in argv:
        argv = [*argv, "--exhaustive"]  # no 300-trial studies in the default suite
    fuzz_run([*argv, "--storage", f"sqlite:///{workdir / 'tune.db'}"] if "--storage" not in argv else argv)


# ---------------------------------------------------------------------------------------------
# what the fuzzing found, kept as plain reproducers


@pytest.mark.parametrize(
    ("value", "reason"),
    [("true", "got a boolean"), ("'0.1'", "got a string"), (".nan", "finite number"), (".inf", "finite number")],
)
def test_lora_dropout_of_a_wrong_type_is_refused_not_coerced(workdir, value, reason):
    """``lora_dropout: true`` read as 1.0 ("less than 1"), ``'0.1'`` as 0.1: refused now, as ``tp: true`` is."""
    (workdir / "plan.yaml").write_text(f"plan: {{finetune: lora, lora_dropout: {value}}}\n")
    code, out, err = fuzz_run(["estimate", "llama3-8b", "--plan", "plan.yaml"])
    assert code == 2 and err.startswith(f"{PREFIX}plan.yaml: plan.lora_dropout: ") and reason in err, err


def test_check_measure_on_cuda_without_a_gpu_is_one_line(workdir):
    """It was exit 1 after starting a trainer per entry, each 'not evaluated' with torch's AssertionError."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (workdir / "budgets.yaml").write_text("entries:\n- {name: a, model: llama3-8b, gpus: 8, budget: 70GiB}\n")
    code, out, err = fuzz_run(["check", "budgets.yaml", "--measure", "--device", "cuda"])
    assert code == 2 and err.startswith(f"{PREFIX}command line: --device: cuda was asked for"), err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["export", "plan.yaml", "--to", "deepspeed", "-o", "plan.yaml"], "--output"),
     (["check", "budgets.yaml", "--junit", "budgets.yaml"], "--junit")],
)  # fmt: skip
def test_an_output_over_its_own_input_is_refused(workdir, argv, flag):
    plan = "model: llama3-8b\ngpus: 8\nplan: {zero: 3}\n"
    budgets = "entries:\n- {name: a, model: llama3-8b, gpus: 8, plan: {zero: 3}, budget: 70GiB}\n"
    (workdir / "plan.yaml").write_text(plan)
    (workdir / "budgets.yaml").write_text(budgets)
    code, out, err = fuzz_run(argv)
    assert (workdir / "plan.yaml").read_text() == plan and (workdir / "budgets.yaml").read_text() == budgets
    assert code == 2 and err.startswith(f"{PREFIX}command line: {flag}: "), err


@pytest.mark.parametrize("argv", [["tune", "llama3-8b", "--gpus", "1", "--exhaustive"], ["validate", "llama3-8b"]])
def test_memory_limit_beyond_a_float_is_one_line(workdir, argv):
    """``--memory-limit 1e400GiB`` was an internal error (OverflowError), exit 1."""
    code, out, err = fuzz_run([*argv, "--memory-limit", "1e400GiB", "--out", "o.yaml"])
    assert code == 2 and err.startswith(f"{PREFIX}command line: --memory-limit: "), err


@pytest.mark.parametrize("margin", ["1e400GiB", "inf%", "-inf%"])
def test_tune_margin_beyond_a_float_is_one_line(workdir, margin):
    code, out, err = memplan(
        ["tune", "llama3-8b", "--gpus", "1", "--exhaustive", "--margin", margin, "--out", "o.yaml"]
    )
    check_outcome(["tune", "--margin", margin], code, out, err)
