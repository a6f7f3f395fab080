"""A hand-written transformers training loop (``--runtime hf-loop``) on one rank, as a timeline.

The loop of docs/cost-model.md ("hf-loop runtime") and tests/accuracy/hf_steps.py (``loop="hand"``)::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for i, ids in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=<bf16-mixed, or the plan's autocast>):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()  # with gradient accumulation: loss = out.loss / ga; loss.backward()
        if (i + 1) % ga == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)

``hf_loop_run`` runs the family's model (``hf_model.py``, ``hf_families.family``: every family the
Trainer's run follows) and the forward and checkpointing of ``hf_trainer.py``'s run; what differs from
``transformers.Trainer``'s step is written here, read from transformers 5.23 and torch 2.13 and checked
on CPU against the loop itself (tests/unit/test_timeline_hf_loop.py, test_timeline_hf_loop_families.py):

- the data: one ``ids`` tensor (int64 b x s), the labels being the same tensor;
- the loss: no ``num_items_in_batch``, so ``ForCausalLMLoss`` takes ``cross_entropy``'s mean
  (no division); ``backward`` seeds it with ``ones_like`` held until it returns; over ``ga`` > 1
  iterations a step (accelerate's docs' and the transformers course's accumulation) ``loss = out.loss /
  ga``, a 4-byte scalar kept (with the graph) until the next iteration's, the gradients after the
  first iteration's summed into ``.grad``;
- ``out`` (``CausalLMOutputWithPast``: the loss, the logits in the compute dtype, the
  ``DynamicCache``) lives until the next forward returns; ``use_cache`` stays True in training,
  so each layer's ``past_key_values.update`` copies its RoPE'd keys and its values
  (``torch.cat`` onto an empty tensor of the keys' dtype: fp32 values under autocast, where RoPE
  promotes the keys) and SDPA runs on the copies; each family's attention calls it where its
  modeling file does (``HfLlama.cached``; DeepSeek-V2 / V3 cache the compressed latent and the RoPE'd
  key before ``expand_kv``, the values' copy promoted to the wider dtype, transformers 5.23). Under
  gradient checkpointing (``GradientCheckpointingLayer``) the layers get ``past_key_values=None``: no
  cache;
- under autocast the weight casts go when the ``with`` block exits, after ``out`` is rebound
  (no ``convert_outputs_to_fp32``: the logits stay bf16);
- ``AdamW(foreach=True)``, one group: on its first step, per parameter, a 4-byte ``step`` (on
  the CPU unless fused or capturable: no GPU bytes on CUDA), ``exp_avg`` and ``exp_avg_sq``;
  each step ``torch.tensor(1.0)`` for the CPU steps' ``_foreach_add_``, then one
  ``_foreach_sqrt`` temporary per parameter, all live together until the step returns
  (``torch/optim/adam.py: _multi_tensor_adam``); no gradient clipping;
- ``zero_grad(set_to_none=True)``: the gradients go in parameter order;
- checkpointing with the plan's ``use_reentrant`` (``specs.plan.checkpoint_reentrant``: by default over a
  quantized base PEFT's ``prepare_model_for_kbit_training(model)``, torch's reentrant checkpoint,
  ``reentrant.py``, whose ``ctx.run_function`` tensors live with ``out``'s graph to the next forward; else
  ``gradient_checkpointing_enable()``'s non-reentrant one);
- over a PEFT model (``hf_lora.py``, ``hf_bnb.py``: the ``hf`` run's adapters and 4-bit bases) AdamW
  holds the adapters alone, and under gradient checkpointing ``enable_input_require_grads``' leaf and
  its ``.grad`` live with ``out``'s graph until the next forward returns (over ``ga`` > 1 iterations with
  the divided ``loss``'s, until the next division; the Trainer's go when ``training_step`` returns).
"""

from __future__ import annotations

