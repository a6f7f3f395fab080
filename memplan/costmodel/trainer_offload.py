"""Activation offload to CPU in the bundled trainer (``--runtime memplan``, ``offload_activations: cpu``).

The trainer runs ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each micro-batch's
forward and loss (memplan.train.offload): every tensor autograd saves there is copied to pinned
host memory, once per save (a tensor two ops save is copied twice), parameters included, and
copied back, contiguous, when its node runs in the backward; the copy dies with the node. So
the device keeps nothing of the layers through the forward, and the host holds the sum of
every save. With ``recompute: full`` the checkpointed layers' saves go to the checkpoint's
own hooks (the innermost win), but the checkpoint saves the layer's tensor inputs for its
recomputation (``_NoopSaveInputs``) under the outer hooks: the layer input and RoPE's cos and
sin go to the host as well.

Every figure was counted save by save on the trainer's model (a pack hook listing shapes and
dtypes) and matches the measured host bytes exactly for fp32, bf16 and bf16-mixed, recompute
none and full (docs/cost-model.md, "Activation offload in the bundled trainer"). The trainer
runs offload on one tensor-parallel rank without pipeline or FSDP2 (validate.support), so
these assume t = 1 and a whole model on the rank. Standard library only.
"""

from __future__ import annotations

from memplan.costmodel.activations import Shape
from memplan.specs.plan import Plan


def unmodelled(plan: Plan) -> str | None:
    """Why the bundled trainer's offload is neither run nor modelled for ``plan`` (one line, to
    follow ``offload_activations: ``), or None: it is measured on one tensor-parallel rank
    without pipeline, context parallel or FSDP2, with recomputation none or full over every
    layer (full: without autocast), in full training, with SDPA attention in fp32, bf16,
    bf16-master or bf16-mixed (validate.support and the memory model refuse the same plans)."""
    blocked = [
        (plan.tp > 1, "tensor parallel (DTensor saved tensors); use tp 1"),
        (plan.pp > 1, "pipeline parallel (each stage's micro-batches); use pp 1"),
        (plan.cp > 1, "context parallel; use cp 1"),
        (plan.zero >= 2 and plan.dp > 1, "FSDP2 (zero 2 or 3 with dp > 1); use zero 0 or 1"),
        (plan.recompute not in ("none", "full"), f"recompute {plan.recompute}; use none or full"),
        (plan.recompute_layers is not None, "recompute_layers (part of the layers checkpointed); leave it unset"),
        (
            plan.recompute == "full" and plan.precision == "bf16-mixed",
            "recompute full under autocast (bf16-mixed); use fp32, bf16 or bf16-master, or recompute none",
        ),
        (plan.finetune != "full", f"finetune {plan.finetune}; use finetune full"),
        (plan.attention != "flash", f"attention {plan.attention} (its saves are not counted); use flash"),
        (plan.precision in ("fp8", "fp16-master"), f"precision {plan.precision}; use fp32, bf16, bf16-mixed"),
    ]
    return next((f"the bundled trainer does not offload with {what}" for hit, what in blocked if hit), None)


def unmodelled_accumulation(plan: Plan, accumulation: int) -> str | None:
    """Gradient accumulation over data parallel (DDP's ``no_sync`` micro-batches, ZeRO-1) with
    offload: measured 3.1% (DDP) and 3.8% (ZeRO-1) above the model's backward at 2 micro-batches
    and not followed yet; one rank accumulating, or data parallel without accumulation, is."""
    if plan.dp > 1 and accumulation > 1:
        return (
            "the bundled trainer's offload is not modelled with gradient accumulation over data parallel "
            f"(dp {plan.dp}, {accumulation} micro-batches); raise micro_batch or leave global_batch at micro_batch x dp"
        )
    return None


def residual_bytes(x: Shape) -> int:
    """Bytes of the residual stream (and of RoPE's tables): fp32 under autocast, else the
    model's dtype."""
    return 4 if x.autocast else x.d


def norm_saves(x: Shape) -> int:
    """One trainer RMSNorm (``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``) for one
    micro-batch: ``pow`` and ``mul`` each save the fp32 input (2 x 4h), ``rsqrt`` its result and
    ``mul`` the same rsqrt (2 x 4 bytes a token), the weight ``mul`` the normalised value in
    the residual dtype (r h). The weight is counted with the layer's weights."""
    h = x.model.hidden_size
    return x.tokens * (8 * h + 8 + residual_bytes(x) * h)


