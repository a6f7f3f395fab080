#!/usr/bin/env bash
# memplan export --to megatron: llama3-70b on 64 x h100-sxm, 8 node(s)
# plan: dp=2 tp=8 pp=4 cp=1 ep=1 sp pp_schedule=interleaved virtual_stages=2 zero=1
# recompute=selective precision=bf16-master optimizer=adamw attention=flash
# workload: seq_len=8192 micro_batch=1 global_batch=512 (gradient accumulation 256); runtime=megatron
# set in the training code:
# - vocabulary 128256: the --tokenizer-* arguments must yield it
# - add data, tokenizer, learning-rate, iteration and checkpoint arguments to MEMPLAN_ARGS
# - --bf16 accumulates and all-reduces gradients in fp32 main_grad buffers (4 bytes per parameter where the
#   estimate's bf16-master counts 2)
GPUS_PER_NODE=8
NNODES=8
MEMPLAN_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --max-position-embeddings 8192
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --make-vocab-size-divisible-by 1
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 4
    --context-parallel-size 1
    --expert-model-parallel-size 1
    --num-layers-per-virtual-pipeline-stage 10
    --sequence-parallel
    --micro-batch-size 1
    --global-batch-size 512
    --seq-length 8192
    --recompute-granularity selective
    --use-distributed-optimizer
    --bf16
    --optimizer adam
    --attention-backend flash
    --clip-grad 1.0
)
# on every node (add data, tokenizer, learning-rate and checkpoint arguments):
# torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
#     --master-addr "$MASTER_ADDR" --master-port 6000 pretrain_gpt.py "${MEMPLAN_ARGS[@]}"
