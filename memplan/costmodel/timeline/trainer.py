"""The bundled trainer's run (``memplan validate``, ``--runtime memplan``) as a timeline.

``trainer_run`` replays what one rank of ``memplan/train/runner.py`` allocates, tensor by
tensor, in the order the CUDA caching allocator sees it (checked against the six traces in
tests/data/gpu-traces): the model built off the meta device, a warm-up step, then steady
steps. Each step: the batch, the forward (``trainer_model.py``, op by op), the loss, the
backward (the autograd engine of ``autograd.py``), ``optimizer.step()`` (foreach AdamW) and
``zero_grad(set_to_none=True)``. Under ZeRO-3 and ZeRO-2 the FSDP2 groups (``fsdp.py``) all-gather
and reduce-scatter on their own streams; under ZeRO-0 over dp > 1 DDP's reducer (``ddp.py``) takes
the gradients into its buckets. Under LoRA (``lora.py``) the base is frozen: the
adapters alone have grads and AdamW states. The first step also allocates cuBLAS's two workspaces
(32 MiB each, the forward thread's and the autograd thread's, never freed) and, in its
optimizer step, AdamW's states; without those, it is the steady step (:func:`steps` derives the
first steady step from its events, ``repeat.derive``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from memplan.costmodel.timeline import act_offload, ops, recompute
from memplan.costmodel.timeline import tensor_parallel as tpar
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Builder, Category, Stream, Timeline
from memplan.costmodel.timeline.fsdp import Fsdp
from memplan.costmodel.timeline.layer_repeat import WORKSPACE_TEMPLATE, LayerRepeat, NotRepeatable, span
from memplan.costmodel.timeline.master import MasterAdamW
from memplan.costmodel.timeline.repeat import Position, Span, derive, repeat
from memplan.costmodel.timeline.support import accumulation, sdpa_kernel, supported
from memplan.costmodel.timeline.trainer_model import Dims, Model, param_shapes
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload

if TYPE_CHECKING:  # the mechanisms a plan may not use are imported where a run uses them (a cold estimate's cost)
    from memplan.costmodel.quant import CudaArch
    from memplan.costmodel.timeline.lora import LoraConfig
    from memplan.costmodel.timeline.pipeline import Pipeline

CUBLAS_WORKSPACE = 32 * 2**20  # per thread and stream (CUBLAS_WORKSPACE_CONFIG default on Hopper)
# Micro-batches of a step the run follows. The first creates the gradients; every later one starts
# from the same live set (every gradient held, no activation) and makes the same requests as the
# second. The peaks, allocated and reserved, of 2 to 6 micro-batches were equal on a 1B
# selective-op plan, an 8B ZeRO-3 one and an 8B TP 2 + SP ZeRO-3 one, both allocators
# (test_timeline_recompute.py holds two); more are not run (each costs a forward and backward).
MICRO_BATCHES_MODELLED = 2


def dims(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> Dims:
    """The shapes and dtypes one rank computes with (``parallel.compute_dtype``/``param_dtype``)."""
    fsdp = plan.dp > 1 and plan.zero >= 2
    return Dims.of(
        model,
        workload,
        tp=plan.tp,
        sp=plan.sequence_parallel,
        cd=4 if plan.precision == "fp32" else 2,
        pd=2 if plan.precision in ("bf16", "bf16-master") else 4,
        autocast=plan.precision == "bf16-mixed" and not fsdp,
        recompute=plan.recompute,
        attention=_attention(model, plan),
        recompute_layers=plan.recompute_layers,
    )


def _attention(model: ModelSpec, plan: Plan) -> str:
    """The attention the trainer runs: eager (``eager.py``), or SDPA's kernel (flash, math, or
    fp32's memory-efficient one: ``mem_efficient.py``), or memplan's Triton kernel (``triton_attention.py``)."""
    if plan.attention in ("eager", "triton"):
        return plan.attention
    kernel = sdpa_kernel(model, plan)
    return kernel if kernel in ("math", "efficient") else "flash"


def trainer_run(
    model: ModelSpec,
    workload: TrainingWorkload,
    plan: Plan,
    steady_steps: int = 2,
    max_micro_batches: int = MICRO_BATCHES_MODELLED,
    stage: int | None = None,
    cuda: bool = True,
    gpu_arch: CudaArch | None = None,
    inplace_accumulate: bool = True,
    cpu_sdpa: bool = False,
    repeated: bool = True,
    zero1_shard: list[tuple[str, int]] | None = None,
) -> Timeline | None:
    """The bundled trainer's run on one rank: build, a warm-up step, ``steady_steps`` steps,
    each of at most ``max_micro_batches`` micro-batches (under pipelining all of them). Pipeline
    rank ``stage``, by default the most-loaded one (``Timeline.stage`` says which); ``cuda``:
    CUDA's kernels, else CPU's where the run models both (LoRA's dropout); ``gpu_arch``: the
    GPU's SMs and compute capability (``quant.cuda_arch``: a 4-bit base's kernel);
    ``inplace_accumulate`` False: every second gradient summed out of place, as on CPU under the
    meter (:class:`Tape`; a tied embedding's sum, docs/cost-model.md); ``cpu_sdpa``: SDPA on CPU's
    flash kernel in every dtype, as ``scaled_dot_product_attention`` runs on CPU (the run's flash
    op, whose CUDA-only copies ``timeline.cpu`` leaves out), not CUDA's fp32 math or
    memory-efficient kernel; ``repeated`` False: every steady step built op by op (:func:`steps`), and every
    layer (else the middle ones are emitted from a built layer's events where they pair: ``layer_repeat.py``);
    ``zero1_shard``: under ZeRO-1 the (name, elements) the rank's optimizer steps, in its order
    (default: the most-loaded rank's partition of this model's, ``zero1.shard``; the search's cut
    runs carry the whole model's, ``fast_run``). None for a plan :func:`supported` rejects."""
    if supported(model, workload, plan, gpu_arch) is not None:
        return None
    offload, master = plan.offload_params == "cpu", plan.precision == "bf16-master"
    master = master and (plan.finetune == "full" or bool(plan.modules_to_save))  # build_optimizer_from
    micro_batches = min(accumulation(workload, plan), max_micro_batches)
    d, pipe = dims(model, workload, plan), None
    if cpu_sdpa and d.attention in ("math", "efficient"):
        d = replace(d, attention="flash")
    if plan.pp > 1:  # the schedule runs every micro-batch (pipeline.py)
        from memplan.costmodel.timeline import pipeline

        stage = most_loaded_stage(model, workload, plan, "cuda" if cuda else "cpu") if stage is None else stage
        micro_batches, pipe = accumulation(workload, plan), pipeline.factory(d, plan, stage)
    lora = None
    if plan.finetune != "full":  # adapters (lora.config: none for full training)
        from memplan.costmodel.timeline.lora import config as lora_config

        lora = lora_config(plan, cuda, gpu_arch)

    def build(layers: bool) -> Timeline:
        run = _Run(d, plan.dp, model.tied_embeddings, plan.zero, offload, master, micro_batches, pipe=pipe, lora=lora)
        run.tape.inplace_accumulate = inplace_accumulate
        run.zero1_shard = zero1_shard
        if plan.offload_activations == "cpu":  # save_on_cpu around the forward and the loss
            run.saves = act_offload.SaveOnCpu()
        if layers and repeated:
            run.layers = run.layer_repeat()
        run.b.mark("build")
        steps(run.b, run.step, steady_steps, repeated, run.derive_step)
        return run.b.build(run.saves.host_peak if run.saves is not None else 0, stage or 0)

    try:
        return build(layers=True)
    except NotRepeatable:  # the middle layers' events do not pair: every layer op by op
        return build(layers=False)


def steps(
    b: Builder,
    step: Callable[[bool], None],
    steady_steps: int,
    repeated: bool = True,
    derived: Callable[[Position, Position], bool] | None = None,
) -> None:
    """The warm-up step and ``steady_steps`` steps, each closed by its ``step{k}`` mark. With
    ``repeated``, the first steady step is the warm-up step's events without what only a first step
    makes, where ``derived`` (``_Run.derive_step``) can derive it (``repeat.derive``), and each later
    one the one before emitted again from its events (``repeat.py``: the same requests, renumbered);
    else each is built op by op. A step derived or repeated leaves the run's Python state (the
    tape's tensors) at the step before: no step is built after one."""
    span, repeating = None, False
    for k in range(steady_steps + 1):
        start = b.position()
        if repeated and span is not None and (repeat(b, *span) if k > 1 else derived is not None and derived(*span)):
            repeating = True
        else:
            assert not repeating, "a step built after a repeated one would start from stale state"
            step(k == 0)
        span = (start, b.position())
        b.mark(f"step{k}")


def most_loaded_stage(model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str = "cuda") -> int:
    """The pipeline rank the run follows: 0 without a pipeline, else the most loaded by the runs
    (``stages.run_stage``: every stage's run on ``device``'s kernels replayed under the default
    allocator, the highest reserved peak, then allocated, then the lowest stage: the rank
    ``memplan validate`` runs). ``memplan estimate`` picks with the job's allocator and capacity
    (``stages.stage_verdict``: a stage that does not fit first); the search's cut runs take
    :func:`phase_stage`. A plan the op-level run does not model: the phase model's stage."""
    if plan.pp == 1:
        return 0
    if supported(model, workload, plan) is not None:
        return phase_stage(model, workload, plan, device)
    from memplan.costmodel.stages import run_stage  # every stage's run: only when pipelined

    return run_stage(model, workload, plan, device)


def phase_stage(model: ModelSpec, workload: TrainingWorkload, plan: Plan, device: str = "cuda") -> int:
    """The phase model's most-loaded stage (``memory.training_peak``, the bundled trainer's profile
    on ``device``): what the search's cut runs follow (``fast_run._pipeline_peak``: one cut run per
    depth, not one full run per stage). On ``device`` cpu SDPA's CPU kernel (pp4-fp32-4-microbatches,
    tests/validate/trainer_cases.py: CUDA's math path makes stage 0 the most loaded, CPU's flash kernel
    stage 3). Its sums may name another stage than the runs: the 1B Llama of the H200 traces, pp 4
    1F1B, no recompute, bf16, 8 micro-batches of 512 tokens: stage 3 here, stage 0 by the runs
    (5,586 against 5,304 MiB reserved on CUDA; tests/unit/test_pipeline_stage.py)."""
    if plan.pp == 1:
        return 0
    from memplan.costmodel.memory import training_peak  # the phase model, only when pipelined

    return training_peak(model, workload, plan, device=device).stage  # type: ignore[arg-type]


def followed_rank(model: ModelSpec, workload: TrainingWorkload, plan: Plan, stage: int) -> int:
    """The global rank :func:`trainer_run` follows on pipeline rank ``stage``, in the trainer's
    (pp, dp, tp) mesh (``parallel.build_meshes``: stage x dp x tp + data rank x tp): tensor rank
    0, and data rank 0 but under ZeRO-1, where the ranks differ in their optimizer's share alone
    and the run follows the largest (``zero1.most_loaded``) of what the optimizer partitions (under
    LoRA the adapters and a head copy: ``lora.trained_params``), so ``memplan validate`` measures it."""
    data_rank = 0
    if plan.zero == 1 and plan.dp > 1:
        from memplan.costmodel.timeline import zero1

        data_rank = zero1.most_loaded(optimized_params(model, workload, plan), plan.dp)
    return (stage * plan.dp + data_rank) * plan.tp


def optimized_params(model: ModelSpec, workload: TrainingWorkload, plan: Plan) -> list[tuple[str, int]]:
    """(name, elements) of what the optimizer steps, in ``model.parameters()`` order, without a
    run: every parameter, or under LoRA the adapters and a head copy (``lora.trained_params``);
    what ZeRO-1 partitions (``zero1.shard``)."""
    d = dims(model, workload, plan)
    shapes = param_shapes(d, model.tied_embeddings)
    if plan.finetune != "full":
        from memplan.costmodel.timeline.lora import config, trained_params

        return trained_params(config(plan), d, shapes)
    return [(name, rows * cols) for name, (rows, cols) in shapes.items()]


class _Run:
    """One rank: parameters, gradients, optimizer states, and the step."""

    def __init__(
        self,
        d: Dims,
        dp: int,
        tied: bool,
        zero: int = 3,
        offload: bool = False,
        master: bool = False,
        micro_batches: int = 1,
        pipe: Callable[[Tape, dict], Pipeline] | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        self.b = Builder()
        self.tape = Tape(self.b)
        self.d, self.dp, self.micro_batches = d, dp, micro_batches
        self.zero1 = dp > 1 and zero == 1  # ZeroRedundancyOptimizer over DDP (zero1.py)
        self.shapes = param_shapes(d, tied)
        self.grads: dict[str, Tensor] = {}
        self.states: list[int] = []  # AdamW's moments' allocation ids (:meth:`_group_step`)
        self.master = MasterAdamW(self.tape) if master else None  # bf16-master (master.py)
        self.batch: list[Tensor] = []
        self.model = Model(self.tape, d, {})
        self.lora = None
        if lora is not None:
            from memplan.costmodel.timeline.lora import Lora

            self.lora = Lora(self.tape, lora, d.tokens, self.model)
        self.saves: act_offload.SaveOnCpu | None = None  # activation offload's hooks (act_offload.py)
        self.layers: LayerRepeat | None = None  # the middle layers emitted from events (layer_repeat.py)
        self.zero1_shard: list[tuple[str, int]] | None = None  # ZeRO-1's partition, if given (trainer_run)
        self.first_only: list[Span] = []  # what the warm-up step alone makes (:meth:`derive_step`)
        self.carry_at: int | None = None  # where a step frees the batch the step before left
        if self.lora is not None:
            self.model.adapter = self.lora.adapt
        self.quant = None
        if lora is not None and lora.quant is not None:
            from memplan.costmodel.timeline.quant import Quant

            self.quant = Quant(self.tape, lora.quant)
        if self.quant is not None:  # a 4-bit base (quant.py)
            self.model.base = self.quant.linear
        self.int8 = None
        if lora is not None and lora.int8:
            from memplan.costmodel.timeline.int8 import Int8
            from memplan.costmodel.timeline.int8_outliers import RandomInit

            self.int8 = Int8(self.tape, lora.cuda, RandomInit(d.h))  # the trainer's weights are random
        if self.int8 is not None:  # an LLM.int8 base (int8.py)
            self.model.base = self.int8.linear
        sharded = dp > 1 and zero >= 2  # FSDP2, ZeRO-2 keeping the parameters after the forward
        self.pipe = pipe(self.tape, self.grads) if pipe is not None else None  # one pipeline rank's chunks
        self.fsdp = None
        if sharded and self.pipe is not None:  # FSDP2 on each of the rank's chunks
            self.shapes, self.model = self.pipe.sharded(
                lambda shapes, model, grads, first, last: Fsdp(
                    self.tape, model.d, dp, shapes, model, grads, zero >= 3, offload, first, last
                )
            )
            self.fsdp = self.pipe.fsdp
        elif sharded:
            self.fsdp = Fsdp(self.tape, d, dp, self.shapes, self.model, self.grads, zero >= 3, offload, tied=tied)
        self.ddp = None
        if self.pipe is not None and self.fsdp is None:
            self.shapes = self.pipe.build()
        elif self.fsdp is None:
            self._build_params(tied)
        if dp > 1 and not sharded and self.lora is not None:  # the adapters' reducer (lora.py)
            self.ddp = self.lora.ddp(dp, self.shapes, d.pd)
        elif dp > 1 and not sharded:
            from memplan.costmodel.timeline.ddp import Ddp

            self.ddp = Ddp(self.tape, dp, self.shapes, self.model.weights, d.pd)

    def layer_repeat(self) -> LayerRepeat | None:
        """The middle layers emitted from a built layer's events (``layer_repeat.py``), where the
        run has enough of them and none of the mechanisms whose per-layer state it does not carry:
        a pipeline, DDP's buckets, adapters and quantized bases, host copies (activation or FSDP2
        offload), selective-op recompute, full recompute of the first layers only."""
        fsdp = self.fsdp
        if not span(self.d.layers, WORKSPACE_TEMPLATE):  # the warm-up step's first forward has the fewest
            return None
        if self.pipe is not None or self.ddp is not None or self.lora is not None:
            return None
        if self.saves is not None or self.d.recompute not in ("none", "full", "selective") or self.d.recompute_layers:
            return None
        if fsdp is not None and fsdp.offload:
            return None
        return LayerRepeat(self.model, fsdp, self.grads)

    def _build_params(self, tied: bool) -> None:
        """``to_empty`` in module order; a tied LM head gets its own copy until
        ``tie_weights`` frees it (traces: build peak = params + V h x 4)."""
        t, pd = self.tape, self.d.pd
        for name, (rows, cols) in self.shapes.items():
            p = t.managed(rows * cols, pd, name, Category.PARAMETERS)
            self.model.weights[name] = p
            if self.lora is not None:  # a frozen base: no AccumulateGrad
                self.model.weights[name] = self.lora.build(p, name, rows, cols)
            else:
                p.fn = ops.leaf(self.grads, name)
        if tied:
            rows, cols = self.shapes["tok_embeddings.weight"]
            copy = t.managed(rows * cols, pd, "output.weight", Category.PARAMETERS)
            t.free(copy)
            self.model.weights["output.weight"] = self.model.weights["tok_embeddings.weight"]
        if self.quant is not None:  # lora.init_adapters -> quant.quantize_base (a head copy: fp32)
            self.lora.retarget(self.quant.build(self.model.weights, self.lora.originals))
        if self.int8 is not None:
            self.lora.retarget(self.int8.build(self.model.weights, self.shapes, self.lora.originals))

    def _workspace(self, thread: str):
        def allocate() -> None:
            self.tape.on_first_mm = None
            with self._first_only():
                self.b.alloc(CUBLAS_WORKSPACE, Category.ACTIVATIONS, f"cublas_workspace.{thread}", Stream.COMPUTE)

        return allocate

    @contextmanager
    def _first_only(self) -> Iterator[None]:
        """What is made inside is the warm-up step's alone (:meth:`derive_step` leaves it out)."""
        events, ids, _ = self.b.position()
        yield
        end, end_ids, _ = self.b.position()
        self.first_only.append((events, end, ids, end_ids))

    def derive_step(self, start: Position, end: Position) -> bool:
        """The first steady step as the warm-up step's events (``start``..``end``) without what only
        the warm-up step made (cuBLAS's workspaces, the optimizer's states: :attr:`first_only`), its
        last batch freed where the next step frees it (``repeat.derive``): where the run has none of
        the mechanisms whose first step differs otherwise (a pipeline's receive buffers, DDP's bucket
        rebuild, LLM.int8's outlier columns, Triton's autotuning). False: build it op by op."""
        if self.pipe is not None or self.ddp is not None or self.int8 is not None or self.d.attention == "triton":
            return False
        if self.carry_at is None or any(x.st.refs != 1 for x in self.batch):
            return False
        return derive(self.b, start, end, self.first_only, {self.carry_at: [x.st.tid for x in self.batch]})

    # --- one step ----------------------------------------------------------------------------------
    def step(self, first: bool) -> None:
        """``runner._train``'s step: each micro-batch (gradient accumulation: the gradients
        add into the first one's, under FSDP2 the sharded ones), then the optimizer step and
        ``zero_grad``."""
        if self.pipe is not None:  # the schedule's actions (pipeline.py)
            self.pipe.step(self.micro_batches, first, self._workspace)
        for i in range(0 if self.pipe is not None else self.micro_batches):
            self.micro_batch(first and i == 0, last=i == self.micro_batches - 1)
        self.b.mark("phase:optimizer")
        self.optimizer_step(first)
        self.zero_grad()
        self.b.mark("phase:end")

    def micro_batch(self, first: bool, last: bool = True) -> None:
        """The batch (the previous one goes when rebound), forward, ``loss / m``,
        ``loss.backward()``, ``del loss``; under DDP all but the ``last`` in ``no_sync()``."""
        t, d = self.tape, self.d
        self.b.mark("phase:forward")
        with t.scoped("batch"):
            ids, labels = t.new(d.tokens, 8, "ids"), t.new(d.tokens, 8, "labels")
        if not self.batch and self.carry_at is None:  # the next step frees the last batch here
            self.carry_at = len(self.b.events)
        t.done(*self.batch)
        self.batch = [ids, labels]
        if self.ddp is not None:
            self.ddp.sync = last
            self.ddp.pre_forward()
        if first:
            t.on_first_mm = self._workspace("forward")
        with act_offload.saving(t, self.saves):
            logits = self.forward(ids)
            loss, keep = self.model.loss(logits, labels)
        if first:
            t.on_first_mm = self._workspace("backward")
        self.b.mark("phase:backward")
        with t.scoped("loss"):
            seed = t.new(1, 4, "grad_seed")
        t.backward(loss, seed)
        if self.fsdp is not None:
            self.fsdp.finish_backward()
        t.done(loss)
        if self.int8 is not None:  # the int8 linears' ctx.A go with their nodes
            self.int8.free_graph()
        if self.lora is not None:
            self.lora.free_graph()
        t.done(keep)

    def forward(self, ids: Tensor) -> Tensor:
        """``Transformer.forward`` (under autocast for bf16-mixed without FSDP)."""
        t, m, d, fsdp = self.tape, self.model, self.d, self.fsdp
        m.cache = {} if d.autocast else None
        if fsdp:
            fsdp.pre_forward(0)
        x = m.embed(ids)
        if self.lora is not None:
            self.lora.require_input_grad(x)
        if fsdp:
            fsdp.post_forward(0, x)
        cos, sin = m.rope_tables(x.itemsize)
        layers, i = self.layers, 0
        if layers is not None:
            layers.begin()
        while i < d.layers:
            if layers is not None and i == layers.span.start:  # the span's layers from their events
                x, i = layers.emit_forward(x), layers.span.stop
                continue
            start = self.b.position()
            xi = fsdp.pre_forward(i + 1, x) if fsdp else t.alias(x)
            out = recompute.layer(t, m, xi, cos, sin, i, d.recompute_layers)
            t.done(xi)
            if fsdp:
                fsdp.post_forward(i + 1, out)
            t.done(x)
            x, i = out, i + 1
            if layers is not None:
                layers.layer_built(i - 1, start, out)
        xi = fsdp.pre_forward(d.layers + 1, x) if fsdp else t.alias(x)
        logits = m.head(xi)
        t.done(xi, x)
        if fsdp:
            fsdp.post_forward(d.layers + 1, logits)
            fsdp.end_forward()
        if m.cache is not None:
            t.done(*m.cache.values())
            m.cache = None
        t.done(cos, sin)
        return logits

    # --- optimizer -----------------------------------------------------------------------------------
    def optimizer_step(self, first: bool) -> None:
        """Foreach AdamW over ``model.parameters()`` (local shards): on the first step the
        states (exp_avg, exp_avg_sq per parameter, zeros_like, in parameter order); each step
        one ``_foreach_sqrt`` temporary per parameter, all live together."""
        self.tape.scope = ""
        params = self.optimizer_params()
        plain_norms = self.d.tp > 1 and not self.d.sp and self.fsdp is None  # two groups (tensor_parallel.py)
        for group in tpar.optimizer_groups(params) if plain_norms else [params]:
            self._group_step(group, first)

    def _group_step(self, params: list[tuple[str, int]], first: bool) -> None:
        """One parameter group's step: its states on the first step, its temporaries."""
        t, pd = self.tape, self.d.pd
        if self.master is not None:
            fp32 = self.lora.fp32() if self.lora is not None else ()
            if first:
                with self._first_only():
                    self.master.create(params, fp32)
            self.master.step(params, False, fp32, {n: g.numel for n, g in self.grads.items()})
            return
        itemsize = self.lora.itemsize if self.lora is not None else lambda _: pd
        sizes = [(name, n * itemsize(name)) for name, n in params]
        if first:  # kept as ids: nothing reads them as tensors (MasterAdamW.create)
            with self._first_only():
                states = [(size, f"{name}.{state}") for name, size in sizes for state in ("exp_avg", "exp_avg_sq")]
                self.states += t.temporaries(states, Category.OPTIMIZER_STATES)
        t.release(t.temporaries([(size, f"{name}.sqrt_tmp") for name, size in sizes], Category.OPTIMIZER_TEMP))

    def optimizer_params(self) -> list[tuple[str, int]]:
        """(name, local elements) in ``model.parameters()`` order (a tied head is the embedding);
        under ZeRO-1 the most-loaded rank's partition, in its order."""
        if self.fsdp is not None:
            return self.fsdp.shard_numels()
        params = [(name, rows * cols) for name, (rows, cols) in self.shapes.items()]
        params = self.lora.params() if self.lora is not None else params  # the adapters (and a head copy)
        if not self.zero1:
            return params
        if self.zero1_shard is not None:
            return self.zero1_shard
        from memplan.costmodel.timeline import zero1

        return zero1.shard(params, self.dp)

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)``: every gradient goes, in parameter order."""
        if self.fsdp is not None:
            self.fsdp.zero_grad()
            return
        if self.lora is not None:
            self.lora.zero_grad()
            return
        for name in self.shapes:
            g = self.grads.pop(name, None)
            if g is not None:
                self.tape.drop(g)