def layer_saves(x: Shape) -> int:
    """Every tensor one trainer layer saves (memplan.train.model.Block, flash SDPA), counted once
    per save, without weights: two norms (:func:`norm_saves`); the q, k and v matmuls each save
    the normalised input (3 d h); RoPE saves cos and sin for q and for k (4 s hd r: the tables
    do not require grad, so neither is q or k); SDPA saves q, k, v, its output (d (2q + 2kv))
    and the fp32 log-sum-exp (4 a head); the output projection its input (d q); the gate and
    up matmuls the normalised input (2 d h); SiLU its input, the product SiLU's output and the
    up output, the down matmul the product (4 d f)."""
    m, d = x.model, x.d
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_size
    per_token = 3 * d * h + d * (2 * q + 2 * kv) + 4 * m.num_attention_heads + d * q + 2 * d * h + 4 * d * f
    rope = 4 * x.s * m.head_size * residual_bytes(x)
    return 2 * norm_saves(x) + x.tokens * per_token + rope


def checkpoint_input_saves(x: Shape) -> int:
    """What a fully recomputed layer saves under the outer hooks: its tensor inputs, which
    non-reentrant ``torch.utils.checkpoint`` saves for the recomputation: the layer input
    (r h a token) and RoPE's cos and sin (2 s hd r)."""
    r = residual_bytes(x)
    return x.tokens * r * x.model.hidden_size + 2 * x.s * x.model.head_size * r


def layer_weight_saves(x: Shape, param_bytes: int) -> int:
    """The weights one layer's forward saves: the seven matrices (their bf16 casts under
    autocast, d bytes; else the parameters, ``param_bytes``) and the two norm weights, which
    autocast leaves in the parameter dtype. Biases are not saved."""
    m = x.model
    h = m.hidden_size
    matrices = h * (m.q_size + 2 * m.kv_size) + m.q_size * h + 3 * h * m.ffn_size
    return matrices * (x.d if x.autocast else param_bytes) + 2 * h * param_bytes


def head_saves(x: Shape, vocab: int, param_bytes: int) -> int:
    """The last stage's saves after the layers and the first stage's embedding: the final norm
    (:func:`norm_saves` and its weight), the LM head's input (d h) and weight (V h, its cast
    under autocast), log_softmax's fp32 output saved by log_softmax and again by nll_loss
    (2 x 4 V), nll_loss's int64 target and 4-byte total weight; the embedding's int64 ids."""
    h = x.model.hidden_size
    head_weight = vocab * h * (x.d if x.autocast else param_bytes)
    per_token = x.d * h + 2 * 4 * vocab + 8 + 8  # head input, log_softmax output twice, target, ids
    return norm_saves(x) + h * param_bytes + head_weight + x.tokens * per_token + 4


def host_bytes(x: Shape, vocab: int, layers: int, param_bytes: int, recompute: str) -> int:
    """Pinned host bytes of one micro-batch (the whole model on one rank): every save of the
    forward and the loss (recompute ``none``), or the checkpointed layers' inputs instead of
    their saves (``full``)."""
    if recompute == "full":
        per_layer = checkpoint_input_saves(x)
    else:
        per_layer = layer_saves(x) + layer_weight_saves(x, param_bytes)
    return layers * per_layer + head_saves(x, vocab, param_bytes)


def mlp_forward_bytes(x: Shape, layer_copies: int = 0) -> int:
    """What is alive at the forward's widest moment inside the last layer once its saves are on
    the host, beside the token ids and labels: the layer input, the attention residual and the
    MLP's normalised input (3 r h), RoPE's tables (2 s hd r), and either the product's moment
    (SiLU output, up output and product, 3 d f) or the down projection's (product and output,
    d f + d h). Under autocast its cache holds every layer's weight casts (``layer_copies``), the
    down projection's of the last layer from its moment on (measured on CPU to the byte: the
    product's moment in fp32 and bf16, the down projection's under bf16-mixed)."""
    m = x.model
    r, d, h, f = residual_bytes(x), x.d, m.hidden_size, m.ffn_size
    alive = x.tokens * 3 * r * h + 2 * x.s * m.head_size * r
    down_copy = h * f * d if layer_copies else 0
    product = x.tokens * 3 * d * f + layer_copies - down_copy
    down = x.tokens * (d * f + d * h) + layer_copies
    return alive + max(product, down)


