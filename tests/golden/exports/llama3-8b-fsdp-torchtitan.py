# memplan export --to torchtitan: llama3-8b on 8 x h100-sxm, 1 node(s)
# plan: dp=8 tp=1 pp=1 cp=1 ep=1 zero=3
# recompute=full precision=bf16-mixed optimizer=adamw attention=flash
# workload: seq_len=4096 micro_batch=2 global_batch=64 (gradient accumulation 4); runtime=memplan
# set in the training code:
# - NGPU=8: the launch's world size must equal the product of the degrees
# - optimizer AdamW: the estimate's optimizer step assumes implementation='foreach' (one state-sized temporary);
#   set it on the config's optimizer, where your torchtitan version has that field
# - optimizer lr, lr_scheduler, dataloader, steps and checkpointing are not part of the plan: set them

from torchtitan.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def memplan_plan() -> Trainer.Config:
    """llama3-8b: the plan memplan estimated.

    Run with MODULE=<this module> CONFIG=memplan_plan NGPU=8 ./run_train.sh
    """
    return Trainer.Config(
        model_spec=model_registry("8B"),
        training=TrainingConfig(
            local_batch_size=2,
            global_batch_size=64,
            seq_len=4096,
            max_norm=1.0,
            enable_cpu_offload=False,
            dtype="float32",
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=1,
            data_parallel_shard_degree=8,
            fsdp_reshard_after_forward="always",
            tensor_parallel_degree=1,
            enable_sequence_parallel=False,
            enable_async_tensor_parallel=False,
            pipeline_parallel_degree=1,
            context_parallel_degree=1,
            expert_parallel_degree=1,
        ),
        activation_checkpoint=ActivationCheckpointConfig(
            mode="full",
        ),
    )