from memplan.costmodel.timeline import act_offload
from memplan.costmodel.timeline.autograd import Node, Tape, Tensor
from memplan.costmodel.timeline.events import Category, Timeline
from memplan.costmodel.timeline.hf_bnb import Bnb4bit, Bnb8bit
from memplan.costmodel.timeline.hf_families import family_config
from memplan.costmodel.timeline.hf_lora import HfLoraConfig
from memplan.costmodel.timeline.hf_model import scalar_div
from memplan.costmodel.timeline.hf_support import accumulation
from memplan.costmodel.timeline.hf_trainer import _HfRun, hf_dims, hf_kernel
from memplan.costmodel.timeline.reentrant import Reentrant
from memplan.costmodel.timeline.trainer_model import Dims
from memplan.specs.plan import checkpoint_reentrant


def hf_loop_plan_run(model, workload, plan, gpu_arch=None, device: str = "cuda") -> Timeline:
    """The run on ``device`` of an ``hf-loop`` plan ``hf_support.hf_supported(..., runtime="hf-loop")``
    accepts: a first step and two steady ones (``gpu_arch``: the GPU's, a 4-bit base's kernel)."""
    kernel = hf_kernel(model, plan, device, "hf-loop")
    assert kernel is not None
    experts = model.moe.num_experts if model.moe else 0
    lora = HfLoraConfig.of(plan, model.architecture, experts)
    d, quant = hf_dims(model, workload, plan, "hf-loop"), Bnb4bit.of(plan, gpu_arch) or Bnb8bit.of(plan, model)
    build = plan.model_build
    offload = plan.offload_activations == "cpu"  # save_on_cpu around the forward and backward (act_offload.py)
    # DynamicCache(config=...) makes a sliding cache layer where the config.json's layer is one
    # (cache_utils.get_layer_types_and_kwargs): the spec's sliding layers
    sliding = tuple(i for i, kind in enumerate(model.layer_attention_kinds) if kind == "sliding")
    return hf_loop_run(
        d,
        model.tied_embeddings,
        kernel,
        qkv_bias=model.qkv_bias,
        window_layers=sliding,
        arch=model.architecture,
        extra=family_config(model, gpu_arch, plan.attention),
        lora=lora,
        quant=quant,
        build=build,
        offload=offload,
        ga=accumulation(workload, plan),
        reentrant=checkpoint_reentrant(plan, "hf-loop"),
    )


def hf_loop_run(
    d: Dims,
    tied: bool,
    kernel: str,
    steps: int = 3,
    qkv_bias: bool = False,
    window_layers: bool | tuple[int, ...] = False,
    arch: str = "llama",
    extra: dict | None = None,
    lora: HfLoraConfig | None = None,
    quant: Bnb4bit | Bnb8bit | None = None,
    build: str = "to_device",
    offload: bool = False,
    ga: int = 1,
    reentrant: bool = False,
    **tape_flags,
) -> Timeline:
    """The loop for ``steps`` optimizer steps of ``ga`` iterations each (``tape_flags``: :class:`Tape`
    attributes, as ``hf_run``'s).
    ``window_layers``: the layers (True: every one) whose cache layers are ``DynamicSlidingWindowLayer``s,
    each with an int64 ``_sliding_window_tensor`` made with the cache (after the embedding; on CUDA its
    device copy at the layer's first update); its ``update`` keeps ``full[:, :, -window + 1:, :]`` of the
    whole sequence's ``cat``, a view, so the cache holds a ``DynamicLayer``'s bytes, and the attention gets
    the whole copy (a window the sequence reaches: the family's masked SDPA, ``hf_sliding.py``, on CPU and on
    CUDA's memory-efficient kernel where ``hf_support.sliding_cuda_ok``): a config.json
    with a ``sliding_window`` and no
    ``layer_types`` (Mistral's default 4096, even where it spans every position) makes every layer one,
    one with ``layer_types`` (Gemma 2 / 3) its sliding ones. A :class:`ModelSpec` does not carry a
    window that spans the positions: plans leave those out (8 B a layer). ``arch``, ``extra``: the
    family's model (``hf_families.family``) and its further config (``family_config``), as ``hf_run``'s.
    ``lora``, ``quant``: PEFT's adapters over the frozen (4-bit or LLM.int8) base, as in ``hf_run``, AdamW over
    the adapters; ``build``: as ``hf_run``'s; ``ga``: iterations an optimizer step (the loop's gradient
    accumulation, module docstring); ``reentrant``: under checkpointing, torch's reentrant checkpoint
    (``reentrant.py``: ``prepare_model_for_kbit_training(model)``'s, ``specs.plan.checkpoint_reentrant``)."""
    args = (d, tied, kernel, 0, tape_flags, qkv_bias, ga, arch, extra)
    run = _HfLoopRun(*args, lora=lora, quant=quant, build=build)
    every = tuple(range(d.layers)) if window_layers is True else window_layers or ()
    run.window_layers = frozenset(every) if d.recompute != "full" else frozenset()
    run.saves = act_offload.SaveOnCpu() if offload else None
    run.reentrant = Reentrant(run.tape, run._inner_graph) if reentrant and d.recompute == "full" else None
    run.b.mark("build")
    for k in range(steps):
        run.step(k)
        run.b.mark(f"step{k}")
    return run.b.build(run.saves.host_peak if run.saves is not None else 0)


