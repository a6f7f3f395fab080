"""Inference prefill: whole prompts or chunks (``--prefill-chunk``), what the report calls the prefill
activations, vLLM's default budget, and bad input. The figures are measured on CPU in
tests/accuracy/test_prefill_accuracy.py; these pin the wiring on the bundled profiles."""

from __future__ import annotations

import json

import pytest
import yaml

from memplan.cli.app import run
from memplan.costmodel.inference import prefill_forward, vllm_default_chunk
from memplan.costmodel.memory import estimate_inference
from memplan.specs.loader import load_model
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload

GiB = 2**30
LLAMA70 = load_model("llama3-70b")  # h 8192, f 28672, 64 heads of 128, 8 KV heads, vocab 128256
ISSUE = dict(batch=8, prompt_tokens=32768, generated_tokens=0)  # issue 20: --batch 8 --context 32768


def _report(**work):
    return estimate_inference(LLAMA70, InferenceWorkload(**{**ISSUE, **work}), Plan(precision="bf16"))


def test_forward_shapes():
    whole = prefill_forward(InferenceWorkload(**ISSUE))
    assert (whole.tokens, whole.rows, whole.queries, whole.keys, whole.chunked) == (262144, 8, 32768, 32768, False)
    assert not prefill_forward(InferenceWorkload(**ISSUE, prefill_chunk=262144)).chunked  # the batch fits one chunk
    paged = prefill_forward(InferenceWorkload(**ISSUE, prefill_chunk=8192, block_size=16))
    assert (paged.tokens, paged.rows, paged.queries, paged.chunked) == (8192, 8, 1024, True)
    # a contiguous cache runs every row alike: ceil(1000 / 8) = 125 tokens each
    contiguous = prefill_forward(InferenceWorkload(**ISSUE, prefill_chunk=1000))
    assert (contiguous.tokens, contiguous.queries) == (1000, 125)
    few = prefill_forward(InferenceWorkload(**ISSUE, prefill_chunk=3, block_size=16))
    assert (few.tokens, few.rows, few.queries) == (3, 3, 1)


def test_whole_prompt_is_one_layers_mlp_not_the_sum_of_every_tensor():
    """The issue's 59 GiB summed attention and MLP tensors that are never live together; the peak is
    the MLP of a layer after the first: 4 h + 3 f per token, plus RoPE's cos / sin and positions."""
    report = _report()
    tokens, d = 8 * 32768, 2
    assert report.activations.total == tokens * d * (4 * 8192 + 3 * 28672) + 2 * 32768 * 128 * d + 8 * 32768
    assert report.activations.total / GiB == pytest.approx(58.02, abs=0.01)
    assert report.prefill is not None and report.prefill.moment == "mlp" and report.prefill.tokens == tokens
    assert report.activations.per_layer == report.activations.total  # one forward's working set, not per layer


def test_chunked_prefill_scales_with_the_chunk_and_keeps_the_whole_cache():
    whole = _report()
    paged = _report(prefill_chunk=8192, block_size=16)
    queries = 8192 // 8
    assert paged.activations.total == 8192 * 2 * (4 * 8192 + 3 * 28672) + 2 * queries * 128 * 2 + 8 * queries
    assert paged.activations.total / GiB == pytest.approx(1.81, abs=0.01)
    assert paged.kv_cache == _report(block_size=16).kv_cache  # the cache is whole, chunks or not
    assert paged.peak.allocated < whole.peak.allocated
    smaller = _report(prefill_chunk=2048, block_size=16)
    assert smaller.activations.total < paged.activations.total


def test_contiguous_cache_chunks_pay_transformers_masked_path():
    """Without a paged cache (transformers' DynamicCache) a chunk's attention needs a mask, and with a
    mask transformers repeats the cached keys and values to all 64 query heads: 2 b P q d."""
    contiguous = _report(prefill_chunk=8192)
    paged = _report(prefill_chunk=8192, block_size=16)
    assert contiguous.prefill is not None and contiguous.prefill.moment == "attention"
    repeated = 2 * 8 * 32768 * 8192 * 2
    assert contiguous.activations.total > repeated > paged.activations.total


def test_last_token_logits_peak_for_short_prompts():
    """generate computes logits for each sequence's last token only, then copies them to fp32."""
    model = load_model("llama3-8b")
    work = InferenceWorkload(batch=64, prompt_tokens=1, generated_tokens=0)
    report = estimate_inference(model, work, Plan(precision="bf16"))
    assert report.prefill is not None and report.prefill.moment == "logits"
    assert report.activations.total == 64 * model.vocab_size * (2 + 4)


def test_vllm_default_budget():
    """vLLM V1 (vllm/engine/arg_utils.py, EngineArgs._set_default_args)."""
    assert vllm_default_chunk(80 * GiB, "h100-sxm") == 8192
    assert vllm_default_chunk(80 * GiB, "a100-80gb") == 2048
    assert vllm_default_chunk(24 * GiB, "rtx-4090") == 2048


# ---------------------------------------------------------------------------------------------
# the command


def _run(capsys, *args: object) -> tuple[int, str, str]:
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


SERVE = ("estimate", "llama3-8b", "--gpu", "h100-sxm", "--inference", "--batch", "4", "--context", "8192")