def norm_backward_bytes(x: Shape) -> int:
    """Beside every gradient but the embedding's, at the first layer's first norm's backward (its
    ``pow`` node): the gradient of the layer input so far (r h), the fp32 gradients of the upcast
    from ``mul`` and from ``mean`` (2 x 4h), the upcast's copy back from the host (4h) and the
    ``pow`` backward's three fp32 temporaries (3 x 4h). Measured: the backward's peak under
    bf16-mixed at 64 tokens and a 256-word vocabulary, to the byte."""
    return x.tokens * x.model.hidden_size * (5 * 4 + residual_bytes(x))


def embedding_backward_bytes(x: Shape) -> int:
    """Beside every gradient, at the embedding's backward (the step's last node): the incoming
    gradient of the embedding's output (d h a token; r under autocast) and the ids' copy back
    from the host (8 a token); the embedding's own gradient is being made (measured: bf16,
    4 layers, the backward's peak within 0.001%)."""
    return x.tokens * (residual_bytes(x) * x.model.hidden_size + 8)


def recomputed_layer_saves(x: Shape) -> int:
    """What a fully recomputed trainer layer holds once its recomputation has run, each storage
    once (the checkpoint keeps its saves on the device): each norm's fp32 input or upcast (4h;
    the first norm's is the layer input itself in fp32, counted with the checkpoint's inputs),
    rsqrt (4), normalised value (r h) and output (d h); SDPA's q, k, v, output (which the output
    projection saves as its input: the same storage) and log-sum-exp; the MLP's four d f.
    Without autocast (the trainer refuses offload with recompute full under autocast)."""
    m, d, r = x.model, x.d, residual_bytes(x)
    h = m.hidden_size
    inputs = (4 * h if d < 4 else 0) + 4 * h
    per_token = inputs + 2 * (4 + r * h + d * h) + d * (2 * m.q_size + 2 * m.kv_size) + 4 * m.num_attention_heads
    return x.tokens * (per_token + 4 * d * m.ffn_size)


def mlp_backward(x: Shape, weight_copy_bytes: int, grad_bytes: int, recomputed: bool) -> tuple[int, int]:
    """(weight gradients made, bytes held) at the widest node of a layer's MLP backward, node by
    node (down, product, up, SiLU, gate: the reverse of the forward), beside the gradients made
    before the layer and the layer's incoming gradient. Offloaded, each node copies its saves
    back from the host (A = d f a token, X = d h) and its weight (``weight_copy_bytes`` each)
    and frees them when it has run; recomputed, the saves are the layer's own
    (:func:`recomputed_layer_saves`, freed as their last node runs) and the weights are the
    parameters. Each mm makes its weight gradient (W, in d bytes) before its input gradient;
    under autocast the weight cast's node then makes the fp32 gradient (w) while W is alive.
    Measured: the product's node is the widest in fp32 at 128 tokens (5A), the gate's in bf16
    at 64 (A + 3X + 2w and the weight's copy), to the byte."""
    m, t = x.model, x.tokens
    a, xb = t * x.d * m.ffn_size, t * x.d * m.hidden_size
    w = m.hidden_size * m.ffn_size * grad_bytes
    mm = m.hidden_size * m.ffn_size * x.d if x.autocast else w  # the mm's weight gradient
    back = 0 if recomputed else 1  # a node's saves come back as copies
    wc = 0 if recomputed else weight_copy_bytes
    saves = recomputed_layer_saves(x) if recomputed else 0
    done = a if recomputed else 0  # a recomputed save freed once its last node has run
    nodes = [  # (saves still held, what the node holds, weight gradients made before it)
        (saves, back * a + wc + mm + a, 0),  # down: product back, its weight, dW, d(product)
        (saves - done, a + back * 2 * a + 2 * a, w),  # product: d(product), SiLU out and up back, their grads
        (saves - 3 * done, 2 * a + back * xb + wc + mm + xb, w),  # up: the two grads, its input back, dW, dX
        (saves - 3 * done, a + xb + back * a + a, 2 * w),  # SiLU: d(SiLU out), dX so far, gate out back, its grad
        (saves - 4 * done, a + xb + back * xb + wc + mm + xb, 2 * w),  # gate: d(gate out), dX, input back, dW, dX
    ]
    if x.autocast:  # the casts of the up's and the gate's weight gradients (the down's is narrower)
        nodes += [(saves - 3 * done, a + xb + mm + w, w), (saves - 4 * done, 2 * xb + mm + w, 2 * w)]
    made, held = max(((made, kept + held) for kept, held, made in nodes), key=sum)
    return made, held
