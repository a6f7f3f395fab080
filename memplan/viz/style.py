"""Colours and labels shared by the HTML page, the SVG and the PNG."""

from __future__ import annotations

from memplan.units import format_bytes

COLORS = {
    "parameters": "#4c72b0",
    "optimizer_states": "#8172b3",
    "gradients": "#dd8452",
    "gathered_params": "#64b5cd",
    "autocast_weights": "#8c8c8c",
    "fp8_weights": "#a6761d",
    "kv_cache": "#937860",
    "activations": "#55a868",
    "retained_outputs": "#b5cf6b",
    "logits_and_loss": "#c44e52",
    "optimizer_temp": "#da8bc3",
    "comm_buffers": "#ccb974",
    "allocator_rounding": "#bbbbbb",
    "unknown": "#999999",
}
CACHED_FREE = "#d9d9d9"  # reserved but not allocated
RESERVED = "#222222"
LIMIT = "#d62728"
PHASE_BANDS = {"build": "#f7f7f7", "forward": "#eef5fb", "backward": "#fbf1ea", "optimizer": "#f3eefa",
               "prefill": "#eef5fb"}  # fmt: skip
EXTRA = ("#17becf", "#bcbd22", "#7f7f7f", "#e377c2", "#9467bd")


def color(category: str, i: int = 0) -> str:
    return COLORS.get(category, EXTRA[i % len(EXTRA)])


def nice(category: str) -> str:
    return category.replace("_", " ")


def gib(n: int) -> str:
    return format_bytes(n, "GiB")


def peak_text(panel) -> str:
    """``peak 20.65 GiB allocated (backward): 3.91 GiB loss.log_softmax (logits and loss), ...``"""
    p = panel.peak
    tensors = ", ".join(
        f"{gib(t.size)} {t.label}" + ("" if t.label == t.category else f" ({nice(t.category)})") for t in p.largest[:3]
    )
    phase = f" in the {p.phase}" if p.phase else ""
    return f"peak {gib(p.allocated)} allocated{phase} (event {p.event}): {tensors}"
