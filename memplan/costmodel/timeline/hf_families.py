"""The decoder families beyond Llama's layout in the op-level run of ``transformers.Trainer``.

Each family is :class:`~memplan.costmodel.timeline.hf_model.HfLlama` with the methods its
``transformers/models/<family>/modeling_<family>.py`` (transformers 5.x) writes differently, and its
layer's parameters in ``named_parameters()`` order (module registration order). Checked on CPU
against the real Trainer (tests/unit/test_timeline_hf_families.py):

- Qwen3 (``modeling_qwen3.py``): ``q_norm`` / ``k_norm``, a ``Qwen3RMSNorm`` over each head's
  ``head_dim`` on ``q_proj(x).view(b, s, heads, head_dim)`` before the transpose.
"""

from __future__ import annotations

from memplan.costmodel.timeline import ops
from memplan.costmodel.timeline.autograd import Tensor
from memplan.costmodel.timeline.hf_model import LAYER_PARAMS, HfLlama

QWEN3_PARAMS = (
    *LAYER_PARAMS[:4],
    ("self_attn.q_norm", "hd", "1"),
    ("self_attn.k_norm", "hd", "1"),
    *LAYER_PARAMS[4:],
)


class HfQwen3(HfLlama):
    """``Qwen3ForCausalLM``: Llama's layer with a per-head RMSNorm on the queries and keys."""

    def projection(self, x: Tensor, name: str, out_features: int, tag: str, copy_grad: bool) -> Tensor:
        """``self.q_norm(self.q_proj(x).view(hidden_shape)).transpose(1, 2)`` (k likewise; v as Llama)."""
        if tag == "v_proj":
            return super().projection(x, name, out_features, tag, copy_grad)
        t = self.tape
        y = self.linear(x, name, out_features, tag)
        v = ops.heads_view(t, y, f"{tag}_view", copy_grad)
        t.done(y)
        n = self.rms_norm(v, name.replace("_proj", "_norm"), rows=self.d.tokens * out_features // self.d.head_dim)
        t.done(v)
        out = ops.heads_view(t, n, f"{tag}_heads", copy_grad=False)
        t.done(n)
        return out


FAMILIES: dict[str, tuple[type[HfLlama], tuple]] = {
    "llama": (HfLlama, LAYER_PARAMS),
    "mistral": (HfLlama, LAYER_PARAMS),
    "qwen2": (HfLlama, LAYER_PARAMS),
    "qwen3": (HfQwen3, QWEN3_PARAMS),
}


def family(name: str) -> tuple[type[HfLlama], tuple]:
    """The model class and the layer's parameters (name, rows, cols) of a family the run models."""
    return FAMILIES[name]
