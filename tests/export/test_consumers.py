"""Exports read by their real consumers where those install on a CPU machine.

- DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig`` (its pydantic sub-configs forbid
  unknown keys) with the data-parallel world size the plan has;
- Accelerate: ``accelerate launch``'s own path (argument parser, ``_validate_launch_command``,
  ``prepare_multi_gpu_env``) into ``FullyShardedDataParallelPlugin``;
- Megatron-LM: bash reads the ``MEMPLAN_ARGS`` array (Megatron-LM itself does not install from
  a package; its flags are checked by memplan's copy of the parser subset in the round trip);
- torchtitan (not installable with this torch): its documented key lists, and torch's own
  pipeline schedule registry for the schedule names;
- FSDP2: the written module run on a small transformers Llama under the fake process group.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from memplan.export import render
from memplan.export.megatron import arguments
from memplan.export.torchtitan import config_calls

L8 = "llama3-8b"
HERE = Path(__file__).parent

DEEPSPEED_CASES = [
    dict(gpus=8, zero=0, precision="fp32", seq_len=2048, micro_batch=2, global_batch=64),
    dict(gpus=8, zero=1, precision="bf16-master", micro_batch=1, global_batch=256),
    dict(gpus=16, zero=2, precision="fp16-master", micro_batch=4, global_batch=128),
    dict(gpus=8, zero=3, precision="bf16", offload_params="cpu", offload_optimizer="cpu"),
    dict(gpus=8, zero=3, precision="bf16-mixed", offload_optimizer="nvme"),
]


@pytest.mark.parametrize("flags", DEEPSPEED_CASES)
def test_deepspeed_config_class_reads_the_json(make_job, tmp_path, monkeypatch, flags):
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config

    job = make_job(L8, **flags)
    path = tmp_path / "ds_config.json"
    path.write_text(render(job, "deepspeed", nvme_path="/local_nvme").text)
    # the batch keys must agree with DeepSpeed's world size, the data-parallel degree here
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: job.plan.dp)
    cfg = ds_config.DeepSpeedConfig(str(path))
    p, w = job.plan, job.workload
    assert cfg.world_size == p.dp
    assert cfg.train_micro_batch_size_per_gpu == w.micro_batch
    assert cfg.train_batch_size == (w.global_batch or w.micro_batch * p.dp)
    assert cfg.zero_optimization_stage == p.zero
    z = cfg.zero_config
    assert (z.offload_optimizer.device if z.offload_optimizer else "none") == p.offload_optimizer
    assert (z.offload_param.device if z.offload_param else "none") == p.offload_params
    assert cfg.bfloat16_config.enabled == (p.precision in ("bf16", "bf16-master"))
    assert cfg.bfloat16_config.bf16_master_weights_and_grads == (p.precision == "bf16")
    assert cfg.float16_config.enabled == (p.precision == "fp16-master")
    assert cfg.torch_autocast_enabled == (p.precision == "bf16-mixed")
    if p.zero >= 1:
        assert z.overlap_comm is False
        assert z.reduce_bucket_size > 0
    if p.zero == 3:
        assert z.param_persistence_threshold == 0
        assert z.max_live_parameters >= 2 * z.prefetch_bucket_size


ACCELERATE_CASES = [
    dict(gpus=8, zero=3, precision="bf16-mixed", recompute="full"),
    dict(gpus=16, zero=2, precision="fp32"),
    dict(gpus=16, zero=3, precision="bf16-mixed", offload_params="cpu", offload_optimizer="cpu", cp=2, seq_len=8192),
]


@pytest.mark.parametrize("flags", ACCELERATE_CASES)
def test_accelerate_launch_reads_the_yaml(make_job, tmp_path, monkeypatch, flags):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    job = make_job(L8, **flags)
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(job, "accelerate").text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    p = job.plan
    assert args.num_processes == p.world_size
    assert args.num_machines == job.cluster.nodes
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward == (p.zero == 3)
    assert (plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == (
        p.offload_params == "cpu"
    )
    assert plugin.activation_checkpointing == (p.recompute == "full")
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if p.precision == "bf16-mixed" else "no")
    assert int(env.get("PARALLELISM_CONFIG_CP_SIZE", 1)) == p.cp
    assert int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", p.dp)) == p.dp


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_reads_the_megatron_arguments(make_job, tmp_path):
    job = make_job(
        "mixtral-8x7b", gpus=32, tp=2, ep=8, pp=2, zero=1, recompute="full", recompute_layers=4, global_batch=64
    )
    path = tmp_path / "megatron.sh"
    text = render(job, "megatron").text
    path.write_text(text)
    script = f'source "{path}"; printf "%s\\n" "${{MEMPLAN_ARGS[@]}}"; echo "$GPUS_PER_NODE x $NNODES"'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert lines[:-1] == arguments(text)
    assert lines[-1] == "8 x 4"
    assert "--moe-layer-freq" not in lines  # every Mixtral layer is MoE
    assert lines[lines.index("--num-experts") + 1] == "8"


# torchtitan's documented keys (torchtitan/config/job_config.py of the TOML era, and the
# current torchtitan/config/configs.py dataclasses), per section / class
TOML_KEYS = {
    "model": {"name", "flavor", "tokenizer_path", "converters", "print_after_conversion"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"},
    "training": {
        "dataset",
        "dataset_path",
        "local_batch_size",
        "global_batch_size",
        "seq_len",
        "max_norm",
        "steps",
        "enable_cpu_offload",
        "dtype",
        "mixed_precision_param",
        "mixed_precision_reduce",
        "gc_freq",
        "gc_debug",
    },
    "parallelism": {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "context_parallel_degree",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    },
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns"},
}
PYTHON_KEYS = {
    "TrainingConfig": TOML_KEYS["training"] - {"dataset", "dataset_path"},
    "ParallelismConfig": (TOML_KEYS["parallelism"] - {"expert_tensor_parallel_degree"})
    | {"enable_sequence_parallel", "enable_fsdp_symm_mem", "full_dtensor", "context_parallel_load_balancer"},
    "ActivationCheckpointConfig": {"mode", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop"},
    "Trainer.Config": {"model_spec", "training", "parallelism", "activation_checkpoint"},
    "model_registry": set(),
}
VALUES = {
    "fsdp_reshard_after_forward": {"default", "always", "never"},
    "mode": {"selective", "full", "memory_budget", "none"},
    "dtype": {"bfloat16", "float32"},
    "mixed_precision_param": {"bfloat16", "float32"},
    "mixed_precision_reduce": {"float32"},
    "implementation": {"for-loop", "foreach", "fused"},
}  # fmt: skip
TORCHTITAN_PLANS = [
    (L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="full")),
    (L8, dict(gpus=8, zero=3, precision="bf16-mixed", recompute="selective-op")),
    (L8, dict(gpus=8, zero=0, precision="fp32")),
    (
        "llama3-70b",
        dict(gpus=64, tp=8, sequence_parallel=True, pp=4, pp_schedule="interleaved", virtual_stages=2, zero=2,
             precision="bf16-mixed", global_batch=512),
    ),
    ("llama3-70b", dict(gpus=64, tp=8, sequence_parallel=True, pp=8, zero=3, precision="bf16", global_batch=64)),
]  # fmt: skip


def _check_values(keys: dict) -> None:
    for key, value in keys.items():
        if key in VALUES:
            assert value in VALUES[key], (key, value)


def _check_pipeline(par: dict, num_layers: int, virtual: int) -> None:
    """torchtitan's split (distributed/pipeline_parallel.py): ceil((L + first + last less) / per stage)
    virtual stages, a multiple of pp; a single-stage schedule takes 1 per rank, a looped one >= 2."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    if par["pipeline_parallel_degree"] == 1:
        return
    less = par["pipeline_parallel_first_stage_less_layers"] + par["pipeline_parallel_last_stage_less_layers"]
    stages = math.ceil((num_layers + less) / par["pipeline_parallel_layers_per_stage"])
    assert stages == par["pipeline_parallel_degree"] * virtual
    single = issubclass(get_schedule_class(par["pipeline_parallel_schedule"]), PipelineScheduleSingle)
    assert single == (virtual == 1)