def test_json_carries_the_setting_and_the_forward(capsys):
    code, out, err = _run(capsys, *SERVE, "--prefill-chunk", "2048", "--block-size", "16", "--format", "json")
    assert code == 0 and err == ""
    d = json.loads(out)
    assert d["plan"]["prefill_chunk"] == 2048
    prefill = d["memory"]["prefill"]
    assert (prefill["tokens"], prefill["rows"], prefill["keys"], prefill["moment"]) == (2048, 4, 8192, "mlp")
    code, out, _ = _run(capsys, *SERVE, "--format", "json")
    d = json.loads(out)
    assert d["plan"]["prefill_chunk"] is None and d["memory"]["prefill"]["tokens"] == 4 * 8192


def test_table_names_prefill_activations(capsys):
    code, out, _ = _run(capsys, *SERVE)
    assert code == 0
    text = " ".join(out.split())
    assert "prefill: every prompt in one forward, 32,768 tokens" in text
    assert "8,192 tokens per step by default for its API server on this GPU: give --prefill-chunk" in text
    assert "prefill activations" in text and "activations per layer" not in text
    assert "grads" not in text and "optimizer" not in text
    code, out, _ = _run(capsys, *SERVE, "--prefill-chunk", "2048")
    text = " ".join(out.split())
    assert "prefill: chunks of 2,048 tokens across the batch (--prefill-chunk)" in text
    assert "over a contiguous KV cache (transformers' DynamicCache" in text
    code, out, _ = _run(capsys, *SERVE, "--prefill-chunk", "2048", "--block-size", "16")
    assert "over a paged KV cache (vLLM)" in " ".join(out.split())
    assert "one prefill forward over 2,048 tokens" in text


def test_plan_file_setting(capsys, tmp_path):
    plan = tmp_path / "serve.yaml"
    workload = {"kind": "inference", "batch": 4, "prompt_tokens": 8192, "generated_tokens": 0, "prefill_chunk": 4096}
    plan.write_text(yaml.safe_dump({"workload": workload}))
    code, out, err = _run(capsys, "estimate", "llama3-8b", "--gpu", "h100-sxm", "--plan", plan, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["memory"]["prefill"]["tokens"] == 4096


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (("--prefill-chunk", "0"), "command line: --prefill-chunk: "),
        (("--prefill-chunk", "-512"), "command line: --prefill-chunk: "),
        (("--prefill-chunk", "many"), "command line: --prefill-chunk: "),
    ],
)
def test_bad_chunk_is_one_line(capsys, args, where):
    code, out, err = _run(capsys, *SERVE, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"memplan: error: {where}"), err


def test_chunk_without_inference_is_one_line(capsys):
    code, out, err = _run(capsys, "estimate", "llama3-8b", "--prefill-chunk", "2048")
    assert code == 2 and out == ""
    assert err == "memplan: error: command line: --prefill-chunk: only applies with --inference\n"


def test_bad_chunk_in_a_plan_file_is_one_line(capsys, tmp_path):
    plan = tmp_path / "serve.yaml"
    plan.write_text(yaml.safe_dump({"workload": {"kind": "inference", "prefill_chunk": 0}}))
    code, _, err = _run(capsys, "estimate", "llama3-8b", "--plan", plan)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"memplan: error: {plan}: workload.prefill_chunk: ") and "greater than 0" in err, err
    plan.write_text(yaml.safe_dump({"workload": {"kind": "training", "prefill_chunk": 2048}}))
    code, _, err = _run(capsys, "estimate", "llama3-8b", "--plan", plan)
    assert code == 2 and err.count("\n") == 1 and "workload.prefill_chunk" in err, err


def test_advice_offers_chunked_prefill(capsys):
    """A serving estimate that does not fit because of the whole batch's prefill is told about
    chunked prefill, estimated in full (36 GiB of activations for 10 x 32k prompts on llama3-8b)."""
    code, out, _ = _run(capsys, *SERVE[:6], "10", "--context", "32768", "--format", "json")
    d = json.loads(out)
    assert code == 0 and not d["fits"]
    chunked = [s for s in d["suggestions"] if s["change"].startswith("chunked prefill, 8192 tokens")]
    assert chunked and chunked[0]["fits"] and chunked[0]["verified"]
    assert chunked[0]["saved_bytes"] > 30 * GiB
    code, out, _ = _run(capsys, *SERVE[:6], "10", "--context", "32768", "--prefill-chunk", "8192", "--format", "json")
    assert not [s for s in json.loads(out)["suggestions"] if s["change"].startswith("chunked prefill")]


def test_windowed_layers_keep_window_plus_chunk_after_a_chunked_prefill():
    """transformers' DynamicSlidingWindowLayer returns (and keeps the storage of) its last window - 1
    tokens with each chunk: gemma3-12b's 40 sliding layers (window 1024) hold 1023 + 2048 tokens per
    sequence after chunks of 8192 tokens over 4 sequences, its 8 full layers the whole prompt."""
    model = load_model("gemma3-12b")
    work = InferenceWorkload(batch=4, prompt_tokens=32768, generated_tokens=0, prefill_chunk=8192)
    report = estimate_inference(model, work, Plan(precision="bf16"))
    per_token = 2 * model.kv_heads * model.head_size * 2 * 4  # K and V, bf16, 4 sequences
    assert report.kv_cache == per_token * (8 * 32768 + 40 * (1023 + 2048))
    whole = estimate_inference(model, work.model_copy(update={"prefill_chunk": None}), Plan(precision="bf16"))
    assert whole.kv_cache == per_token * 48 * 32768
