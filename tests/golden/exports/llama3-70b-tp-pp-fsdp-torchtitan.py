# memplan export --to torchtitan: llama3-70b on 64 x h100-sxm, 8 node(s)
# plan: dp=2 tp=8 pp=4 cp=1 ep=1 sp pp_schedule=interleaved virtual_stages=2 zero=2
# recompute=full precision=bf16-mixed optimizer=adamw attention=flash
# workload: seq_len=8192 micro_batch=1 global_batch=512 (gradient accumulation 256); runtime=memplan
# set in the training code:
# - NGPU=64: the launch's world size must equal the product of the degrees
# - optimizer AdamW: the estimate's optimizer step assumes implementation='foreach' (one state-sized temporary);
#   set it on the config's optimizer, where your torchtitan version has that field
# - optimizer lr, lr_scheduler, dataloader, steps and checkpointing are not part of the plan: set them

from torchtitan.config import ActivationCheckpointConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def memplan_plan() -> Trainer.Config:
    """llama3-70b: the plan memplan estimated.

    Run with MODULE=<this module> CONFIG=memplan_plan NGPU=64 ./run_train.sh
    """
    return Trainer.Config(
        model_spec=model_registry("70B"),
        training=TrainingConfig(
            local_batch_size=256,
            global_batch_size=512,
            seq_len=8192,
            max_norm=1.0,
            enable_cpu_offload=False,
            dtype="float32",
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
        ),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=1,
            data_parallel_shard_degree=2,
            fsdp_reshard_after_forward="never",
            tensor_parallel_degree=8,
            enable_sequence_parallel=True,
            enable_async_tensor_parallel=False,
            pipeline_parallel_degree=4,
            pipeline_parallel_schedule="Interleaved1F1B",
            pipeline_parallel_layers_per_stage=10,
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
            pipeline_parallel_microbatch_size=1,
            context_parallel_degree=1,
            expert_parallel_degree=1,
        ),
        activation_checkpoint=ActivationCheckpointConfig(
            mode="full",
        ),
    )
