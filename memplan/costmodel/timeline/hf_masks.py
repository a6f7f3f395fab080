"""The boolean attention mask ``masking_utils.sdpa_mask`` builds (transformers 5.23) when it cannot leave the
causal pattern to SDPA's ``is_causal`` (``_ignore_causal_mask_sdpa``: a window the keys reach, masking_utils.py:301).

``sdpa_mask`` without vmap (masking_utils.py:405-520): index aranges over the batch (int64, b), the heads (one)
and the keys and queries (``arange(s)`` plus the offset, int64, s each), then the mask function evaluated on the
broadcast (1, 1, s, s) grid: ``causal_mask_function`` alone is one ``le``; the sliding window's
(``sliding_window_causal_mask_function``: ``and_masks(sliding_window_overlay, causal)``) starts from
``new_ones`` and the window's ``kv_idx > q_idx - window`` (a ``sub`` over the queries, the ``gt`` grid), each
``and`` out of place, then ``le`` and the second ``and``. The result is one (s, s) bool grid expanded over the
batch (a view); the aranges go as ``sdpa_mask`` returns. Sequence of storages observed on CPU
(tests/accuracy/hf_fsdp_steps.py's tracker, Qwen2-MoE; tests/unit/test_timeline_hf_families.py, Gemma 2).
"""

from __future__ import annotations

from memplan.costmodel.timeline.autograd import Tape, Tensor
from memplan.costmodel.timeline.trainer_model import Dims


def sdpa_mask(t: Tape, d: Dims, sliding: bool) -> Tensor:
    """The (s, s) bool mask of ``sdpa_mask``, causal or under a sliding window (module docstring)."""
    square = d.s * d.s
    batch, head = t.new(d.b, 8, "batch_arange"), t.new(1, 8, "head_arange")
    idx = []
    for name in ("kv", "q"):
        ar = t.new(d.s, 8, f"{name}_arange")
        idx.append(t.new(d.s, 8, f"{name}_idx"))
        t.done(ar)
    if sliding:
        one = t.new(1, 1, "new_ones")
        diff = t.new(d.s, 8, "sub")
        gt = t.new(square, 1, "gt")
        t.done(diff)
        window = t.new(square, 1, "and_window")
        t.done(gt, one)
        le = t.new(square, 1, "le")
        allowed = t.new(square, 1, "and_causal")
        t.done(le, window)
    else:
        allowed = t.new(square, 1, "le")
    t.done(batch, head, *idx)
    return allowed