@pytest.mark.parametrize(("model", "flags"), TORCHTITAN_PLANS)
def test_torchtitan_toml_uses_documented_keys(make_job, model, flags):
    job = make_job(model, **flags)
    doc = tomllib.loads(render(job, "torchtitan", form="toml").text)
    for section, keys in doc.items():
        assert set(keys) <= TOML_KEYS[section], (section, set(keys) - TOML_KEYS[section])
        _check_values(keys)
    _check_pipeline(doc["parallelism"], job.model.num_layers, job.plan.virtual_stages)


@pytest.mark.parametrize(("model", "flags"), TORCHTITAN_PLANS)
def test_torchtitan_python_config_uses_documented_names(make_job, model, flags):
    job = make_job(model, **flags)
    text = render(job, "torchtitan").text
    tree = ast.parse(text)
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert imports == {
        ("torchtitan.config", "ActivationCheckpointConfig"),
        ("torchtitan.config", "ParallelismConfig"),
        ("torchtitan.config", "TrainingConfig"),
        ("torchtitan.models.llama3", "model_registry"),
        ("torchtitan.trainer", "Trainer"),
    }
    calls = config_calls(text)
    assert set(calls) == set(PYTHON_KEYS)
    for name, keys in calls.items():
        assert set(keys) <= PYTHON_KEYS[name], (name, set(keys) - PYTHON_KEYS[name])
        _check_values(keys)
    _check_pipeline(calls["ParallelismConfig"], job.model.num_layers, job.plan.virtual_stages)
    degrees = calls["ParallelismConfig"]
    product = 1
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "context_parallel_degree"):  # fmt: skip
        product *= degrees[key]
    assert product == job.plan.world_size  # torchtitan checks NGPU against this product


