"""Inference KV cache: memplan's ``kv_cache_bytes`` against the bytes transformers' own DynamicCache
holds on CPU after a prefill and a few decode steps, for a full-attention model (Qwen3), sliding-window
layers (Gemma 3, Gemma 2), chunked layers (Llama 4) and multi-head latent attention (DeepSeek-V2 / V3),
each a tiny random model (family_steps.py) in fp32 and bf16."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_steps import BASE  # noqa: E402
from hf_steps import Case, _model  # noqa: E402

pytestmark = pytest.mark.accuracy

FAMILIES = ["qwen3", "gemma2", "gemma3", "llama4", "deepseek-v2", "deepseek-v3"]


def cache_bytes(cache) -> int:
    """Bytes of the distinct storages the cache's layers hold (a sliding layer's view keeps its whole storage)."""
    storages = {}
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def run_cache(case: Case, prompt: int, generated: int) -> tuple[int, int]:
    """(bytes after the prefill, bytes after ``generated`` one-token decode steps)."""
    model = _model(case).eval()
    torch.manual_seed(2)
    ids = torch.randint(0, case.vocab, (case.batch, prompt))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        after_prefill = cache_bytes(cache)
        peak = after_prefill
        for _ in range(generated):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            peak = max(peak, cache_bytes(cache))
    return after_prefill, peak


def predicted(case: Case, prompt: int, generated: int) -> int:
    from memplan.costmodel.memory import kv_cache_bytes
    from memplan.specs.loader import model_from_data
    from memplan.specs.workload import InferenceWorkload

    model = model_from_data(case.hf_config(), f"{case.name}/config.json", case.name)
    kv = "fp32" if case.dtype == "float32" else "bf16"
    work = InferenceWorkload(batch=case.batch, prompt_tokens=prompt, generated_tokens=generated, kv_dtype=kv)
    return kv_cache_bytes(model, work, 1, range(model.num_layers))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("prompt", "generated"), [(40, 0), (40, 30), (100, 3)])
def test_kv_cache_bytes_match_transformers(name: str, dtype: str, prompt: int, generated: int):
    """Windows of 64 tokens: a prompt inside the window, one that decodes past it, one longer than it."""
    case = dataclasses.replace(next(c for c in BASE if c.name == name), dtype=dtype)
    _, measured = run_cache(case, prompt, generated)
    assert predicted(case, prompt, generated) == measured
