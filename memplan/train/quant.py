"""A bitsandbytes-quantized frozen base for the bundled trainer's LoRA (QLoRA, Dettmers et al.
2023, arXiv 2305.14314; LLM.int8, Dettmers et al. 2022, arXiv 2208.07339).

The base ends as transformers' ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``
and PEFT's ``prepare_model_for_kbit_training`` leave it (transformers 5.23, peft 0.21.2,
bitsandbytes 0.50.2):

- every linear of the decoder layers becomes ``bnb.nn.Linear4bit(compute_dtype, quant_type,
  compress_statistics=double_quant)`` (``load_in_4bit``) or ``bnb.nn.Linear8bitLt(
  has_fp16_weights=False, threshold=6.0)`` (``load_in_8bit``), its weight quantized from the
  trainer's random weights in the param dtype (transformers quantizes the checkpoint's weights
  in the ``dtype`` it loads) by moving a ``Params4bit`` / ``Int8Params`` to the device, as
  bitsandbytes' own examples do; the embedding, norms and LM head stay ``nn.Embedding`` /
  ``nn.Linear`` (transformers skips ``lm_head``);
- ``prepare_model_for_kbit_training`` casts every bf16 / fp16 parameter that is not a
  ``Params4bit`` to fp32: the embedding, norms, LM head (and the trained LM head copy), so the
  residual stream is fp32 and each quantized linear casts its input to the compute dtype and
  its output back (``Linear4bit.forward``).

The compute dtype is the plan's (``bnb_4bit_compute_dtype``): fp32 under ``precision: fp32``,
bf16 under ``bf16`` and ``bf16-master``. Random weights only: nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memplan.specs.plan import Plan

LINEARS = frozenset({"wq", "wk", "wv", "wo", "w1", "w2", "w3"})  # the decoder layers' linears (lora.HF_NAMES)
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig(llm_int8_threshold=6.0): transformers' default


@dataclass(frozen=True)
class QuantConfig:
    """What ``BitsAndBytesConfig`` says for the plan."""

    quant: str  # nf4, fp4 (load_in_4bit, bnb_4bit_quant_type) or int8 (load_in_8bit)
    double_quant: bool  # bnb_4bit_use_double_quant
    compute_dtype: torch.dtype  # bnb_4bit_compute_dtype


def quant_config(plan: Plan) -> QuantConfig | None:
    """The quantization of the plan's base, or None for an unquantized one."""
    if plan.quant == "none":
        return None
    compute = torch.float32 if plan.precision == "fp32" else torch.bfloat16
    return QuantConfig(plan.quant, plan.double_quant, compute)


def _bnb():  # noqa: ANN202 - the bitsandbytes module
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(f"a quantized base needs bitsandbytes (pip install bitsandbytes): {err}") from None
    return bitsandbytes


def quantize_linear(linear: nn.Linear, config: QuantConfig) -> nn.Linear:
    """A bitsandbytes layer holding ``linear``'s weight quantized (and its bias, frozen)."""
    bnb = _bnb()
    weight = linear.weight.detach()
    device = weight.device
    bias = linear.bias is not None
    shape = (linear.in_features, linear.out_features, bias)
    if config.quant == "int8":
        layer = bnb.nn.Linear8bitLt(*shape, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
        # Int8Params quantizes when moved off the host (``_quantize``: int8 rows + fp32 row scales)
        layer.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(device)
    else:
        layer = bnb.nn.Linear4bit(
            *shape,
            compute_dtype=config.compute_dtype,
            compress_statistics=config.double_quant,
            quant_type=config.quant,
            device="meta",
        )
        # Params4bit quantizes on its first move to a device (``_quantize``: packed codes + QuantState)
        layer.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=config.double_quant,
            quant_type=config.quant,
            module=layer,
        ).to(device)
    if bias:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer


def quantize_base(model: nn.Module, config: QuantConfig) -> None:
    """Quantize every decoder-layer linear of ``model`` (a LoRA adapter's ``base`` included),
    then cast every other 16-bit parameter to fp32 (``prepare_model_for_kbit_training``).
    Call once the weights exist (after ``init_weights``): a quantized weight cannot be refilled."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            adapter = name == "base" and _is_adapter(module)
            if type(child) is nn.Linear and (name in LINEARS or adapter):
                setattr(module, name, quantize_linear(child, config))
                if adapter:  # PEFT's lora.Linear4bit clones its base's output; lora.Linear8bitLt does not
                    module.clone_base = config.quant != "int8"
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


def _is_adapter(module: nn.Module) -> bool:
    from memplan.train.lora import LoraLinear

    return isinstance(module, LoraLinear)


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside its quantized weights, neither parameters nor
    buffers (a tracker that counts a module's parameters and buffers misses them): a 4-bit
    weight's ``QuantState`` absmax, code, offset and nested state; an int8 weight's row
    scales ``SCB`` (``CB`` is the weight's own storage)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        candidates: list[object] = []
        if state is not None:
            candidates += [state.absmax, state.code, getattr(state, "offset", None)]
            if getattr(state, "state2", None) is not None:
                candidates += [state.state2.absmax, state.state2.code]
        candidates.append(getattr(weight, "SCB", None))
        lt_state = getattr(module, "state", None)
        candidates += [getattr(lt_state, "SCB", None), getattr(lt_state, "CB", None)]
        for t in candidates:
            if isinstance(t, torch.Tensor):
                found[id(t)] = t
    return list(found.values())