FSDP2_PLANS = [
    dict(gpus=4, tp=2, zero=3, precision="bf16-mixed", recompute="full", recompute_layers=2),
    dict(gpus=2, zero=0, precision="fp32", attention="eager"),
    dict(gpus=2, zero=1, precision="bf16", optimizer="sgd"),
    dict(gpus=2, zero=3, precision="fp32", offload_params="cpu", offload_optimizer="cpu"),
]


def test_fsdp2_module_runs_a_training_step(make_job, tiny_model, tmp_path):
    pytest.importorskip("transformers")
    model = tiny_model()
    paths, jobs = [], []
    for i, flags in enumerate(FSDP2_PLANS):
        flags = dict(flags, seq_len=32, micro_batch=2, global_batch=2 * 2 * (flags["gpus"] // flags.get("tp", 1)))
        job = make_job(model, **flags)
        path = tmp_path / f"plan_{i}.py"
        path.write_text(render(job, "fsdp2").text)
        paths.append(str(path))
        jobs.append(job)
    proc = subprocess.run(
        [sys.executable, str(HERE / "fsdp2_driver.py"), *paths], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(jobs)
    for job, got in zip(jobs, results, strict=True):
        p = job.plan
        fsdp = p.zero >= 2 and p.dp > 1
        assert got["fsdp_layers"] == (job.model.num_layers if fsdp else 0)
        if not fsdp and p.dp > 1:
            assert got["wrapper"] == "DistributedDataParallel"
        assert got["checkpointed"] == (0 if p.recompute == "none" else (p.recompute_layers or job.model.num_layers))
        mesh = ["dp", "tp"] if p.tp > 1 and fsdp else (["tp"] if p.tp > 1 else (["dp"] if fsdp else None))
        assert got["mesh"] == mesh
        assert got["param_dtype"] == ("torch.bfloat16" if p.precision == "bf16" else "torch.float32")
        want_opt = {"adamw": "AdamW", "sgd": "SGD", "adafactor": "Adafactor"}[p.optimizer]
        if p.zero == 1:
            assert (got["optimizer"], got["inner_optimizer"]) == ("ZeroRedundancyOptimizer", want_opt)
        else:
            assert got["optimizer"] == want_opt
