"""Inference prefill: memplan's prefill activations (``costmodel/inference.py``) against what a real
transformers forward holds on CPU beyond its weights and KV cache, for the whole batch's prompts in
one forward and in chunks (chunked prefill: each forward runs ``per_row`` tokens of every sequence
against a DynamicCache holding the prefix, as ``InferenceWorkload.prefill_chunk = per_row x batch``).

Each case is a tiny random model (hf_steps / family_steps) under ``torch.no_grad`` with
``logits_to_keep=1`` and the last token's logits copied to fp32, as ``generate`` does. The peak is
counted by storage_tracker.StorageTracker (MemTracker's accounting); the weights and the input ids
are tracked before the forward and the cache's storages at the end are subtracted, so what is
compared is the transient working set alone. The moment each case peaks at is measured too, from
where the run was when its peak last rose (the modules it was inside, by forward hooks, and the
cache's ``update``; ``moment_of``), and memplan's moment is held against it; each case names the
moment its run peaks at, so every moment of the model (MLP, attention over a cached prefix, cache
growth, logits) is measured.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_steps import BASE  # noqa: E402
from hf_steps import Case, _model  # noqa: E402
from storage_tracker import StorageTracker  # noqa: E402

pytestmark = pytest.mark.accuracy

TOLERANCE = 0.03

LLAMA = dict(hidden=256, heads=4, ffn=688, vocab=2000, batch=2, layers=2)
GQA = Case("llama-gqa", kv_heads=2, **LLAMA)
MHA = Case("llama-mha", kv_heads=4, **LLAMA)
VOCAB = Case("llama-vocab", hidden=128, heads=4, kv_heads=2, ffn=344, vocab=32000, batch=4, layers=2)


def _family(name: str, **changes) -> Case:
    return dataclasses.replace(next(c for c in BASE if c.name == name), **changes)


BF16 = "bfloat16"
# (case, prompt tokens per sequence, tokens per sequence per forward, the moment the run peaks at)
CASES = [
    (GQA, 256, 256, "mlp"),
    (dataclasses.replace(GQA, dtype=BF16), 256, 256, "mlp"),
    (GQA, 256, 64, "attention"),  # repeat_kv copies the cached prefix for every query head
    (dataclasses.replace(GQA, dtype=BF16), 256, 32, "attention"),
    (MHA, 256, 64, "mlp"),  # no copies without GQA
    (MHA, 256, 32, "cache growth"),  # the old values beside the new ones in torch.cat
    (dataclasses.replace(MHA, dtype=BF16), 256, 32, "cache growth"),
    (VOCAB, 16, 16, "logits"),
    (VOCAB, 64, 16, "logits"),
    (_family("qwen3"), 128, 128, "mlp"),
    (_family("qwen3"), 128, 32, "attention"),
    (_family("olmo2"), 128, 128, "mlp"),  # post-norm: the MLP reads the residual itself
    (_family("olmo2"), 128, 32, "attention"),
    (_family("olmo2", kv_heads=4), 128, 16, "cache growth"),
    (_family("phi3"), 128, 128, "mlp"),  # fused gate_up: its output beside act and product
    (_family("phi3"), 128, 32, "attention"),  # fused qkv: q, k, v are views of one output
    (_family("phi3", kv_heads=4), 128, 16, "cache growth"),
    # sliding layers: a whole prompt reaching the window is masked; a chunk attends to window - 1 + chunk keys
    (_family("gemma3"), 128, 128, "mlp"),
    (_family("gemma3"), 128, 32, "mlp"),  # -0.7%: the full-attention mask Gemma 3 builds with no full layer
    (_family("gemma3", layers=6), 256, 32, "attention"),  # -1.0%, -1.8%: a RoPE table per attention kind
    (_family("gemma3", layers=6, kv_heads=4), 256, 32, "cache growth"),
]


class PeakPlace(StorageTracker):
    """StorageTracker that also notes where the run was when its peak last rose: the modules the
    forward was inside (forward pre/post hooks, which hold no tensor) and the op that allocated."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.at: tuple[tuple[str, ...], str] = ((), "")
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda _m, _a, name=name: self.stack.append(name))
            module.register_forward_hook(self._leave)  # a hook returning something replaces the output

    def _leave(self, _module, _args, _out) -> None:  # type: ignore[no-untyped-def]
        self.stack.pop()

    def within(self, name: str, fn):  # type: ignore[no-untyped-def]
        """``fn`` noting ``name`` on the stack while it runs (the cache's ``update``)."""

        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.at = (tuple(self.stack), func.__name__)
        return out


