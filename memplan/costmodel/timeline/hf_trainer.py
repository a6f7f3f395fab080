"""``transformers.Trainer``'s full fine-tuning step (``--runtime hf``) on one rank, as a timeline.

``hf_run`` composes the model of ``hf_model.py`` with the step the installed transformers (5.x)
and accelerate (1.x) run, read from ``transformers/trainer.py`` and checked on CPU against the
real ``Trainer`` (``tests/accuracy/alloc_log.py``):

- the data: accelerate's ``DataLoaderShard`` fetches one batch ahead, so the step's batch and
  the next one (``input_ids`` and ``labels``, int64 b x s each, stacked by the collator) are
  alive together; ``get_batch_samples`` counts ``labels[..., 1:].ne(-100)`` into
  ``num_items_in_batch`` before the previous batch goes;
- ``training_step``: ``compute_loss`` keeps only the loss (the outputs, logits included, go when
  it returns); ``accelerator.backward`` divides it by the accumulation steps and runs the
  backward (``autograd.py``); the loss lives on as ``tr_loss_step`` until the next step's;
- ``isnan`` / ``isinf`` of the loss, ``clip_grad_norm_(max_norm=1.0)`` (foreach norms, their
  stack, the total norm kept until the next clip, the clip coefficient);
- ``adamw_torch_fused``: on its first step, per parameter in group order (decay, then the norms)
  a 4-byte ``step`` and ``exp_avg`` / ``exp_avg_sq``; the fused kernel allocates nothing;
- ``model.zero_grad()`` (``set_to_none``): the gradients go in parameter order;
- on CUDA, cuBLAS's two workspaces (the forward thread's and the autograd thread's) at the first
  step's first matmuls, as in the bundled trainer's run;
- gradient checkpointing as the Trainer turns it on (``GradientCheckpointingLayer`` with
  ``use_reentrant=False``): each decoder layer a non-reentrant checkpoint over its hidden
  states, ``position_ids`` and the rotary tables; with ``gradient_checkpointing_kwargs={"use_reentrant":
  True}`` (the plan's ``use_reentrant``) torch's reentrant checkpoint (``reentrant.py``).

Under ``bf16=True`` (accelerate's autocast; ``trainer_autocast``: ``bf16-mixed`` over the fp32 model,
``bf16`` over the bf16 one unless the plan's ``autocast`` is off: a bf16 model without
``bf16=True``) each matmul casts an fp32 weight (cached for the forward) and an fp32 input to
bf16 (a bf16 one is taken as it is), SDPA casts k then q where they are fp32, and
``convert_outputs_to_fp32`` copies the bf16 logits to fp32 after the forward. With
``gradient_accumulation_steps`` the update's batches are fetched together (accelerate one ahead)
and freed at the next update's fetch, and from the second
micro-batch on each gradient is added into ``.grad`` and freed. The model is the family's
(``hf_families.py``: Qwen3, Phi-3, OLMo 2, Gemma 3 beside Llama's layout). Over ``dp`` > 1 ranks
(``torchrun``) the model is accelerate's ``DistributedDataParallel`` (``hf_ddp.py``: the reducer's
buckets beside ``.grad``, the forward's hooks, the gathered token count), or under ``--zero 2|3``
accelerate's FSDP2 (``hf_fsdp.py``: the groups' hooks around the embedding, each layer and the tail;
the shards built inside ``prepare``; the sharded gradients and states). The model is built as
``plan.model_build`` says (``hf_build.py``): ``from_pretrained`` with a ``device_map`` (the caching
allocator's warmup segment, the checkpoint's weights carved from it, a quantized base quantized as it
loads) or ``to_device`` (each parameter its own allocation).
"""

from __future__ import annotations

from memplan.costmodel.timeline import act_offload, hf_build, hf_ddp, hf_fsdp, hf_fsdp_peft, hf_fsdp_qlora, ops
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Builder, Category, Timeline
from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit
from memplan.costmodel.timeline.hf_ddp import HfDdp
from memplan.costmodel.timeline.hf_families import family, family_config
from memplan.costmodel.timeline.hf_lora import HfLora, HfLoraConfig
from memplan.costmodel.timeline.hf_model import is_norm, param_shapes, scalar_div
from memplan.costmodel.timeline.hf_moe import layer_params as moe_layer_params
from memplan.costmodel.timeline.hf_moe import moe_sizes
from memplan.costmodel.timeline.hf_offload import TrlOffload, in_head
from memplan.costmodel.timeline.hf_optimizers import FusedAdamW, Param, trainer_optimizer
from memplan.costmodel.timeline.hf_repeat import repeat_step, repeats
from memplan.costmodel.timeline.reentrant import Reentrant
from memplan.costmodel.timeline.trainer import CUBLAS_WORKSPACE
from memplan.costmodel.timeline.trainer_model import Dims
from memplan.specs.plan import checkpoint_reentrant, trainer_autocast


