"""``memplan estimate`` must not pull in the heavy optional stacks (torch, triton, optuna).

Checked in a fresh interpreter: the test process itself may have imported any of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HEAVY = ("torch", "triton", "optuna")
# what ``memplan estimate`` does not need: the other commands and the trace reader
OTHER = (
    "memplan.cli.tune",
    "memplan.cli.validate",
    "memplan.cli.check",
    "memplan.cli.export",
    "memplan.search.tuning",
    "memplan.costmodel.allocator.trace",
    "memplan.cli.explain",
    "memplan.explain",
    "memplan.viz",
    "matplotlib",
    "PIL",
)

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import memplan.cli.app
    after_import = sorted(m for m in {heavy!r} if m in sys.modules)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memplan.cli.app.run(["estimate", "llama3-8b", "--format", "json"])
    json.loads(out.getvalue())
    after_run = sorted(m for m in {heavy!r} if m in sys.modules)
    other = sorted(m for m in {other!r} if m in sys.modules)
    print(json.dumps({{"code": code, "err": err.getvalue(), "after_import": after_import, "after_run": after_run,
                      "other": other}}))
    """
).format(heavy=HEAVY, other=OTHER)


def test_estimate_does_not_import_heavy_modules():
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, result["err"]
    assert result["after_import"] == [], f"import memplan.cli.app pulled in {result['after_import']}"
    assert result["after_run"] == [], f"memplan estimate pulled in {result['after_run']}"
    assert result["other"] == [], f"memplan estimate imported other commands' modules: {result['other']}"


