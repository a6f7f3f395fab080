"""PEFT LoRA (peft 0.21) over transformers' model in the Trainer's op-level run (``hf_trainer.py``).

``get_peft_model`` freezes every base parameter (no ``AccumulateGrad``, no gradient, no optimizer
state; a frozen matmul keeps no input for a weight gradient: ``ops.linear``) and wraps each targeted
linear of each decoder layer in ``peft.tuners.lora.layer.Linear``: ``lora_A`` (r x in) and ``lora_B``
(out x r), fp32 whatever the base (``autocast_adapter_dtype=True``), made after the base. Its forward
(``Linear.forward``)::

    result = self.base_layer(x)                         # the base's dtype
    x = self._cast_input_dtype(x, lora_A.weight.dtype)  # x.to(fp32): x itself when fp32 already
    result = result + lora_B(lora_A(dropout(x))) * scaling
    result = result.to(torch_result_dtype)              # back to the base's dtype

``dropout`` is ``nn.Identity`` at ``lora_dropout=0``; else ``nn.Dropout``, which on CPU is
``at::dropout``'s composite ``input * (empty_like(input).bernoulli_(1 - p) / (1 - p))`` (the noise in
the input's dtype, saved by the product when the input requires grad) and on CUDA the fused
``native_dropout`` (its output and a bool mask, the mask saved: ``aten/src/ATen/native/Dropout.cpp``
``is_fused_kernel_acceptable``; the CUDA form is from the source, not checked on a GPU).

Under the Trainer's ``bf16=True`` (autocast) the adapters' matmuls cast their input to bf16 again
(after PEFT's fp32 cast of a bf16 input) and their weights through autocast's cache; a frozen weight
is not cached (``cached_cast`` caches fp32 leaves that require grad only), so each of its matmuls
casts it anew (``hf_model.HfLlama.weight``). Under FSDP2's ``bf16=True`` policy the forward reads the
adapters as all-gathered, in bf16 (``read_bytes``; ``hf_fsdp_peft.py``): ``_cast_input_dtype`` casts
nothing and the adapters run in bf16. ``modules_to_save`` (``ModulesToSaveWrapper``) trains a
copy of the module in the base's dtype beside the frozen original (tied or not: the copy is untied).
With gradient checkpointing the Trainer's ``activation_checkpointing_enable`` calls
``enable_input_require_grads``: the frozen embedding's output becomes a leaf that requires grad, held
with its ``.grad`` by its ``AccumulateGrad`` until ``training_step`` returns and the graph goes.
Checked on CPU against the real Trainer: ``tests/unit/test_timeline_hf_peft.py``; over the families of
``hf_families.py`` (Qwen3, Phi-3, OLMo 2, Gemma 2 and 3: the adapters wrap the family's own linears, Phi-3's
fused ``qkv_proj`` and ``gate_up_proj`` by those names, as PEFT matches them) ``test_timeline_hf_peft_families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.costmodel.lora import (
    ADAPTER_BYTES,
    ALL_LINEAR,
    FUSED_LINEARS,
    LINEARS,
    MLA_ATTENTION,
    SAVABLE,
    resolve_targets,
)
from memplan.costmodel.timeline import hf_dora, ops
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.costmodel.timeline.hf_moe_lora import CONVERTED, MLP, wrapped_experts


@dataclass(frozen=True)
class HfLoraConfig:
    """The adapters: rank, targeted linears (transformers' names), dropout > 0, trained copies."""

    rank: int
    targets: frozenset[str]
    dropout: bool = False
    modules_to_save: tuple[str, ...] = ()
    # an MoE block's 3-D experts PEFT wraps in lora.ParamWrapper, outermost first, with their rank (hf_moe_lora.py)
    experts: tuple[tuple[str, int], ...] = ()
    num_experts: int = 0
    router: bool = False  # the router's 2-D weight too (all-linear over Mixtral or Qwen3-MoE)
    dora: bool = False  # use_dora=True: a magnitude per output feature and DoRA's forward (hf_dora.py)

    @classmethod
    def of(cls, plan, arch: str = "", num_experts: int = 0) -> HfLoraConfig | None:
        """The plan's adapters (``finetune: lora``) over a model of the ``arch`` family with ``num_experts``
        experts a block, or None for full fine-tuning."""
        if plan.finetune == "full":
            return None
        mla = (t for t in plan.lora_targets if t in MLA_ATTENTION)  # DeepSeek-V3's (hf_mla.py)
        names = FUSED_LINEARS if arch == "phi3" else LINEARS  # Phi-3's qkv_proj and gate_up_proj (hf_families.py)
        targets = frozenset((*resolve_targets(plan.lora_targets, names), *mla))
        if ALL_LINEAR in plan.lora_targets:  # every nn.Linear but the head: Qwen2-MoE's shared_expert_gate too
            targets |= {"shared_expert_gate"}
        every = ALL_LINEAR in plan.lora_targets
        experts = wrapped_experts(arch, targets, plan.lora_rank, every)
        if arch in CONVERTED:  # PEFT moved the MLP names to the experts: no nn.Linear takes them (a dense layer's)
            targets -= set(MLP)
        saved = tuple(plan.modules_to_save)
        router = every and arch in CONVERTED
        dropout, dora = plan.lora_dropout > 0, plan.lora_dora
        return cls(plan.lora_rank, targets, dropout, saved, experts, num_experts, router, dora)


def _copy_name(module: str) -> str:
    """The weight a ``modules_to_save`` module's forward reads: its trained copy."""
    return {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}[module]


@dataclass
class HfLora:
    """The adapters on a tape: parameters, ``AccumulateGrad`` leaves, the ops of their forward."""

    tape: Tape
    cfg: HfLoraConfig
    tokens: int
    cuda: bool = False
    input_grad: bool = False  # enable_input_require_grads (the Trainer's gradient checkpointing)
    # the adapters' weights as their forward reads them: fp32, or bf16 as FSDP2's mixed policy gathers them
    read_bytes: int = ADAPTER_BYTES
    trainable: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (numel, itemsize)
    input_grads: dict[str, Tensor] = field(default_factory=dict)
    held: list[Tensor] = field(default_factory=list)  # what the graph keeps until training_step returns
    originals: dict[str, Tensor] = field(default_factory=dict)  # a trained copy's weight -> the frozen original

    def build(self, weights: dict[str, Tensor], shapes: dict[str, tuple[int, int]], grads: dict, pd: int) -> None:
        """After the frozen base: A and B per targeted linear (``model.parameters()`` order), then
        each ``modules_to_save`` copy in the base's dtype, which replaces the weight the forward reads."""
        r, wrapped = self.cfg.rank, dict(self.cfg.experts)
        for name, (rows, cols) in shapes.items():
            prefix = name.removesuffix(".weight")
            expert = prefix.rsplit(".", 1)[-1] if ".experts." in prefix else ""
            if expert in wrapped:  # a ParamWrapper's: lora_A (r E x k), lora_B (n x r E) over (E, n, k)
                e, rank = self.cfg.num_experts, wrapped[expert]
                for part, numel in (("lora_A", rank * e * cols), ("lora_B", rows * rank)):
                    self._param(weights, grads, f"{prefix}.{part}.weight", numel, ADAPTER_BYTES)
                continue
            if not (self.targeted(prefix) or (self.cfg.router and prefix.endswith(".mlp.gate"))):
                continue
            for part, numel in (("lora_A", r * cols), ("lora_B", rows * r)):
                self._param(weights, grads, f"{prefix}.{part}.weight", numel, ADAPTER_BYTES)
            if self.cfg.dora:  # DoraLinearLayer's weight: one fp32 magnitude per output feature
                self._param(weights, grads, f"{prefix}.{hf_dora.MAGNITUDE}.weight", rows, ADAPTER_BYTES)
        for module in self.cfg.modules_to_save:
            if module not in SAVABLE:
                continue
            rows, cols = shapes["model.embed_tokens.weight"]
            if _copy_name(module) in weights:  # the original (a tied head's is the embedding)
                self.originals[_copy_name(module)] = weights[_copy_name(module)]
            self._param(weights, grads, _copy_name(module), rows * cols, pd, f"{module}.modules_to_save")

    def _param(self, weights: dict, grads: dict, name: str, numel: int, itemsize: int, tag: str = "") -> None:
        p = self.tape.managed(numel, itemsize, tag or name, Category.PARAMETERS)
        p.fn = ops.leaf(grads, name)
        weights[name] = p
        self.trainable[name] = (numel, itemsize)

    def targeted(self, module: str) -> bool:
        """``model.layers.{i}.{self_attn|mlp}.{proj}`` among the targets; an MoE block's experts
        (``mlp.experts.down_proj``: a 3-D parameter, no ``nn.Linear``) never are (``hf_moe.py``)."""
        parts = module.split(".")
        return parts[:2] == ["model", "layers"] and parts[-1] in self.cfg.targets and "experts" not in parts

    def adapt(self, model, x: Tensor, out: Tensor, name: str) -> Tensor:
        """``lora.Linear.forward`` after ``self.base_layer(x)`` returned ``out``; ``out`` itself
        when ``name`` is not targeted. ``model``: the ``HfLlama`` whose ``linear`` runs the adapters."""
        if not self.targeted(name):
            return out
        if self.cfg.dora:  # DoRA's variant (over a 4-bit base too; hf_support refuses it over an 8-bit one)
            return hf_dora.adapt(self, model, x, out, name)
        if model.quant is not None and model.quant.quantized(name):
            return self._adapt_bnb(model, x, out, name)
        t, r = self.tape, self.cfg.rank
        with t.scoped(f"{name}.lora"):
            a = ops.to(t, x, self.read_bytes, "input_fp32")
            dropped = self._dropout(a) if self.cfg.dropout else t.alias(a)
            ya = model.dense(dropped, f"{name}.lora_A", r, "lora_A")
            t.done(dropped)
            yb = model.dense(ya, f"{name}.lora_B", out.numel // self.tokens, "lora_B")
            t.done(ya)
            delta = ops.unary(t, yb, "scaling")  # * alpha / r: a Python scalar, nothing saved
            t.done(yb)
            total = ops.add(t, out, delta, "sum")  # promoted to fp32 over a 16-bit base
            t.done(delta, out)  # the temporary, then the rebound `result`
            y = ops.to(t, total, out.itemsize, "out_cast")
            t.done(total, a)  # the rebound `result`, then the frame's cast input
        return y

    def _adapt_bnb(self, model, x: Tensor, out: Tensor, name: str) -> Tensor:
        """``lora.bnb.Linear4bit.forward`` (``Linear8bitLt``'s: no clone): the base's result cloned;
        unless ``torch.is_autocast_enabled()`` the input cast to the adapters' dtype and their output
        cast to the result's before the sum. That call asks about CUDA's autocast alone: on CPU the
        casts run under ``bf16=True`` too. Its ``output`` stays a local until the return."""
        t, r, cast = self.tape, self.cfg.rank, model.cache is None or model.cpu
        with t.scoped(f"{name}.lora"):
            result = out
            if model.quant.clones:  # lora.Linear4bit: CloneBackward passes the gradient on (8-bit: none)
                result = ops.unary(t, out, "clone", temps=-1)
                t.done(out)
            # to the adapters' dtype as read: fp32, bf16 as FSDP's bf16 policy gathers them (hf_fsdp_qlora.py)
            a = ops.to(t, x, self.read_bytes, "input_fp32") if cast else t.alias(x)
            dropped = self._dropout(a) if self.cfg.dropout else t.alias(a)
            ya = model.dense(dropped, f"{name}.lora_A", r, "lora_A")
            t.done(dropped)
            yb = model.dense(ya, f"{name}.lora_B", out.numel // self.tokens, "lora_B")
            t.done(ya)
            delta = ops.unary(t, yb, "scaling")
            t.done(yb)
            output = ops.to(t, delta, result.itemsize, "output_cast") if cast else t.alias(delta)
            t.done(delta)
            total = ops.add(t, result, output, "sum")
            t.done(result, a, output)  # the rebound `result`, then the frame's x and output
        return total

    def _dropout(self, x: Tensor) -> Tensor:
        """``nn.Dropout`` in training: CPU's ``x * noise`` (the noise saved), CUDA's fused kernel."""
        t = self.tape
        if not self.cuda:
            noise = t.new(x.numel, x.itemsize, "dropout_noise")
            out = ops.mul(t, x, noise, "dropout")
            t.done(noise)
            return out
        return _native_dropout(t, x)

    def require_input_grad(self, emb: Tensor) -> None:
        """``enable_input_require_grads``: the embedding's output (a frozen embedding's: no graph)
        becomes a leaf that requires grad, held by its ``AccumulateGrad`` until the graph goes."""
        if not self.input_grad or emb.fn is not None:
            return
        emb.fn = ops.leaf(self.input_grads, "inputs_embeds")
        self.held.append(self.tape.hold(emb))

    def keep_reachable(self, reached: set) -> list[Tensor]:
        """The leaf input and its ``.grad`` where its ``AccumulateGrad`` is in ``reached`` (a node Python still
        holds, and those it reaches: TRL's ``curr_autograd_node``), taken out of the graph's; they go when that
        node does."""
        if not any(x.fn in reached for x in self.held):
            return []
        kept, self.held = self.held, []
        grad = self.input_grads.pop("inputs_embeds", None)
        return kept if grad is None else [*kept, grad]

    def free_graph(self) -> None:
        """``training_step`` returns: the graph goes, with the leaf input and its gradient."""
        for x in self.held:
            self.tape.drop(x)
        self.held = []
        self.tape.drop(self.input_grads.pop("inputs_embeds", None))


def _native_dropout(tape: Tape, x: Tensor) -> Tensor:
    """``native_dropout`` (CUDA, from ``Dropout.cpp`` / ``cuda/Dropout.cu``): the output and a bool
    mask, the mask saved; backward (``native_dropout_backward``) allocates the gradient alone."""

    def apply(tape: Tape, node, g: list[Tensor], saved: list) -> list:
        return [tape.new(x.numel, x.itemsize, "grad")]

    node = tape.node("dropout", apply, [x])
    out = ops.result(tape, x.numel, x.itemsize, "dropout", node)
    mask = tape.new(x.numel, 1, "dropout_mask")
    if node is not None:
        tape.save(node, mask)
    tape.done(mask)
    return out