def hf_dims(model, workload, plan, runtime: str = "hf") -> Dims:
    """One rank's shapes: bf16 or fp32 weights and compute, under bf16 autocast where
    ``trainer_autocast`` says so (``bf16-mixed``: over fp32 weights); over a 4-bit or int8 base
    the other weights are fp32 (``prepare_model_for_kbit_training`` casts them)."""
    itemsize = 4 if plan.precision == "fp32" else 2
    mixed = plan.precision == "bf16-mixed"
    fsdp = runtime == "hf" and plan.dp > 1 and plan.zero >= 2  # bf16=True is FSDP2's policy, not autocast
    return Dims.of(
        model,
        workload,
        cd=itemsize,
        pd=4 if mixed or plan.quant != "none" else itemsize,
        autocast=trainer_autocast(plan, runtime) and not fsdp,
        recompute=plan.recompute,
    )


def hf_kernel(model, plan, device: str, runtime: str = "hf") -> str:
    """The SDPA kernel the run models: CPU's flash, or on CUDA the bundled trainer's rule
    (``support.sdpa_kernel``: flash in 16-bit, as its traces show; math for fp32 with GQA, and over
    a 4-bit base's fp32 stream; the memory-efficient kernel, ``efficient``, fp32 without GQA:
    ``mem_efficient.py``, followed on compute capability 8.0 / 9.0, ``hf_support``) unless ``bf16=True``'s
    autocast hands SDPA bf16 inputs (flash). Gemma 2 runs no
    SDPA (eager attention, ``hf_families.HfGemma2``), nor does a plan under ``attention: eager`` (``hf_eager.py``):
    ``eager`` on CUDA; MLA (DeepSeek-V2 / V3) the
    memory-efficient kernel, ``efficient`` (``hf_mla.HfDeepseekV3.mla_sdpa``)."""
    if device == "cpu":
        return "cpu_flash"
    if model.architecture == "gemma2" or plan.attention == "eager":  # no SDPA (hf_eager.py)
        return "eager"
    if model.mla is not None:  # q/k and v heads of two widths: flash declines (hf_support.mla_cuda_ok)
        return "efficient"
    if trainer_autocast(plan, runtime):  # autocast casts SDPA's inputs to bf16 (its fp16/bf16 op list): flash
        return "flash"
    from memplan.costmodel.timeline.support import sdpa_kernel

    return sdpa_kernel(model, plan)


def hf_plan_run(
    model, workload, plan, gpu_arch=None, device: str = "cuda", steps: int = 3, repeated: bool = False
) -> Timeline:
    """The run on ``device`` of an ``hf`` plan ``hf_support.hf_supported`` accepts: a first step and
    two steady ones, the data never running dry (``gpu_arch``: the GPU's, a 4-bit base's kernel); with
    fewer ``steps``, the first of them, event for event (the data of three steps: ``fast_run.run_peak_bound``);
    ``repeated``: the last step emitted from the one before where that is exact (``hf_repeat.py``)."""
    from memplan.costmodel.timeline.hf_support import accumulation

    kernel = hf_kernel(model, plan, device)
    assert kernel is not None
    d = hf_dims(model, workload, plan)
    experts = model.moe.num_experts if model.moe else 0
    lora = HfLoraConfig.of(plan, model.architecture, experts)
    quant = Bnb4bit.of(plan, gpu_arch) or Bnb8bit.of(plan, model)
    mixed = trainer_autocast(plan, "hf")  # under FSDP2: accelerate's MixedPrecisionPolicy (hf_fsdp.py)
    ga, arch, extra = accumulation(workload, plan), model.architecture, family_config(model, gpu_arch, plan.attention)
    return hf_run(
        d,
        model.tied_embeddings,
        kernel,
        steps=steps,
        batches=3 * ga + 1,  # hf_run's default for three steps, whatever ``steps``
        qkv_bias=model.qkv_bias,
        ga=ga,
        arch=arch,
        extra=extra,
        lora=lora,
        quant=quant,
        dp=plan.dp,
        build=plan.model_build,
        zero=plan.zero,
        mixed=mixed,
        # accelerate skips cpu_ram_efficient_loading for a model with Params4bit (fsdp_utils.py:830): a 4-bit
        # base is quantized on the GPU and sharded there (hf_fsdp_qlora.py)
        host_load=plan.model_build == "to_device" and plan.dp > 1 and plan.zero >= 2 and not isinstance(quant, Bnb4bit),
        offload=plan.offload_activations == "cpu",  # TRL's hooks around training_step (hf_offload.py)
        optimizer=plan.optimizer,
        repeated=repeated,
        reentrant=checkpoint_reentrant(plan, "hf"),
    )