def cache_cat(tape: Tape, x: Tensor, itemsize: int, tag: str) -> Tensor:
    """``torch.cat([empty, x], dim=-2)`` into the cache's dtype (``itemsize``): a copy. Backward
    (CatBackward0): a slice (a view) of the gradient, cast by the engine to ``x``'s dtype."""

    def apply(tape: Tape, node: Node, g: list[Tensor], saved: list) -> list:
        return [tape.view(g[0], x.numel)]

    node = tape.node(tag, apply, [x], meta=[(x.numel, x.itemsize, False)])
    out = tape.new(x.numel, itemsize, tag, Category.KV_CACHE)
    out.fn = node
    return out


class _HfLoopRun(_HfRun):
    """``_HfRun``'s model and forward under the hand-written loop's step (module docstring)."""

    def _build(self) -> None:
        """Parameters in ``model.parameters()`` order, the two rotary buffers, the batch."""
        t, d = self.tape, self.d
        self._params()
        self.ids = t.managed(d.tokens, 8, "input_ids", Category.ACTIVATIONS)
        self.out: list[Tensor] = []  # the previous step's ``out``: loss, logits, the cache's tensors
        self.kv: list[Tensor] = []
        self.window_layers: frozenset[int] = frozenset()  # the sliding cache layers (hf_loop_run)
        self.cache_layer = 0  # the layer whose update comes next
        if d.recompute != "full":
            self.model.kv_cache = self._update

    def _update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``DynamicLayer.update``: the keys' and values' copies (the cache's references), then
        the attention's rebound locals."""
        t, i = self.tape, self.cache_layer
        self.cache_layer += 1
        with t.scoped("past_key_values"):
            if i in self.window_layers and self.model.kernel != "cpu_flash":
                self.kv.append(t.new(1, 8, "sliding_window_tensor", Category.KV_CACHE))
            keys = cache_cat(t, k, k.itemsize, "keys")
            # cat onto the keys' empty tensor: the values promoted to the wider dtype (an MLA latent's
            # bf16 beside its fp32 RoPE'd key under autocast)
            values = cache_cat(t, v, max(k.itemsize, v.itemsize), "values")
        self.kv += [keys, values]
        t.done(k, v)
        return t.alias(keys), t.alias(values)

    def step(self, k: int) -> None:
        """One optimizer step: ``ga`` iterations (forward, ``out`` rebound, backward), then ``opt.step()``
        and ``zero_grad``."""
        t = self.tape
        for i in range(self.ga):
            self.micro_step(first=k == 0 and i == 0)
        self.b.mark("phase:optimizer")
        self.optimizer_step(first=k == 0)
        for name in self.trainable:
            t.drop(self.grads.pop(name, None))
        self.b.mark("phase:end")

    def micro_step(self, first: bool) -> None:
        """One iteration's forward (``out`` rebound) and backward; over ``ga`` > 1 of them the loss divided
        first (``loss = out.loss / ga``, kept until the next iteration's), each gradient after the first
        iteration's added into ``.grad`` (``ops.leaf``)."""
        t, m = self.tape, self.model
        self.b.mark("phase:forward")  # the meter's phases (timeline.phases)
        if self.model.kernel != "cpu_flash" and first:
            t.on_first_mm = self._workspace("forward")
        m.cache = {} if self.d.autocast else None
        self.kv, self.cache_layer = [], 0
        graph = self._graph()
        if self.window_layers and self.model.kernel == "cpu_flash":  # DynamicCache(config=...)
            with t.scoped("past_key_values"):
                self.kv += [t.new(1, 8, "sliding_window_tensor", Category.KV_CACHE) for _ in self.window_layers]
        with act_offload.saving(t, self.saves):
            logits, hidden = self.forward(self.ids)
            loss = m.loss(logits, None)
        t.done(hidden)  # LlamaForCausalLM.forward's hidden_states, at its return
        t.done(*self.out)  # `out = ...`: the previous step's output goes, with its graph
        if self.ga == 1:
            graph()
        self.out = [loss, logits, *self.kv]
        if m.cache is not None:  # the autocast block exits: its weight casts go
            t.done(*m.cache.values())
            m.cache = None
        if self.model.kernel != "cpu_flash" and first:
            t.on_first_mm = self._workspace("backward")
        self.b.mark("phase:backward")
        if self.ga > 1:  # `loss = out.loss / ga`: the previous iteration's goes as it is rebound
            scaled = scalar_div(t, loss, "div_accumulation", temps=0)
            t.done(self.prev_loss)  # the graph went with it, not with `out`
            graph()
            self.prev_loss, loss = scaled, scaled
        seed = t.new(1, 4, "grad_seed")
        with act_offload.saving(t, self.saves):  # save_on_cpu around the backward too: a reentrant re-run saves there
            t.backward(loss, t.hold(seed))  # torch.autograd.backward holds it until it returns
        t.scope = ""
        t.done(seed)

    def _graph(self):
        """What the previous step's graph holds beyond its saved tensors: under gradient checkpointing
        over a frozen embedding, ``enable_input_require_grads``' leaf and its ``.grad`` (``hf_lora``); over an
        LLM.int8 base each int8 linear's ``ctx.A`` (``int8.py``: an attribute of the node, not a saved tensor,
        so under checkpointing the forward's inputs too); a function that lets them go (``out.loss`` holds the
        graph until ``out`` is rebound; over ``ga`` > 1 iterations the divided ``loss`` until it is)."""
        lora, quant = self.lora, self.model.quant
        int8 = quant.int8 if isinstance(quant, Bnb8bit) else None
        inputs, held, grad = [], [], None
        if int8 is not None:
            inputs, int8.held, int8.owners = int8.held, [], []
        if lora is not None:
            held, lora.held = lora.held, []
            grad = lora.input_grads.pop("inputs_embeds", None)
        ctxs = []  # reentrant checkpoints' ctx.run_function (reentrant.py)
        if self.reentrant is not None:
            ctxs, self.reentrant.held = self.reentrant.held, []

        def free() -> None:  # the nodes from the loss down (Int8.free_graph's order), then the input leaf
            for x in reversed(inputs):
                self.tape.drop(x)
            for x in reversed(ctxs):
                self.tape.drop(x)
            for x in held:
                self.tape.drop(x)
            self.tape.drop(grad)

        return free

    def optimizer_step(self, first: bool) -> None:
        """``AdamW(foreach=True)``: the states on the first step, then the step's temporaries."""
        t, cpu = self.tape, self.model.kernel == "cpu_flash"
        t.scope = ""
        if first:
            for name, (numel, itemsize) in self.trainable.items():
                if cpu:
                    self.states.append(t.managed(1, 4, f"{name}.step", Category.OPTIMIZER_STATES))
                for state in ("exp_avg", "exp_avg_sq"):
                    self.states.append(t.managed(numel, itemsize, f"{name}.{state}", Category.OPTIMIZER_STATES))
        if cpu:
            t.done(t.new(1, 4, "adamw.one", Category.OPTIMIZER_TEMP))
        temps = [
            t.new(numel, itemsize, f"{name}.exp_avg_sq_sqrt", Category.OPTIMIZER_TEMP)
            for name, (numel, itemsize) in self.trainable.items()
        ]
        t.done(*reversed(temps))  # the list goes at the return, last item first