def test_help_lists_every_command():
    """Commands are imported only when run; ``memplan --help`` still lists them all."""
    proc = subprocess.run(
        [sys.executable, "-m", "memplan.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("estimate", "profiles", "validate", "export", "check", "tune", "explain"):
        assert f" {name} " in proc.stdout, name


TIMELINE_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import memplan.cli.app
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memplan.cli.app.run(["estimate", "llama3-8b", "--format", "json", "--timeline", sys.argv[1]])
    loaded = sorted(m for m in ("torch", "triton", "optuna", "matplotlib", "PIL") if m in sys.modules)
    print(json.dumps({"code": code, "err": err.getvalue(), "loaded": loaded}))
    """
)


def test_timeline_imports_pillow_only_for_png(tmp_path):
    """--timeline keeps torch off the estimate path; Pillow comes in only for a PNG, and nothing
    draws with matplotlib (its import alone took 0.4-0.7 s)."""
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    for suffix, expected in ((".html", []), (".pickle", []), (".svg", []), (".png", ["PIL"])):
        out = tmp_path / f"t{suffix}"
        proc = subprocess.run([sys.executable, "-c", TIMELINE_SCRIPT, str(out)], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["code"] == 0, result["err"]
        assert result["loaded"] == expected, (suffix, result["loaded"])
        assert out.stat().st_size > 0


FAKE_PYNVML = """
class NVMLError(Exception):
    pass
class _Memory:
    total = 46068 * 2**20
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 2
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetName(h): return "NVIDIA L40S"
def nvmlDeviceGetMemoryInfo(h): return _Memory()
"""

NVML_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import memplan.cli.app
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memplan.cli.app.run(["estimate", "llama3-8b", "--format", "json", *sys.argv[1:]])
    print(json.dumps({"code": code, "err": err.getvalue(), "gpu": json.loads(out.getvalue())["gpu"]["name"],
                      "pynvml": "pynvml" in sys.modules}))
    """
)


def test_pynvml_is_imported_only_for_gpu_auto(tmp_path):
    """With nvidia-ml-py installed (a fake here), a named --gpu never imports it; auto (the default) does."""
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for args, gpu, imported in ((["--gpu", "h100-sxm"], "h100-sxm", False), ([], "l40s", True)):
        proc = subprocess.run([sys.executable, "-c", NVML_SCRIPT, *args], capture_output=True, text=True, env=env,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["code"] == 0, result["err"]
        assert (result["gpu"], result["pynvml"]) == (gpu, imported), args


# what a plan that fits, replayed from the phase model's moments, leaves unimported or unbuilt
LAZY = (
    "memplan.costmodel.advice",  # only when the plan does not fit
    "memplan.costmodel.timeline.trainer",  # the bundled trainer's op-by-op run: only where it applies
    "memplan.costmodel.timeline.trainer_model",
    "memplan.costmodel.timeline.autograd",
    "memplan.costmodel.timeline.fsdp",
    "memplan.viz",
    "memplan.search.calibration",  # only when a calibration file exists
    "memplan.specs.hf",  # the config.json readers: only for a Hugging Face config
)
FITTING_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import memplan.cli.app
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        # a pipeline: a plan the op-level run does not model yet (ZeRO-2 and ZeRO-3 it does, since issue 27),
        # with the headroom of an ample fit (ZeRO-1 alone is tight against the phase model's band)
        args = ["estimate", "llama3-8b", "--gpus", "8", "--pp", "2", "--zero", "1", "--format", "json"]
        code = memplan.cli.app.run(args)
    result = json.loads(out.getvalue())
    loaded = sorted(m for m in LAZY if m in sys.modules)
    from memplan.search.calibration import Calibration, ProfileCalibration
    from memplan.specs.workload import InferenceWorkload
    print(json.dumps({
        "code": code, "err": err.getvalue(), "fits": result["fits"],
        "timeline": result["memory"]["peak"]["reserved_detail"]["timeline"],
        "loaded": loaded,
        "built": sorted(c.__name__ for c in (Calibration, ProfileCalibration, InferenceWorkload)
                        if c.__pydantic_complete__),
    }))
    """
).replace("LAZY", repr(LAZY))


def test_a_fitting_estimate_imports_and_builds_only_what_it_needs(tmp_path):
    """The cold start of ``memplan estimate`` (benchmarks/bench_estimate.py): a plan that fits needs
    no advice, a plan the trainer's run does not model needs none of its modules, and with no
    calibration file (and a training workload) neither the calibration's nor the inference
    workload's validators are built."""
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    env["MEMPLAN_HOME"] = str(tmp_path)  # no calibration.json there
    proc = subprocess.run([sys.executable, "-c", FITTING_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, result["err"]
    assert result["fits"] and result["timeline"].startswith("phases")  # the case this test is about
    assert result["loaded"] == [], f"imported without need: {result['loaded']}"
    assert result["built"] == [], f"validators built without need: {result['built']}"


# the phase model and the modules only it uses: an estimate the op-level run answers reads its rank's
# closed-form facts from ``costmodel.rank`` and imports none of them (45 M instructions of a cold start)
PHASE_MODEL = (
    "memplan.costmodel.memory",
    "memplan.costmodel.fp8",
    "memplan.costmodel.inference",
    "memplan.costmodel.build_blocks",
    "memplan.costmodel.timeline.step",
    "memplan.costmodel.timeline.schedule",
)
OP_LEVEL_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import memplan.cli.app
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = memplan.cli.app.run(["estimate", "llama3-8b", "--gpus", "8", "--zero", "3", "--format", "json"])
    result = json.loads(out.getvalue())
    print(json.dumps({
        "code": code, "err": err.getvalue(), "fits": result["fits"], "model": result["memory"]["model"],
        "loaded": sorted(m for m in PHASE_MODEL if m in sys.modules),
    }))
    """
).replace("PHASE_MODEL", repr(PHASE_MODEL))


def test_an_op_level_estimate_does_not_import_the_phase_model():
    """``memplan estimate``'s default plan (benchmarks/bench_estimate.py's cold start), which the
    bundled trainer's op-level run answers, imports neither ``costmodel.memory`` nor the modules only
    the phase model uses."""
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", OP_LEVEL_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, result["err"]
    assert result["fits"] and result["model"] == "op-level"  # the case this test is about
    assert result["loaded"] == [], f"imported without need: {result['loaded']}"


def test_timeline_draws_the_run_the_estimate_replayed(tmp_path, monkeypatch, capsys):
    """``--timeline`` is handed the run the allocator verdict replayed: the run is built once, and
    it is the one :func:`memplan.viz.predicted.predicted_run` describes."""
    from memplan.cli.app import run
    from memplan.costmodel import reserve
    from memplan.estimation import estimate_with_run
    from memplan.specs.resolve import resolve_job
    from memplan.viz.predicted import predicted_run

    real, calls = reserve.plan_run, []

    def counted(*args, **kwargs):
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(reserve, "plan_run", counted)
    for suffix in (".html", ".pickle"):
        calls.clear()
        out = tmp_path / f"t{suffix}"
        args = ["estimate", "llama3-8b", "--gpus", "8", "--zero", "3", "--gpu", "h100-sxm", "--timeline", str(out)]
        assert run(args) == 0, capsys.readouterr().err
        assert calls == ["llama3-8b"], (suffix, calls)
        assert out.stat().st_size > 0
    for flags, inference in (({"gpus": 8, "zero": 3}, False), ({"batch": 4, "context": 4096}, True)):
        job = resolve_job("llama3-8b", None, {**flags, "gpu": "h100-sxm"}, inference=inference)
        _, run_, which = estimate_with_run(job, with_suggestions=False)
        expected, expected_which = predicted_run(job)
        assert (run_.events, which) == (expected.events, expected_which)


LEAVE_SCRIPT = textwrap.dedent(
    """
    import atexit, gc, sys
    import memplan.cli.app
    if sys.argv[1] == "register":
        atexit.register(lambda: print("clean-up ran", "(collector on)" if gc.isenabled() else ""))
    sys.argv = ["memplan", "estimate", "llama3-8b", "--gpus", "8", "--zero", "3", "--format", "json", *sys.argv[2:]]
    memplan.cli.app.main()
    """
)


def test_the_process_leaves_with_its_output_and_its_exit_code():
    """``main`` skips the interpreter's teardown only when nothing is registered to run at exit:
    the output is whole and the exit code kept either way, and registered clean-up still runs.
    An estimate runs with the cyclic collector off to the end (``app._COLLECTOR_OFF``)."""
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    for mode in ("plain", "register"):
        proc = subprocess.run([sys.executable, "-c", LEAVE_SCRIPT, mode], capture_output=True, text=True, env=env,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        if mode == "register":
            assert out.endswith("clean-up ran \n"), out[-80:]
            out = out.removesuffix("clean-up ran \n")
        assert json.loads(out)["fits"] is True
        bad = subprocess.run([sys.executable, "-c", LEAVE_SCRIPT, mode, "--tp", "3"], capture_output=True, text=True,
                             env=env, timeout=60)  # fmt: skip
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tp x pp x cp = 3" in bad.stderr, bad.stderr
        assert bad.stdout == ("clean-up ran \n" if mode == "register" else "")


KEPT_SCRIPT = textwrap.dedent(
    """
    import atexit, contextlib, io, sys
    import memplan.cli.app as app
    if sys.argv[1] == "run":  # as the tests call it: nothing held
        with contextlib.redirect_stdout(io.StringIO()):
            code = app.run(["estimate", "llama3-8b", "--gpus", "8", "--zero", "3"])
        print(code, app._KEPT)
    else:
        atexit.register(lambda: print("kept:", *sorted(type(o).__name__ for o in app._KEPT)))
        sys.argv = ["memplan", "estimate", "llama3-8b", "--gpus", "8", "--zero", "3", "--format", "json"]
        app.main()
    """
)


def test_the_estimate_process_keeps_its_run_to_the_exit():
    """Under ``main`` the estimate's job, result and run are held to the process's exit
    (``app.keep_to_exit``: freed with its memory, not one by one as the command returns); ``run``
    alone, as the tests call it, holds nothing."""
    env = {k: v for k, v in os.environ.items() if k != "MEMPLAN_DEBUG"}
    for mode, expected in (("run", "0 None"), ("main", "kept: EstimateResult Job Timeline")):
        proc = subprocess.run([sys.executable, "-c", KEPT_SCRIPT, mode], capture_output=True, text=True, env=env,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == expected, (mode, proc.stdout[-200:])


PLUGINS_SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    import memplan.cli.app

    def report():
        import pydantic.plugin._loader as loader
        print(os.environ.get("PYDANTIC_DISABLE_PLUGINS"), "searched" if loader._plugins is not None else "not searched")

    atexit.register(report)
    sys.argv = ["memplan", *sys.argv[1:], "--format", "json"]
    memplan.cli.app.main()
    """
)


def test_the_estimate_process_does_not_search_for_pydantic_plugins():
    """``main`` turns pydantic's plugin discovery off for ``memplan estimate`` (``app._NO_PLUGINS``:
    it reads every installed distribution's entry points), keeps a value the user set, and leaves
    the other commands as they are."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEMPLAN_DEBUG", "PYDANTIC_DISABLE_PLUGINS")}
    cases = (
        (["estimate", "llama3-8b", "--gpus", "8", "--zero", "3"], {}, "__all__ not searched"),
        (["estimate", "llama3-8b", "--gpus", "8", "--zero", "3"], {"PYDANTIC_DISABLE_PLUGINS": "x"}, "x searched"),
        (["profiles"], {}, "None searched"),
    )
    for args, extra, expected in cases:
        proc = subprocess.run([sys.executable, "-c", PLUGINS_SCRIPT, *args], capture_output=True, text=True,
                              env={**env, **extra}, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == expected, (args, extra, proc.stdout[-200:])


def test_the_loader_tells_a_config_json_as_the_hf_readers_do():
    """``specs.loader.is_hf_config`` (which spares a bundled profile's estimate the readers' import)
    is ``specs.hf.is_hf_config``."""
    from memplan.specs import hf, loader

    for data in ({}, {"architectures": ["LlamaForCausalLM"]}, {"model_type": "llama"}, {"name": "x", "layers": 2},
                 {"architectures": [], "model_type": ""}, {"hidden_size": 8}):  # fmt: skip
        assert loader.is_hf_config(data) is hf.is_hf_config(data), data