def hf_run(
    d: Dims,
    tied: bool,
    kernel: str,
    steps: int = 3,
    batches: int | None = None,
    qkv_bias: bool = False,
    ga: int = 1,
    arch: str = "llama",
    extra: dict | None = None,
    lora: HfLoraConfig | None = None,
    quant: Bnb4bit | Bnb8bit | None = None,
    dp: int = 1,
    build: str = "to_device",
    zero: int = 0,
    mixed: bool = False,
    host_load: bool = False,
    offload: bool = False,
    optimizer: str = "adamw",
    repeated: bool = False,
    reentrant: bool = False,
    **tape_flags,
) -> Timeline:
    """``Trainer.train()`` for ``steps`` optimizer steps of ``ga`` micro-batches each over
    ``batches`` batches (None: enough that the prefetch never runs dry); ``qkv_bias``: Qwen2's
    attention biases; ``arch``: the family (``hf_families.py``) and ``extra`` its further
    config (``hf_families.family_config``); ``lora``: PEFT's adapters over the frozen base
    (``hf_lora.py``); ``quant``: a 4-bit or int8 base (``hf_bnb.py``); ``dp``: ranks under DDP (``hf_ddp.py``);
    ``build``: how the model was built (``hf_build.BUILDS``; the CPU runs count from a built model);
    ``zero``: over ``dp`` ranks, 2 or 3 for accelerate's FSDP2 (``hf_fsdp.py``; 3: ``full_shard``), 0 DDP;
    ``mixed``: under FSDP2, ``bf16=True`` (its mixed-precision policy over fp32 master shards);
    ``host_load``: under FSDP2, the model loaded on the CPU and sharded by ``cpu_ram_efficient_loading``
    (``hf_fsdp_load.py``: on CUDA the build puts one full parameter at a time on the GPU); ``offload``:
    TRL's activation offload around each ``training_step`` (``hf_offload.py``); ``optimizer``: the plan's
    (``specs.plan.OptimizerName``), as the Trainer builds it (``hf_optimizers.trainer_optimizer``);
    ``repeated``: the last step emitted from the one before where that is exact (``hf_repeat.py``).
    ``reentrant``: under checkpointing, ``gradient_checkpointing_kwargs={"use_reentrant": True}`` (``reentrant.py``).
    ``tape_flags`` set :class:`Tape` attributes (``reduce_workspace``, ``inplace_accumulate``)."""
    total = steps * ga + 1 if batches is None else batches
    args = (d, tied, kernel, total, tape_flags, qkv_bias, ga, arch, extra, lora, quant, dp, build, zero, mixed)
    repeated = repeated and repeats(dp, zero, lora, quant, offload, optimizer, reentrant)
    optimizer = trainer_optimizer(optimizer, cuda=kernel != "cpu_flash")
    run = _HfRun(*args, host_load=host_load, optimizer=optimizer, reentrant=reentrant)
    run.saves = TrlOffload() if offload else None
    run.b.mark("build")
    span = None  # the last step built, from the second on: the one the last may be emitted from (hf_repeat.py)
    for k in range(steps):
        start = run.b.position()
        if not (repeated and span is not None and k == steps - 1 and repeat_step(run.b, *span, ga)):
            run.step(k)
        span = (start, run.b.position()) if k >= 1 else None
        run.b.mark(f"step{k}")
    managed = getattr(run.optimizer, "managed", 0)  # bitsandbytes' paged states (hf_bnb_optim.py)
    return run.b.build(run.saves.host_peak if run.saves is not None else 0, managed=managed)


