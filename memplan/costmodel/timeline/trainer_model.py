"""The bundled trainer's model (``memplan/train/model.py``) as ops on a byte-level tape.

Each function mirrors the trainer's ``forward`` line by line, including when Python drops a
reference (``tape.done``): a temporary goes when its statement ends, an argument when the
call returns, a local when the frame exits. Sizes come from :class:`Dims` only.

Under tensor parallel (``tensor_parallel.py``) the matmuls and the vocabulary are split and
the residual stream holds ``s / tp`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.costmodel.timeline import ops, qkv_bias
from memplan.costmodel.timeline import precision as prec
from memplan.costmodel.timeline import tensor_parallel as tpar
from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.events import Category
from memplan.records import record
from memplan.specs.model import ModelSpec
from memplan.specs.workload import TrainingWorkload


@record()
class Dims:
    """One rank's shapes (elements) and dtypes (bytes per element)."""

    b: int
    s: int
    h: int
    f: int
    q: int  # heads x head_dim
    kv: int
    heads: int
    head_dim: int
    vocab: int
    layers: int
    tp: int = 1
    sp: bool = True  # sequence parallel (under tp > 1): else the residual stream is replicated
    cd: int = 2  # compute dtype
    pd: int = 4  # parameter dtype
    autocast: bool = False  # bf16-mixed without FSDP: torch.autocast casts at each matmul
    recompute: str = "none"  # none | full | selective | selective-op (recompute.py)
    recompute_layers: int | None = None  # full: the first n layers only
    attention: str = "flash"  # SDPA kernel: flash, math (fp32 GQA on CUDA: precision.py), efficient; eager; triton
    qkv_bias: bool = False  # wq, wk, wv with biases (Qwen2: qkv_bias.py)

    def __init__(
        self,
        b: int,
        s: int,
        h: int,
        f: int,
        q: int,
        kv: int,
        heads: int,
        head_dim: int,
        vocab: int,
        layers: int,
        tp: int = 1,
        sp: bool = True,
        cd: int = 2,
        pd: int = 4,
        autocast: bool = False,
        recompute: str = "none",
        recompute_layers: int | None = None,
        attention: str = "flash",
        qkv_bias: bool = False,
    ) -> None:  # written out: memplan.records
        _set = object.__setattr__
        _set(self, "b", b)
        _set(self, "s", s)
        _set(self, "h", h)
        _set(self, "f", f)
        _set(self, "q", q)
        _set(self, "kv", kv)
        _set(self, "heads", heads)
        _set(self, "head_dim", head_dim)
        _set(self, "vocab", vocab)
        _set(self, "layers", layers)
        _set(self, "tp", tp)
        _set(self, "sp", sp)
        _set(self, "cd", cd)
        _set(self, "pd", pd)
        _set(self, "autocast", autocast)
        _set(self, "recompute", recompute)
        _set(self, "recompute_layers", recompute_layers)
        _set(self, "attention", attention)
        _set(self, "qkv_bias", qkv_bias)

    @classmethod
    def of(cls, model: ModelSpec, workload: TrainingWorkload, **rest: object) -> Dims:
        """The model's and the micro-batch's shapes; ``rest``: the run's parallelism and dtypes."""
        return cls(
            b=workload.micro_batch,
            s=workload.seq_len,
            h=model.hidden_size,
            f=model.ffn_size,
            q=model.q_size,
            kv=model.kv_size,
            heads=model.num_attention_heads,
            head_dim=model.head_size,
            vocab=model.vocab_size,
            layers=model.num_layers,
            qkv_bias=model.qkv_bias,
            **rest,  # type: ignore[arg-type]
        )

    @property
    def tokens(self) -> int:
        return self.b * self.s