def moment_of(modules: tuple[str, ...], op: str) -> str:
    """The moment a measured peak is at, read from where the run was (not from memplan): inside an
    MLP; inside the cache's ``update`` (``DynamicLayer.update`` concatenating onto the prefix);
    elsewhere inside attention; in the LM head, or after the model returned (the fp32 copy of the
    logits): the logits."""
    inner = [m.rsplit(".", 1)[-1] for m in modules]
    if "mlp" in inner:
        return "mlp"
    if "self_attn" in inner:
        return "cache growth" if "cache_update" in inner else "attention"
    if not modules or inner[-1] == "lm_head":
        return "logits"
    return f"elsewhere ({modules[-1]}: {op})"


@functools.cache
def measure(case: Case, prompt: int, per_row: int) -> tuple[int, str]:
    """Peak bytes beyond the weights, the input ids and the final KV cache over a prefill of
    ``prompt`` tokens per sequence, ``per_row`` tokens of each sequence per forward, and the moment
    of the forward the peak was at (``moment_of``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what is allocated does not depend on it; on a busy 2-core machine 2 threads spin 30x
    try:
        return _measure(case, prompt, per_row)
    finally:
        torch.set_num_threads(threads)


def _measure(case: Case, prompt: int, per_row: int) -> tuple[int, str]:
    from transformers import DynamicCache

    model = _model(case).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.batch, prompt))
    tracker = PeakPlace(model)
    tracker.track_module(model)
    tracker.track(ids)
    before = tracker.current
    cache = DynamicCache(config=model.config)
    cache.update = tracker.within("cache_update", cache.update)  # attention calls past_key_values.update
    with torch.no_grad(), tracker:
        for start in range(0, prompt, per_row):
            out = model(input_ids=ids[:, start : start + per_row], past_key_values=cache, logits_to_keep=1)
            if start + per_row >= prompt:
                logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # as generate does
            del out
    del logits
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in cache.layers
                for t in (layer.keys, layer.values)}  # fmt: skip
    return tracker.peak - before - sum(storages.values()), moment_of(*tracker.at)


def predict(case: Case, prompt: int, per_row: int) -> tuple[int, str]:
    """memplan's prefill activations and the moment they peak at for the same run."""
    from memplan.costmodel.memory import estimate_inference
    from memplan.specs.loader import model_from_data
    from memplan.specs.plan import Plan
    from memplan.specs.workload import InferenceWorkload

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    fp32 = case.dtype == "float32"
    work = InferenceWorkload(
        batch=case.batch,
        prompt_tokens=prompt,
        generated_tokens=0,
        kv_dtype="fp32" if fp32 else "bf16",
        prefill_chunk=None if per_row >= prompt else per_row * case.batch,
    )
    report = estimate_inference(model, work, Plan(precision="fp32" if fp32 else "bf16"))
    assert report.prefill is not None
    return report.activations.total, report.prefill.moment


@pytest.mark.parametrize(
    ("case", "prompt", "per_row", "moment"),
    CASES,
    ids=[f"{c.name}-{c.dtype}-{p}-{r}" for c, p, r, _ in CASES],
)
def test_prefill_activations_match_transformers(case: Case, prompt: int, per_row: int, moment: str):
    measured, measured_at = measure(case, prompt, per_row)
    predicted, at = predict(case, prompt, per_row)
    assert measured_at == moment  # the run peaks at the moment the case is there to cover
    assert at == measured_at
    assert predicted == pytest.approx(measured, rel=TOLERANCE), f"predicted {predicted:,} measured {measured:,}"


def test_chunks_shrink_the_working_set_as_predicted():
    """The same prompts in one forward and in chunks of 32 tokens per sequence: measured and
    predicted fall by the same factor (7.4x for this MHA Llama in fp32)."""
    whole, chunked = measure(MHA, 256, 256)[0], measure(MHA, 256, 32)[0]
    assert chunked < whole / 7
    assert predict(MHA, 256, 256)[0] / predict(MHA, 256, 32)[0] == pytest.approx(whole / chunked, rel=TOLERANCE)
