"""What one rank holds and runs, in closed form: the facts the phase model (``memory.py``) and
the op-level estimate (``run_report.py``, ``time.py``, ``estimation.py``) both read.

Its model states (the ZeRO partition, LoRA / QLoRA's, bitsandbytes' paged states apart), the
micro-batches of its step, the kernel its attention runs and its role in the pipeline. Kept apart
from ``memory.py`` so that an estimate the op-level run answers does not import the phase model
(its 2,700 lines, their dataclasses and named tuples, and the modules only it uses: 45 M
instructions of a cold ``memplan estimate``'s import, docs/accuracy.md, "Speed of the estimate path").
"""

from functools import lru_cache
from typing import Literal, NamedTuple

from memplan.costmodel import lora as L
from memplan.costmodel.attention import sdpa_backend
from memplan.costmodel.layout import StageLayout, stage_layout
from memplan.costmodel.optimizer import foreach_temp_bytes_per_param, is_paged, paged_state_bytes, state_bytes_per_param
from memplan.costmodel.precision import POLICIES, PrecisionPolicy
from memplan.costmodel.quant import quantized_weight_bytes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

Device = Literal["cuda", "cpu"]  # where the step runs: CUDA on a GPU profile, or a CPU run of the trainer


class States(NamedTuple):
    """Bytes of one rank's model states by kind, and the elements its optimizer steps."""

    params: int
    grads: int
    optimizer: int
    optimizer_temp: int
    cpu: int
    nvme: int
    optimizer_elements: float  # parameters whose optimizer state this rank holds
    master_elements: float | None = None  # of those, the ones with fp32 master weights (None: all)
    paged: int = 0  # paged optimizer states in CUDA managed memory (outside the allocator; not in optimizer)