class _HfRun:
    def __init__(
        self,
        d: Dims,
        tied: bool,
        kernel: str,
        batches: int,
        tape_flags: dict,
        qkv_bias: bool,
        ga: int,
        arch: str = "llama",
        extra: dict | None = None,
        lora: HfLoraConfig | None = None,
        quant: Bnb4bit | None = None,
        dp: int = 1,
        build: str = "to_device",
        zero: int = 0,
        mixed: bool = False,
        host_load: bool = False,
        optimizer=None,
        reentrant: bool = False,
    ) -> None:
        self.b = Builder()
        self.tape = Tape(self.b)
        self.tape.reduce_workspace = kernel != "cpu_flash"  # CUDA's staging buffer (autograd.py)
        for key, value in tape_flags.items():
            setattr(self.tape, key, value)
        self.d, self.batches = d, batches
        model_class, layer_params = family(arch, eager="eager_masks" in (extra or {}))  # hf_eager.py
        layers = moe_layer_params(arch, layer_params, extra)  # a MoE model's dense layers (hf_moe.py)
        self.shapes = param_shapes(d, tied, qkv_bias, layers, moe_sizes(extra, d.h))
        self.grads: dict[str, Tensor] = {}
        self.model = model_class(self.tape, d, {}, kernel, tied, quant=quant)
        self.model.extra = extra
        self.data: list[list[Tensor]] = []
        self.fetched = 0
        self.ga = ga
        self.num_items: Tensor | None = None
        self.items: Tensor | None = None  # the forward's ``num_items_in_batch`` kwarg (cast under FSDP2's bf16 policy)
        self.prev_loss: Tensor | None = None
        self.total_norm: Tensor | None = None
        self.optimizer = optimizer if optimizer is not None else FusedAdamW()  # hf_optimizers.py, hf_bnb_optim.py
        self.states: list[Tensor] = []  # the hand loop's own AdamW(foreach=True) keeps its states here (hf_loop.py)
        self.lora = None
        if lora is not None:
            cuda, ckpt = kernel != "cpu_flash", d.recompute == "full"
            self.lora = HfLora(self.tape, lora, d.tokens, cuda, input_grad=ckpt)
            self.model.adapter = self.lora.adapt
            self.model.tied = tied and "lm_head" not in lora.modules_to_save  # the trained copy is untied
        self.dp, self.build, self.zero, self.mixed = dp, build, zero, mixed
        self.ddp: HfDdp | None = None  # DDP over dp > 1 ranks (hf_ddp.py), wrapped in _build
        self.fsdp: hf_fsdp.HfFsdp | None = None  # FSDP2 over dp > 1 ranks under ZeRO-2/3 (hf_fsdp.py)
        self.host_load = host_load and dp > 1 and zero >= 2  # under FSDP2, loaded on the CPU (hf_fsdp_load.py)
        self.saves = None  # activation offload's saved-tensor hooks (hf_offload.py; hf_loop.py: act_offload's)
        # use_reentrant=True's checkpoints (reentrant.py); known before DDP's wrap, whose find_unused_parameters
        # they decide (hf_ddp.wrap)
        self.reentrant = Reentrant(self.tape, self._inner_graph) if reentrant and d.recompute == "full" else None
        self._build()

    def _build(self) -> None:
        """Parameters in ``model.parameters()`` order, the two rotary buffers (on CUDA a model loaded on
        the CPU for FSDP2 is made on the host, its tensors holding no device bytes, until
        ``hf_fsdp_load.load`` shards it), DDP's wrapping or FSDP2's sharding (``accelerator.prepare``,
        over ``self.dp`` > 1 ranks), ``tr_loss``."""
        real = self.tape.b
        if self.host_load and self.model.kernel != "cpu_flash":
            self.tape.b = _Host(real)  # type: ignore[assignment]
        try:
            self._params()
        finally:
            self.tape.b = real
        if self.dp > 1 and self.zero >= 2:
            self._shard()
        elif self.dp > 1:
            buffers = [self.model.weights[name] for name, _ in self.model.buffers()]
            cuda, ckpt = self.model.kernel != "cpu_flash", self.d.recompute == "full"
            peft, reentrant = self.lora is not None, self.reentrant is not None
            args = (self.model.weights, self.shapes, self.trainable, buffers, peft, ckpt, cuda, reentrant)
            self.ddp = hf_ddp.wrap(self.tape, self.dp, *args)
        self.optimizer.create(self.tape)  # create_optimizer, before the loop's tr_loss
        self.tape.managed(1, 4, "tr_loss", Category.LOGITS)

    def _shard(self) -> None:
        """``accelerator.prepare`` under FSDP2 (``hf_fsdp.py``): the optimizer, made before it, then
        steps the local shards."""
        cuda, reshard = self.model.kernel != "cpu_flash", self.zero >= 3
        shapes, frozen = self.shapes, frozenset()
        if self.lora is not None:  # the adapters (and trained copies) beside the frozen base
            shapes, frozen = hf_fsdp_peft.peft_params(self.shapes, self.lora, self.model.weights)
        quant, extra = self.model.quant, {}
        if isinstance(quant, Bnb4bit):  # the packed weights sharded in their storage dtype (hf_fsdp_qlora.py)
            shapes, extra = hf_fsdp_qlora.packed_shapes(shapes, quant), dict(quant=quant, full=shapes)
        args = (self.d, self.dp, shapes, self.model, self.grads, reshard, self.model.tied, cuda, self.mixed, frozen)
        kind = hf_fsdp.HfFsdp if self.lora is None else hf_fsdp_peft.HfFsdpPeft  # the adapters' own dtype
        kind = hf_fsdp_qlora.HfFsdpQlora if extra else kind
        fsdp = kind(self.tape, *args, host=self.host_load, **extra)
        fsdp.build(self.model.weights, self._optimizer_order())
        self.trainable = fsdp.shard_numels()
        if self.lora is not None and self.mixed:  # the adapters all-gathered in bf16 too (hf_fsdp.py)
            self.lora.read_bytes = fsdp.d.cd
        self.fsdp = fsdp

    def _params(self) -> None:
        """The base's weights as ``self.build`` allocates them (``hf_build.py``), then a PEFT model's
        adapters, the two rotary buffers."""
        t, d = self.tape, self.d
        quant = self.model.quant
        if self.build == "from_pretrained":
            loaded = quant.stored if isinstance(quant, Bnb4bit) else d.cd if quant is not None else d.pd
            self.model.weights.update(hf_build.from_pretrained(t, self.shapes, loaded, quant, self._param))
        else:
            for name, (rows, cols) in self.shapes.items():
                if quant is not None and quant.quantized(name.removesuffix(".weight")):
                    self.model.weights[name] = quant.build(t, name, rows, cols)
                else:
                    self.model.weights[name] = self._param(name, rows * cols, d.pd)
        if self.lora is None:
            self.trainable = {name: (rows * cols, d.pd) for name, (rows, cols) in self.shapes.items()}
        else:
            self.lora.build(self.model.weights, self.shapes, self.grads, d.pd)
            self.trainable = self.lora.trainable
        for name, numel in self.model.buffers():
            self.model.weights[name] = t.managed(numel, self.model.buffer_bytes(name, d.pd), name, Category.PARAMETERS)

    def _param(self, name: str, numel: int, itemsize: int) -> Tensor:
        """A base parameter on the device (its gradient's leaf unless ``get_peft_model`` froze it), in
        ``itemsize`` bytes, but a 4-bit linear's bias (Qwen2's q, k, v) in the compute dtype:
        ``Linear4bit.forward`` recasts it in place at the first call (``bias.data =
        bias.data.to(x.dtype)`` after ``x.to(self.compute_dtype)``, bitsandbytes 0.50
        ``nn/modules.py``), so from the first forward on it is stored so (the fp32 one of the build,
        ``prepare_model_for_kbit_training``'s, goes then)."""
        module, quant = name.removesuffix(".bias"), self.model.quant
        if name.endswith(".bias") and isinstance(quant, Bnb4bit) and quant.quantized(module):
            itemsize = quant.compute
        p = self.tape.managed(numel, itemsize, name, Category.PARAMETERS)
        if self.lora is None:
            p.fn = ops.leaf(self.grads, name)
        return p

    def _workspace(self, thread: str):
        """cuBLAS's workspace, allocated at a thread's first matmul and never freed (``trainer.py``)."""

        def allocate() -> None:
            self.tape.on_first_mm = None
            self.b.alloc(CUBLAS_WORKSPACE, Category.ACTIVATIONS, f"cublas_workspace.{thread}")

        return allocate

    # --- the data ------------------------------------------------------------------------------
    def _fetch_until(self, n: int) -> None:
        """Batches fetched up to ``n`` in all (the dataset's ``self.batches`` at most)."""
        t, d = self.tape, self.d
        while self.fetched < min(n, self.batches):
            with t.scoped(f"batch{self.fetched}"):
                self.data.append([t.new(d.tokens, 8, "input_ids"), t.new(d.tokens, 8, "labels")])
            self.fetched += 1

    def _count_items(self) -> None:
        """``sum(batch["labels"][..., 1:].ne(-100).sum() for batch in batch_samples)`` and its
        division, over the update's ``ga`` batches."""
        t, d = self.tape, self.d
        with t.scoped("num_items_in_batch"):
            acc = None
            for _ in range(self.ga):
                ne = t.new(d.b * (d.s - 1), 1, "ne")
                total = t.new(1, 8, "sum")
                t.done(ne)
                acc, old = t.new(1, 8, "add"), acc
                t.done(old, total)
            ranks = self.ddp or self.fsdp
            if ranks is not None:
                acc, old = ranks.gather_count(acc), acc
                t.done(old)
            out = t.new(1, 4, "div")
            t.done(acc, self.num_items)
        self.num_items = out

    # --- one optimizer step ----------------------------------------------------------------------
    def step(self, k: int) -> None:
        """``get_batch_samples`` (the update's ``ga`` batches; accelerate keeps one more fetched),
        ``ga`` training steps, then clip, the optimizer and ``zero_grad``."""
        t, ga = self.tape, self.ga
        self.b.mark("phase:forward")  # the meter's phases (timeline.phases), as the bundled trainer's
        self._fetch_until((k + 1) * ga + 1)
        self._count_items()
        if k > 0:
            for batch in self.data[:ga]:
                t.done(*batch)
            self.data = self.data[ga:]
        for i in range(ga):
            ranks = self.ddp or self.fsdp
            if ranks is not None:  # the Trainer's sync_context: no_sync() but for the last
                ranks.sync = i == ga - 1
            self.training_step(self.data[i][0], first=k == 0 and i == 0)
        self.b.mark("phase:optimizer")
        self.clip()
        self.optimizer_step(first=k == 0)
        if self.fsdp is not None:  # the sharded gradients, group by group
            self.fsdp.zero_grad()
        for name in self.trainable:
            t.drop(self.grads.pop(name, None))
        self.b.mark("phase:end")

    def training_step(self, ids: Tensor, first: bool) -> None:
        """``compute_loss`` (keeping the loss alone), ``accelerator.backward``, the loss checks;
        from the second micro-batch on ``AccumulateGrad`` adds each gradient into ``.grad``."""
        t = self.tape
        if isinstance(self.saves, TrlOffload):  # TRL's __enter__: its tracker cleared
            self.saves.begin_step(t)
        self.b.mark("phase:forward")
        cuda = self.model.kernel != "cpu_flash"
        if cuda and first:
            t.on_first_mm = self._workspace("forward")
        m = self.model
        m.cache = {} if self.d.autocast else None
        if self.ddp is not None:
            self.ddp.pre_forward()
        items = self.num_items if self.fsdp is None else self.fsdp.cast_inputs(self.num_items)
        self.items = items
        with act_offload.saving(t, self.saves):
            logits, hidden = self.forward(ids)
            loss = m.loss(logits, items)
        t.done(hidden)  # LlamaForCausalLM.forward's hidden_states, at its return
        if self.fsdp is not None:  # the root's post-forward (its policy's output_dtype cast first)
            loss = self.fsdp.end_root_forward(loss)
            t.done(items)  # the forward's kwargs (a cast count lives on in the loss's division)
        if m.cache is not None:  # accelerate's autocast exits, then its convert_outputs_to_fp32
            t.done(*m.cache.values())
            m.cache = None
            with t.scoped("accelerate"):
                converted = t.new(logits.numel, 4, "logits_to_fp32", Category.LOGITS)
            t.done(logits)
            logits = converted
        if self.ddp is not None:
            loss, logits = self.ddp.post_forward([loss, logits])
        t.done(logits)  # compute_loss returns the loss alone
        self.b.mark("phase:backward")  # accelerator.backward: the division by ga, then backward
        with t.scoped("accelerate"):
            scaled = scalar_div(t, loss, "div_accumulation", temps=0)
            seed = t.new(1, scaled.itemsize, "grad_seed")
        if cuda and first:
            t.on_first_mm = self._workspace("backward")
        # TRL's hooks are on through the backward too (around ``training_step``): a reentrant re-run saves under them
        with act_offload.saving(t, self.saves):
            t.backward(scaled, t.hold(seed))  # torch.autograd.backward holds it until it returns
        t.scope = ""
        if self.fsdp is not None:  # the root's final callback, inside the backward
            self.fsdp.finish_backward()
        if self.ddp is not None:
            self.ddp.backward_done(self.grads)
        t.done(seed, scaled)
        if isinstance(self.saves, TrlOffload):  # TRL's curr_autograd_node keeps what it reaches of the graph
            reached = self.saves.reached()
            if isinstance(self.model.quant, Bnb8bit) and self.model.quant.int8 is not None:
                self.saves.hold_graph(self.model.quant.int8.keep_reachable(reached))
            if self.lora is not None:
                self.saves.hold_graph(self.lora.keep_reachable(reached))
        if isinstance(self.model.quant, Bnb8bit):  # the int8 linears' ctx.A go with the graph
            self.model.quant.free_graph()
        if self.reentrant is not None:  # the checkpoints' ctx.run_function too
            self.reentrant.free_graph()
        if self.lora is not None:
            self.lora.free_graph()
        if self.saves is not None:  # TRL's end-of-backward callback, as training_step returns
            self.saves.end_of_step(t)
        t.done(self.prev_loss)
        self.prev_loss = loss
        for check in ("isnan", "isinf"):
            t.done(t.new(1, 1, check))

    def forward(self, ids: Tensor) -> Tensor:
        """``LlamaForCausalLM.forward`` up to the logits."""
        t, m, d, fsdp = self.tape, self.model, self.d, self.fsdp
        if fsdp:
            fsdp.pre_forward(0)
        emb = m.embed(ids)
        if self.lora is not None:
            self.lora.require_input_grad(emb)
        if fsdp:
            fsdp.post_forward(0, emb)
        pos = m.positions()
        cos, sin = m.rope_tables(emb)
        x = t.alias(emb)
        for i in range(d.layers):
            xi = fsdp.pre_forward(i + 1, x) if fsdp else t.alias(x)
            out = self._layer(xi, pos, cos, sin, i)
            t.done(xi)
            if fsdp:
                fsdp.post_forward(i + 1, out)
            t.done(x)
            x = out
        xi = fsdp.pre_forward(d.layers + 1, x) if fsdp else t.alias(x)
        n = m.rms_norm(xi, "model.norm")
        t.done(xi, x)
        t.done(pos, emb, cos, sin)  # LlamaModel.forward's locals
        with in_head(self.saves):
            logits = m.head(n)
        if fsdp:
            fsdp.post_forward(d.layers + 1, logits)
        return logits, n

    def _layer(self, x: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """A decoder layer, or a non-reentrant checkpoint of one (its recompute runs under a fresh
        autocast context: its own weight casts)."""
        m = self.model
        cos, sin = m.tables_for(i, cos, sin)
        if self.d.recompute != "full":
            return m.layer(x, cos, sin, i)

        def rerun(x: Tensor, _pos: Tensor, cos: Tensor, sin: Tensor, *_masks: Tensor) -> None:  # the frame's inputs
            cache, m.cache = m.cache, ({} if self.d.autocast else None)
            try:
                m.layer(x, cos, sin, i)
            finally:
                m.cache = cache

        # the layer's arguments, held by the checkpoint; its ``**kwargs`` too (``GradientCheckpointingLayer``
        # checkpoints ``partial(forward, self, **kwargs)``, transformers modeling_layers.py:120): the model's
        # ``num_items_in_batch``, under FSDP2's bf16 policy the root's bf16 cast of it (alive to layer 0's backward)
        kwargs = [self.items] if self.items is not None else []
        if self.reentrant is not None:  # use_reentrant=True (reentrant.py): the partial's tensors kept with the graph
            # transformers checkpoints the layer's ``forward``, not ``__call__`` (modeling_layers.py:84): FSDP2's hooks
            # stay outside the checkpoint, around it as around a non-reentrant one (hf_fsdp.py)
            return self.reentrant.checkpoint(
                lambda: m.layer(x, cos, sin, i),
                [x],
                [pos, cos, sin, *m.layer_inputs(i), *kwargs],
                self._rerun(i, cos, sin),
            )
        held = [x, pos, cos, sin, *m.layer_inputs(i), *kwargs]
        # the hidden states alone are positional (``decoder_layer(hidden_states, **kwargs)``): saved-tensor
        # hooks (activation offload, hf_loop.py) pack them; the rest the partial holds on the device
        return self.tape.checkpoint(lambda: m.layer(x, cos, sin, i), held, rerun=rerun, packed=1)

    def _rerun(self, i: int, cos: Tensor, sin: Tensor):
        """A reentrant checkpoint's re-run of layer ``i`` (``CheckpointFunction.backward``): under the forward's
        autocast state, a fresh cache whose casts go as its block exits (what the graph saved stays)."""
        m, t = self.model, self.tape

        def rerun(x: Tensor) -> Tensor:
            cache, m.cache = m.cache, ({} if self.d.autocast else None)
            try:
                return m.layer(x, cos, sin, i)
            finally:
                if m.cache is not None:
                    t.done(*m.cache.values())
                m.cache = cache

        return rerun

    def _inner_graph(self):
        """Before a reentrant re-run: the int8 linears' ``ctx.A`` it makes are its graph's (freed as
        ``CheckpointFunction.backward`` returns), not the step's."""
        quant = self.model.quant
        int8 = quant.int8 if isinstance(quant, Bnb8bit) else None
        if int8 is None:
            return lambda: None
        outer, int8.held = (int8.held, int8.owners), []
        int8.owners = []

        def free() -> None:
            inner = int8.held
            int8.held, int8.owners = outer
            for x in reversed(inner):
                self.tape.drop(x)

        return free

    # --- clip, optimizer -----------------------------------------------------------------------
    def clip(self) -> None:
        """``clip_grad_norm_(params, 1.0)`` (foreach): a norm per gradient, their stack, the total
        (kept: the Trainer logs it), ``max_norm / (total + 1e-6)`` clamped to 1; each norm a scalar
        of its gradient's dtype, the stack and after of the widest (``torch.stack``'s type promotion:
        a bf16 ``modules_to_save`` copy beside fp32 adapters gives fp32)."""
        t = self.tape
        sizes = [itemsize for _, itemsize in self.trainable.values()]
        g = max(sizes)
        with t.scoped("clip_grad_norm"):
            t.done(self.total_norm)
            n = len(self.grads) if self.fsdp is None else len(self.trainable)
            sizes = sizes if len(sizes) == n else [g] * n
            norms = [t.new(1, size, "foreach_norm") for size in sizes]
            stack = t.new(n, g, "stack")
            self.total_norm = t.new(1, g, "total_norm")
            t.done(stack, *reversed(norms))
            add, recip = t.new(1, g, "add_eps"), t.new(1, g, "reciprocal")
            coef = t.new(1, g, "clip_coef")
            t.done(recip, add)
            clamped = t.new(1, g, "clamp")
            t.done(coef, clamped)

    def optimizer_step(self, first: bool) -> None:
        """The optimizer's ``step()`` over its groups (``hf_optimizers.py``; the states on the first)."""
        if first:
            self.tape.scope = ""
        self.optimizer.step(self.tape, self._optimizer_params(), self.grads, first)

    def _optimizer_params(self) -> list[Param]:
        """The trained parameters in the optimizer's order, each with its shape (``hf_optimizers.Param``):
        the base's from ``self.shapes`` (a ``(rows, 1)`` entry is a vector), an adapter's from its base
        linear's (``lora_A`` r x in, ``lora_B`` out x r; over 3-D experts PEFT's ``ParamWrapper`` adapters are
        2-D, r x E rows by the expert's in, the expert's out by r x E columns), a trained copy of the head the
        embedding's; an MoE block's experts 3-D, E in front (``hf_moe.MoeBlock``: stored here as (E x rows,
        cols)). Under FSDP2 a shard's numel (only optimizers that read no shape run over shards:
        ``hf_support._optimizer_ok``)."""
        out = []
        embed = self.shapes["model.embed_tokens.weight"]
        experts = (self.model.extra or {}).get("experts", 1)
        for name in self._optimizer_order():
            numel, itemsize = self.trainable[name]
            base = name.replace(".lora_A.", ".").replace(".lora_B.", ".")
            rows, cols = self.shapes.get(base, embed)
            expert = ".mlp.experts." in name
            if name.endswith(".lora_magnitude_vector.weight"):  # DoRA's magnitude: a vector (hf_dora.py)
                rows, cols = numel, 1
            elif ".lora_A." in name:
                rows = numel // cols
            elif ".lora_B." in name:  # over an expert stack: one expert's out x (r x E) (hf_moe_lora.py)
                rows = rows // experts if expert else rows
                cols = numel // rows
            cols = 0 if cols == 1 or rows * cols != numel else cols
            lead = experts if expert and cols and base == name else 1  # PEFT's ParamWrapper adapters are 2-D
            out.append(Param(name, numel, itemsize, rows, cols, name == "model.embed_tokens.weight", lead))
        return out

    def _optimizer_order(self) -> list[str]:
        """The trained parameters in the optimizer's order: the decay group, then the no-decay one."""
        return [n for n in self.trainable if not is_norm(n)] + [n for n in self.trainable if is_norm(n)]


class _Host:
    """A builder whose tensors live on the host: each gets an id and no device bytes (``Builder.alloc``
    records nothing for an empty tensor), so freeing one later records nothing either."""

    def __init__(self, device: Builder) -> None:
        self.device = device

    def alloc(self, size: int, category: Category, tag: str, stream=None) -> int:  # noqa: ANN001, ARG002
        return self.device.alloc(0, category, tag)

    def free(self, tensor: int) -> None:
        self.device.free(tensor)