LAYER_PARAMS = (
    "attention_norm",
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "ffn_norm",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def layer_param_names(d: Dims) -> tuple[str, ...]:
    """A layer's parameters in module order, relative to ``layers.{i}``: each module's weight,
    and after wq's, wk's and wv's their biases under ``qkv_bias``."""
    names = []
    for name in LAYER_PARAMS:
        names.append(f"{name}.weight")
        if d.qkv_bias and name in qkv_bias.QKV:
            names.append(f"{name}.bias")
    return tuple(names)


def param_shapes(d: Dims, tied: bool) -> dict[str, tuple[int, int]]:
    """Each parameter's local shape (rows, cols) in module order (``model.parameters()``):
    under TP the column-parallel weights split their rows (and so their biases), the
    row-parallel ones (wo, w2) their columns, the embedding and the head the vocabulary; norms
    are replicated. A tied LM head is the embedding (left out)."""
    tp = d.tp
    layer = ((d.h, 1), (d.q // tp, d.h), (d.kv // tp, d.h), (d.kv // tp, d.h), (d.h, d.q // tp))
    layer += ((d.h, 1), (d.f // tp, d.h), (d.h, d.f // tp), (d.f // tp, d.h))
    shapes = dict(zip((f"{name}.weight" for name in LAYER_PARAMS), layer, strict=True))
    shapes.update({f"{name}.bias": (shapes[f"{name}.weight"][0], 1) for name in qkv_bias.QKV})
    names = layer_param_names(d)
    out = {"tok_embeddings.weight": (d.vocab // tp, d.h)}
    for i in range(d.layers):
        out.update({f"layers.{i}.{name}": shapes[name] for name in names})
    out["norm.weight"] = (d.h, 1)
    if not tied:
        out["output.weight"] = (d.vocab // tp, d.h)
    return out


@record(frozen=False)
class Model:
    """The tape, the dims, and where each parameter is: ``weights[name]`` the tensor a matmul
    uses (a parameter, or FSDP2's unsharded copy), ``cache`` the autocast weight casts."""

    tape: Tape
    d: Dims
    weights: dict[str, Tensor]
    cache: dict[str, Tensor] | None = None  # autocast's cache of weight casts (None: no autocast)
    adapter: Callable[[Tensor, Tensor, str], Tensor] | None = None  # LoRA (lora.py): (x, out, weight) -> out
    base: Callable[[Tensor, str, int, str], Tensor | None] | None = None  # a 4-bit linear (quant.py) or None

    def __init__(
        self,
        tape: Tape,
        d: Dims,
        weights: dict[str, Tensor],
        cache: dict[str, Tensor] | None = None,
        adapter: Callable[[Tensor, Tensor, str], Tensor] | None = None,
        base: Callable[[Tensor, str, int, str], Tensor | None] | None = None,
    ) -> None:  # written out: memplan.records
        self.tape = tape
        self.d = d
        self.weights = weights
        self.cache = cache
        self.adapter = adapter
        self.base = base

    # --- helpers -------------------------------------------------------------------------------
    def weight(self, name: str, w: Tensor | None = None) -> Tensor:
        """The weight a matmul uses (``w``, else ``weights[name]``): under autocast its bf16 cast,
        cached for the forward; a frozen one's (LoRA's base) anew at each use (``cached_cast``
        caches leaves that require grad)."""
        w = self.weights[name] if w is None else w
        if self.cache is None:
            return self.tape.alias(w)
        if w.fn is None:
            return ops.to(self.tape, w, 2, f"{name}.autocast", Category.AUTOCAST)
        if name not in self.cache:
            with self.tape.scoped(""):
                self.cache[name] = ops.to(self.tape, w, 2, f"{name}.autocast", Category.AUTOCAST)
        return self.tape.alias(self.cache[name])

    def linear(self, x: Tensor, name: str, out_features: int, tag: str) -> Tensor:
        """``nn.Linear``, or a 4-bit base's ``Linear4bit`` (``base``); under autocast the bias cast
        (``qkv_bias.py``), the weight cast, then the input cast; under LoRA the adapter over the
        output (``LoraLinear``)."""
        t = self.tape
        out = self.base(x, name, out_features, tag) if self.base is not None else None
        if out is None:
            bias = qkv_bias.bias_name(name) if self.d.qkv_bias else None
            b = self.weight(bias) if bias is not None else None
            w = self.weight(name)
            xin = ops.to(t, x, 2, f"{tag}.input_cast") if self.cache is not None else t.alias(x)
            numel = x.numel // (w.numel // out_features) * out_features
            out = ops.linear(t, xin, w, numel, tag) if b is None else qkv_bias.addmm(t, xin, w, b, numel, tag)
            t.done(xin, w, b)
        if self.adapter is not None:
            out = self.adapter(x, out, name)
        return out

    def gather_seq(self, x: Tensor, tag: str) -> Tensor:
        return tpar.gather_seq(self.tape, x, self.d.tp if self.d.sp else 1, self.d.b, tag)

    def scatter_seq(self, x: Tensor, tag: str) -> Tensor:
        if self.d.tp > 1 and not self.d.sp:
            return tpar.all_reduce(self.tape, x, self.d.tp, tag)
        return tpar.scatter_seq(self.tape, x, self.d.tp, tag)

    # --- the block -------------------------------------------------------------------------------
    def rms_norm(self, x: Tensor, name: str) -> Tensor:
        """``RMSNorm.forward``: ``weight * (x32 * rsqrt(x32.pow(2).mean(-1) + eps)).to(dtype)``.
        Under sequence parallel it runs on DTensors after the input's ``.float()``."""
        t = self.tape
        with t.scoped(name):
            x32 = ops.to(t, x, 4, "x_fp32")
            with t.dtensor_ops(self.d.tp > 1 and self.d.sp):
                p = ops.unary(t, x32, "pow", temps=2, save_input=True)
                m = ops.unary(t, p, "mean", out_numel=x.numel // self.d.h)
                t.done(p)
                e = ops.unary(t, m, "add_eps", temps=-1)
                t.done(m)
                r = ops.rsqrt(t, e, "rsqrt")
                t.done(e)
                y = ops.mul(t, x32, r, "normed")
                t.done(r)
                yd = ops.to(t, y, x.itemsize, "normed_cast")
                out = ops.mul(t, self.weights[f"{name}.weight"], yd, "out", over_rows=True)
                t.done(yd, x32, y)  # the temporary, then the frame's locals
        return out

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, tag: str) -> Tensor:
        """``apply_rope``: ``x * cos + cat(-x[..., half:], x[..., :half]) * sin``."""
        t = self.tape
        a = ops.mul(t, x, cos, f"{tag}.cos")
        hi = ops.half_slice(t, x, f"{tag}.hi")
        neg = ops.unary(t, hi, f"{tag}.neg")
        lo = ops.half_slice(t, x, f"{tag}.lo")
        rot = ops.cat(t, neg, lo, f"{tag}.rotate_half")
        t.done(neg, lo, hi)
        b = ops.mul(t, rot, sin, f"{tag}.sin")
        t.done(rot)
        out = ops.add(t, a, b, tag)
        out.transposed = x.transposed  # TensorIterator keeps x's (heads-major over token-major) layout
        t.done(a, b)
        return out

    def projection(self, x: Tensor, name: str, out_features: int, tag: str, roped: bool) -> Tensor:
        """``self.wq(x).view(b, s, -1, hd).transpose(1, 2)``: the linear output lives on as the
        view. Its input under TP is a Replicate DTensor, and so is its dX."""
        with self.tape.dtensor_ops(self.d.tp > 1):
            y = self.linear(x, name, out_features, tag)
        v = ops.heads_view(self.tape, y, f"{tag}_heads", roped)
        self.tape.done(y)
        return v

    def core(self, q: Tensor, k: Tensor, v: Tensor, autocast: bool) -> Tensor:
        """SDPA (flash, or the math path: ``precision.math_sdpa``) or eager attention; under
        ``autocast`` (the forward's state, which a selective checkpoint's re-run restores) k and
        q are cast to bf16 first (traces: k, then q)."""
        t, d = self.tape, self.d
        if d.attention == "math":
            return prec.math_sdpa(t, q, k, v, d.b, d.heads // d.tp, d.s)
        # the other kernels' modules only for the plans that run them: the estimate imports what it uses
        if d.attention == "eager":  # attention: eager (eager.py)
            from memplan.costmodel.timeline import eager

            return eager.attention(t, q, k, v, d.b, d.heads // d.tp, d.s, autocast)
        if d.attention == "efficient":  # fp32 without GQA on CUDA (mem_efficient.py)
            from memplan.costmodel.timeline import mem_efficient

            return mem_efficient.sdpa(t, q, k, v, d.b, d.heads // d.tp, d.s, d.head_dim)
        if d.attention == "triton":  # memplan's Triton FlashAttention-2 (triton_attention.py)
            from memplan.costmodel.timeline import triton_attention

            return triton_attention.attention(t, q, k, v, d.b * d.heads // d.tp * d.s, (d.head_dim, d.s), autocast)
        k2 = ops.to(t, k, 2, "k_cast") if autocast else t.alias(k)
        q2 = ops.to(t, q, 2, "q_cast") if autocast else t.alias(q)
        out = ops.sdpa(t, q2, k2, v, d.b * d.heads // d.tp * d.s, "sdpa")
        t.done(k2, q2)
        return out

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, prefix: str) -> Tensor:
        """``Attention.forward`` on the norm output ``x`` (sequence-gathered under TP)."""
        t, d = self.tape, self.d
        with t.scoped(f"{prefix}.attention"):
            xg = self.gather_seq(x, "input")
            q = self.projection(xg, f"{prefix}.attention.wq.weight", d.q // d.tp, "wq", True)
            k = self.projection(xg, f"{prefix}.attention.wk.weight", d.kv // d.tp, "wk", True)
            # dv comes heads-major from the math and eager paths (their sum over the groups): a copy
            copied = d.attention in ("math", "eager")
            v = self.projection(xg, f"{prefix}.attention.wv.weight", d.kv // d.tp, "wv", copied)
            qr, kr = self.rope(q, cos, sin, "q_rope"), self.rope(k, cos, sin, "k_rope")
            t.done(k, q)  # `q, k = ...` stores k first (CPython 3.11: STORE_FAST k, STORE_FAST q)
            if d.recompute == "selective":
                autocast = self.cache is not None
                out = t.checkpoint(lambda: self.core(qr, kr, v, autocast), [qr, kr, v])
            else:
                out = self.core(qr, kr, v, self.cache is not None)
            # the reshape of out.transpose(1, 2) is a view of flash's output, a copy of math's and eager's
            flat = prec.merge_heads(t, out) if d.attention in ("math", "eager") else t.alias(out)
            y = self.linear(flat, f"{prefix}.attention.wo.weight", d.h, "wo")
            t.done(flat)
            ys = self.scatter_seq(y, "wo")  # RowwiseParallel's output hook, inside wo's call
            t.done(y)
            t.done(qr, kr, v, out, xg)  # the frame's locals (x: the gathered input)
        return ys

    def mlp(self, x: Tensor, prefix: str) -> Tensor:
        """``FeedForward.forward``: ``w2(silu(w1(x)) * w3(x))``."""
        t, d = self.tape, self.d
        with t.scoped(f"{prefix}.feed_forward"):
            xg = self.gather_seq(x, "input")
            with t.dtensor_ops(d.tp > 1):
                a1 = self.linear(xg, f"{prefix}.feed_forward.w1.weight", d.f // d.tp, "w1")
            s1 = ops.unary(t, a1, "silu", save_input=True)
            t.done(a1)
            with t.dtensor_ops(d.tp > 1):
                a3 = self.linear(xg, f"{prefix}.feed_forward.w3.weight", d.f // d.tp, "w3")
            m = ops.mul(t, s1, a3, "gate")
            t.done(s1, a3)
            y = self.linear(m, f"{prefix}.feed_forward.w2.weight", d.h, "w2")
            ys = self.scatter_seq(y, "w2")
            t.done(y)
            t.done(m, xg)
        return ys

    def block(self, x: Tensor, cos: Tensor, sin: Tensor, i: int) -> Tensor:
        """``Block.forward``: ``h = x + attn(norm(x)); return h + ffn(norm(h))``."""
        t, prefix = self.tape, f"layers.{i}"
        with t.scoped(prefix):
            n1 = self.rms_norm(x, f"{prefix}.attention_norm")
            a = self.attention(n1, cos, sin, prefix)
            t.done(n1)
            h = ops.add(t, x, a, "residual_attention")
            t.done(a)
            n2 = self.rms_norm(h, f"{prefix}.ffn_norm")
            m = self.mlp(n2, prefix)
            t.done(n2)
            out = ops.add(t, h, m, "residual_ffn")
            t.done(m, h)
        return out

    # --- embedding, head, loss -----------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        """``tok_embeddings(ids)`` (fp32 under autocast: nn.Embedding is not autocast); under TP
        the vocabulary-parallel lookup (``RowwiseParallel``: masks, a partial (b, s, h) output
        reduce-scattered to the sequence shard)."""
        t, d = self.tape, self.d
        w = self.weights["tok_embeddings.weight"]
        with t.scoped("tok_embeddings"):
            if d.tp == 1:
                return ops.embedding(t, ids, w, d.tokens * d.h, "embedding")
            return tpar.vocab_embedding(t, ids, w, d.tokens, d.h, d.tp, d.sp)

    def rope_tables(self, itemsize: int) -> tuple[Tensor, Tensor]:
        """``rope_tables``: inverse frequencies (hd/2 fp32, a few temporaries), the angles
        (s x hd/2, then cat to s x hd, fp32), cos and sin cast to the hidden states' dtype
        (kept fp32 under autocast: the embedding output is fp32)."""
        t, d = self.tape, self.d
        half, table = d.head_dim // 2, d.s * d.head_dim
        with t.scoped("rope"):
            ar, ex = t.new(half, 4, "arange"), t.new(half, 4, "exponent")
            t.done(ar)
            pw, one = t.new(half, 4, "theta_pow"), t.new(1, 8, "scalar")
            t.done(one, ex)
            tmp, inv = t.new(half, 4, "reciprocal_tmp"), t.new(half, 4, "inv_freq")
            t.done(tmp, pw)
            pos, ang = t.new(d.s, 4, "positions"), t.new(d.s * half, 4, "angles")
            t.done(pos)
            both = t.new(table, 4, "angles_cat")
            t.done(ang)
            tables = []
            for name in ("cos", "sin"):
                t32 = t.new(table, 4, f"{name}_fp32")
                tables.append(ops.to(t, t32, itemsize, name))
                t.done(t32)
            t.done(inv, both)
        return tables[0], tables[1]

    def head(self, x: Tensor) -> Tensor:
        """``self.output(self.norm(h))``: the final norm, then the LM head (vocabulary-sharded
        under TP, its input sequence-gathered first)."""
        t, d = self.tape, self.d
        n = self.rms_norm(x, "norm")
        with t.scoped("output"):
            ng = self.gather_seq(n, "input")
            with t.dtensor_ops(d.tp > 1):  # ColwiseParallel over the vocabulary: a DTensor weight (and cast)
                logits = self.linear(ng, "output.weight", d.vocab // d.tp, "logits")
        t.done(ng, n)
        return logits

    def loss(self, logits: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``loss_fn(logits, labels) / m``: ``.float()`` of the (b s, V) logits, log_softmax
        (saved), nll_loss (saving the ``labels``), the division by m (a 4-byte loss). Returns
        the loss and the 4-byte scalar the step keeps beside it until ``del loss``."""
        t, d = self.tape, self.d
        with t.scoped("loss"):
            if d.tp > 1:
                nll, weight = tpar.loss_parallel(t, logits, d.tokens, d.vocab // d.tp)
            else:
                f = ops.to(t, logits, 4, "logits_fp32", Category.LOGITS)
                ls = ops.log_softmax(t, f)
                nll, weight = ops.nll_loss(t, ls, labels)
                t.done(f, ls, logits)
            loss = ops.unary(t, nll, "div_accumulation", temps=-1)
            t.done(nll, weight)
            return loss, t.new(1, 4, "loss_scalar")