def gradient_accumulation(workload: TrainingWorkload, plan: Plan) -> int:
    """Micro-batches per step on one rank: global_batch / (micro_batch x dp)."""
    if (batch := workload.global_batch) is None:  # read once: a model's attribute read is slow (PlanFields)
        return 1
    return max(1, batch // (workload.micro_batch * plan.dp))


def model_states(
    layout: StageLayout, plan: Plan, policy: PrecisionPolicy, factored: float, optimizer_shard: int | None = None
) -> States:
    """Bytes of params, grads and optimizer states on one rank (ZeRO, Rajbhandari et al. 2020).

    Dense params shard over the dp x cp ranks, routed experts over dp x cp / ep. Stage 1
    shards optimizer states (with fp32 master weights), 2 also gradients, 3 also params.
    Offloaded states move to CPU or NVMe with their shard. ``optimizer_shard``: the elements
    the rank's optimizer steps where the partition is not even (``memory.zero1_shard``).
    """
    group = plan.dp * plan.cp
    shard = layout.dense_params / group + layout.expert_params / (group // plan.ep)
    full = layout.params
    params_n = shard if plan.zero >= 3 else full
    grads_n = shard if plan.zero >= 2 else full
    opt_n = shard if plan.zero >= 1 else full
    if optimizer_shard is not None:
        opt_n = optimizer_shard
    opt_bytes = int(opt_n * state_bytes_per_param(plan.optimizer, policy, factored))
    params_bytes = int(params_n * policy.param_bytes)
    cpu = nvme = 0
    if plan.offload_optimizer != "none":
        # ZeRO-Offload keeps fp32 gradients beside the states on the host
        host = opt_bytes + (int(opt_n * 4) if policy.master_bytes else 0)
        cpu, nvme = (host, 0) if plan.offload_optimizer == "cpu" else (int(opt_n * 4), opt_bytes)
        opt_bytes = 0
    if plan.offload_params != "none":
        cpu, nvme = (cpu + params_bytes, nvme) if plan.offload_params == "cpu" else (cpu, nvme + params_bytes)
        params_bytes = 0
    temp = 0 if plan.offload_optimizer != "none" else int(opt_n * foreach_temp_bytes_per_param(plan.optimizer, policy))
    return States(params_bytes, int(grads_n * policy.grad_bytes), opt_bytes, temp, cpu, nvme, opt_n)


# LoRA adapters are fp32 whatever the base (PEFT's autocast_adapter_dtype), with fp32 states
ADAPTER_POLICY = PrecisionPolicy("lora-adapter", 4, 4, 0, 4, 4)


def finetune_states(
    layout: StageLayout, model: ModelSpec, plan: Plan, policy: PrecisionPolicy, factored: float
) -> States:
    """Model states of LoRA / QLoRA on one rank (PEFT over transformers, measured with MemTracker):

    - the frozen base: every parameter in the param dtype, or with ``quant`` the decoder
      layers' linears quantized (``quant.quantized_weight_bytes``) and everything else (the
      embedding, norms, LM head) in fp32, as ``prepare_model_for_kbit_training`` casts it;
    - trainable: the adapters (``lora.layer_adapter_params`` per layer, fp32) and the copies
      ``modules_to_save`` makes (embed_tokens on the first stage, lm_head on the last; in the
      param dtype, fp32 over a quantized base), the originals staying in the frozen base;
    - gradients and optimizer states (and master weights, for a 2-byte trained copy under a
      ``*-master`` policy) for the trainable parameters only, sharded as ``model_states``.
    """
    group = plan.dp * plan.cp
    frozen_n = layout.params
    linears = L.layer_linears(model)
    if plan.quant == "none":
        frozen = frozen_n * policy.param_bytes
    else:
        per_layer = sum(
            quantized_weight_bytes(o // plan.tp, i, plan.quant, plan.double_quant) for i, o in linears.values()
        )
        linear_n = layout.layers * sum(i * o for i, o in linears.values()) // plan.tp
        frozen = layout.layers * per_layer + (frozen_n - linear_n) * 4
    copies = L.saved_module_params(model, plan.modules_to_save)
    saved_n = 0
    if layout.is_first:
        saved_n += copies.get("embed_tokens", 0) // plan.tp
    if layout.is_last:
        saved_n += copies.get("lm_head", 0) // plan.tp
    saved_policy = ADAPTER_POLICY if plan.quant != "none" else policy
    adapters_n = layout.layers * L.layer_adapter_params(model, plan.lora_targets, plan.lora_rank) // plan.tp
    groups = [(adapters_n, ADAPTER_POLICY), (saved_n, saved_policy)]
    params_b = frozen / group if plan.zero >= 3 else frozen
    grads_b = opt_b = temp_b = 0.0
    opt_total = master_n = 0.0
    for n, gp in groups:
        params_b += (n / group if plan.zero >= 3 else n) * gp.param_bytes
        grads_b += (n / group if plan.zero >= 2 else n) * gp.grad_bytes
        opt_n = n / group if plan.zero >= 1 else n
        opt_b += opt_n * state_bytes_per_param(plan.optimizer, gp, factored)
        temp_b += opt_n * foreach_temp_bytes_per_param(plan.optimizer, gp)
        opt_total += opt_n
        master_n += opt_n if gp.master_bytes else 0
    cpu = nvme = 0
    opt_bytes, params_bytes = int(opt_b), int(params_b)
    if plan.offload_optimizer != "none":
        host = opt_bytes + int(master_n * 4)
        cpu, nvme = (host, 0) if plan.offload_optimizer == "cpu" else (int(master_n * 4), opt_bytes)
        opt_bytes = 0
        temp_b = 0
    if plan.offload_params != "none":
        cpu, nvme = (cpu + params_bytes, nvme) if plan.offload_params == "cpu" else (cpu, nvme + params_bytes)
        params_bytes = 0
    return States(params_bytes, int(grads_b), opt_bytes, int(temp_b), cpu, nvme, opt_total, master_n)


def factored_share(model: ModelSpec) -> float:
    """Adafactor's factored state per parameter of a matrix (``model_states``' ``factored``)."""
    return 1 / model.hidden_size + 1 / model.ffn_size


def stage_states(model: ModelSpec, plan: Plan, stage: int, device: Device = "cuda") -> States:
    """The model states of pipeline rank ``stage`` in closed form (the ZeRO partition of
    :func:`model_states`, or :func:`finetune_states`): what lives on the device, what is offloaded
    to the host or NVMe, and bitsandbytes' paged optimizer states (CUDA managed memory, outside
    the caching allocator; on CPU bitsandbytes falls back to ``torch.zeros_like``). No phase sum:
    the op-level estimate reads its host and paged bytes here (``costmodel.run_report``)."""
    layout = stage_layout(model, plan.tp, plan.ep, plan.pp, plan.virtual_stages, stage)
    policy = POLICIES[plan.precision]
    full = model_states(layout, plan, policy, factored_share(model)) if plan.finetune == "full" else None
    return device_states(model, plan, layout, policy, device, full)


def device_states(
    model: ModelSpec, plan: Plan, layout: StageLayout, policy: PrecisionPolicy, device: Device, full: States | None
) -> States:
    """A stage's model states on ``device``: ``full``, the states of full training (:func:`model_states`,
    which the phase model memoises), or, fine-tuning (``full`` None), :func:`finetune_states`; on CUDA
    bitsandbytes' paged optimizer states moved out of ``optimizer`` into ``paged``."""
    st = finetune_states(layout, model, plan, policy, factored_share(model)) if full is None else full
    if device == "cuda" and is_paged(plan.optimizer) and (paged := paged_state_bytes(model, layout, plan)):
        st = st._replace(optimizer=st.optimizer - paged, paged=paged)
    return st


# the search asks for the same few (device, dtype, heads) millions of times
_sdpa_backend = lru_cache(maxsize=4096)(sdpa_backend)


def sdpa_kind(
    model: ModelSpec,
    plan: Plan,
    policy: PrecisionPolicy,
    device: Device = "cuda",
    capability: tuple[int, int] | None = None,
) -> str:
    """The kernel ``scaled_dot_product_attention`` runs for this plan on ``device``
    (``attention.sdpa_backend``): the runtimes call it causal, without a mask or dropout, on
    their rank's heads, GQA passed unrepeated (``enable_gqa``; transformers does so when there
    is no padding mask). ``triton`` attention is memplan's own kernel: flash's tensors.
    ``capability``: the GPU's CUDA compute capability (None: an H100's, 9.0); what the fused
    kernels keep is the same across them (q, k, v, out, an fp32 log-sum-exp), so the memory
    model leaves it at the default and the labels and the time model pass the profile's."""
    if plan.attention == "triton":
        return "flash"
    return _sdpa_backend(
        device,
        "fp32" if policy.compute_bytes == 4 else "bf16",
        model.head_size,
        model.num_attention_heads // plan.tp,
        max(model.kv_heads // plan.tp, 1),
        enable_gqa=True,
        dropout=0.0,
        v_head_dim=model.v_head_size,
        **({"capability": tuple(capability)} if capability is not None and device == "cuda" else {}),
    )


def stage_role(stage: int, pp: int) -> str:
    """``Peak.rank_role`` of pipeline rank ``stage`` of ``pp``."""
    if pp == 1:
        return "every rank (no pipeline)"
    if stage in (0, pp - 1):
        return "first pipeline stage" if stage == 0 else "last pipeline stage"
    return f"pipeline stage {stage}"
