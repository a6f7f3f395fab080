"""LoRA adapters (Hu et al. 2021, arXiv 2106.09685) on the bundled trainer's decoder, as PEFT builds them.

No PEFT dependency: :class:`LoraLinear` follows PEFT's ``LoraLayer`` / ``lora.Linear`` (0.21):
``y = base(x) + lora_B(lora_A(dropout(x))) * alpha / r``, with ``lora_A`` r x in (Kaiming-uniform,
``a = sqrt(5)``, nn.Linear's init), ``lora_B`` out x r (zeros: the adapted model starts as the
base), the adapters in fp32 whatever the base (``get_peft_model(autocast_adapter_dtype=True)``)
and the input cast to the adapter's dtype (``LoraLayer._cast_input_dtype``), the sum cast back to
the base output's dtype. The base is frozen (``requires_grad=False``): it holds no gradient or
optimizer state, and its linears keep no input for a weight gradient.

Targets are the plan's ``lora_targets`` in transformers' names (memplan.costmodel.lora), mapped
to the trainer's modules by :data:`HF_NAMES`. A quantized base (``quant``: nf4, fp4, int8) is
built by memplan.train.quant once the weights exist (:func:`init_adapters`), and the adapters
over a 4-bit layer clone its output first, as PEFT's ``lora.Linear4bit`` does.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from memplan.costmodel.lora import HF_NAMES, resolve_targets
from memplan.specs.plan import Plan
from memplan.train import quant

LORA_ALPHA = 16  # PEFT's LoraConfig default; the scaling alpha / r changes no memory


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable fp32 rank-r adapter (PEFT ``lora.Linear``)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base = base
        kw = dict(device=base.weight.device, dtype=torch.float32)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **kw))  # (r, in)
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, **kw))  # (out, r)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # PEFT's lora.Linear4bit clones the 4-bit base's output ("defensively", after Tim
        # Dettmers) before adding the adapter: one more (b, s, out) transient; set by quant
        self.clone_base = False

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """PEFT's ``reset_lora_parameters(init_lora_weights=True)``: A Kaiming-uniform, B zeros."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.clone_base:
            out = out.clone()
        a = self.dropout(x.to(self.lora_A.dtype))  # (b, s, in) in fp32; a no-op cast over fp32
        delta = F.linear(F.linear(a, self.lora_A), self.lora_B) * self.scaling  # (b, s, r) -> (b, s, out)
        return (out + delta).to(out.dtype)


class SavedModule(nn.Module):
    """PEFT's ``ModulesToSaveWrapper``: the original module stays (frozen) and a trainable copy of
    it, in its dtype, runs the forward (``modules_to_save``: the LM head here)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original_module = original
        self.trained = copy.deepcopy(original).requires_grad_(True)

    @torch.no_grad()
    def reset_copy(self) -> None:
        """The copy starts as the original (PEFT deep-copies the loaded module)."""
        for mine, theirs in zip(self.trained.parameters(), self.original_module.parameters(), strict=True):
            mine.copy_(theirs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(x)


def _targets(plan: Plan) -> set[str]:
    return set(resolve_targets(plan.lora_targets))


def apply_lora(model: nn.Module, plan: Plan) -> None:
    """Freeze every parameter of ``model`` (a Transformer chunk) and wrap each targeted linear of
    each layer in a :class:`LoraLinear` (PEFT's ``get_peft_model``). Call before activation
    checkpointing wraps the layers, and before ``to_empty``: the adapters are made on the
    model's (meta) device and initialised by :func:`init_adapters`, which also quantizes the
    base when the plan's is (``model.quantization``)."""
    model.quantization = quant.quant_config(plan)
    for p in model.parameters():
        p.requires_grad_(False)
    chosen = _targets(plan)
    for block in model.layers.values():
        for path, hf in HF_NAMES.items():
            if hf not in chosen:
                continue
            owner_name, attr = path.split(".")
            owner = getattr(block, owner_name)
            setattr(owner, attr, LoraLinear(getattr(owner, attr), plan.lora_rank, LORA_ALPHA, plan.lora_dropout))
    if "lm_head" in plan.modules_to_save and getattr(model, "output", None) is not None:
        model.output = SavedModule(model.output)
    if plan.recompute == "full" and getattr(model, "tok_embeddings", None) is not None:
        enable_input_require_grads(model.tok_embeddings)


def _require_grad(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:  # noqa: ARG001
    output.requires_grad_(True)


def enable_input_require_grads(embedding: nn.Module) -> None:
    """PEFT / transformers' ``enable_input_require_grads``: the frozen embedding's output requires
    grad, so that a checkpointed first layer's recomputed graph reaches its adapters (needed by
    reentrant checkpointing, done by PEFT whenever gradient checkpointing is on)."""
    embedding.register_forward_hook(_require_grad)


def init_adapters(model: nn.Module) -> None:
    """Initialise every adapter of ``model`` (after ``init_weights``, which fills the base). Over
    a quantized base, first quantize it (transformers quantizes the weights it loads, then PEFT's
    ``prepare_model_for_kbit_training`` casts the rest to fp32; memplan.train.quant)."""
    config = getattr(model, "quantization", None)
    if config is not None:
        quant.quantize_base(model, config)
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.reset_adapter()
        elif isinstance(module, SavedModule):
            module.reset_copy()


def trainable(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters the optimizer steps: those that require grad (the adapters under LoRA)."""
    return [p for p in params if p.requires_grad]
