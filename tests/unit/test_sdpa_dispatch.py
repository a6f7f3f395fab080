"""SDPA dispatch and saved-for-backward model (memplan.costmodel.attention) against PyTorch.

Rule tests check the table of cases read from PyTorch's dispatch source; measured tests run SDPA on
CPU with each CPU backend forced, collect every tensor autograd saves, and compare the bytes (deduped
by storage) with ``saved_bytes`` / ``kept_inputs``; dispatch tests check that CPU's unforced choice is
the one ``sdpa_backend("cpu", ...)`` names.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from memplan.costmodel import attention as A

# (device, dtype, head_dim, q_heads, kv_heads, enable_gqa, mask, dropout, capability, version, backend, why)
RULES = [
    # CPU: sdp_utils_cpp.cpp select_sdp_backend_cpp tries flash, then math.
    ("cpu", "fp32", 64, 32, 32, False, False, 0.0, None, (2, 13), "flash", "CPU flash takes fp32"),
    ("cpu", "bf16", 128, 32, 8, True, False, 0.0, None, (2, 13), "flash", "CPU flash: supports_gqa=true"),
    ("cpu", "fp16", 80, 8, 8, False, True, 0.0, None, (2, 13), "flash", "check_attn_mask_shape accepts a mask"),
    ("cpu", "bf16", 64, 8, 8, False, False, 0.1, None, (2, 13), "math", "check_for_dropout"),
    ("cpu", "bf16", 64, 32, 8, True, False, 0.0, None, (2, 6), "math", "2.6-era CPU flash: supports_gqa=false"),
    # CUDA, default order flash, efficient, math, cudnn (2.5.1 on; cuDNN first only when preferred).
    ("cuda", "bf16", 128, 32, 8, True, False, 0.0, (9, 0), (2, 8), "flash", "flash supports GQA"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.0, (8, 0), (2, 13), "flash", "A100: never cuDNN-first"),
    ("cuda", "fp32", 128, 32, 32, False, False, 0.0, (9, 0), (2, 8), "efficient", "flash: fp16/bf16 only"),
    ("cuda", "fp32", 128, 32, 8, True, False, 0.0, (9, 0), (2, 8), "math", "efficient: supports_gqa=false"),
    ("cuda", "bf16", 128, 32, 8, True, True, 0.0, (9, 0), (2, 8), "math", "flash: no mask; efficient: no GQA"),
    ("cuda", "bf16", 128, 32, 32, False, True, 0.0, (9, 0), (2, 8), "efficient", "check_for_attn_mask"),
    ("cuda", "bf16", 320, 32, 32, False, False, 0.0, (9, 0), (2, 13), "efficient", "flash <= 256, cuDNN <= 128"),
    ("cuda", "fp16", 128, 32, 32, False, False, 0.0, (7, 5), (2, 13), "efficient", "flash and cuDNN need sm80"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.0, (7, 5), (2, 13), "math", "efficient: no bf16 below sm80"),
    ("cuda", "fp32", 62, 8, 8, False, False, 0.0, (9, 0), (2, 8), "math", "efficient: head dim % 4 on sm80+"),
    ("cuda", "bf16", 200, 8, 8, False, False, 0.0, (8, 6), (2, 8), "efficient", "sm86 training: head dim 193-224"),
    ("cuda", "bf16", 128, 8, 8, False, False, 0.0, (10, 0), (2, 6), "math", "2.6: fused kernels end at sm90"),
    # check_prefer_cudnn_attention: 2.9 sm90/sm100; 2.10+ runtime cuDNN > 9.15.0 (bundled from 2.11).
    ("cuda", "bf16", 128, 32, 32, False, False, 0.0, (9, 0), (2, 9), "cudnn", "#162073: cuDNN first on sm90"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.0, (9, 0), (2, 10), "flash", "bundled cuDNN 9.10 <= 9.15"),
    ("cuda", "bf16", 128, 32, 8, True, False, 0.0, (9, 0), (2, 11), "cudnn", "cuDNN: GQA with enable_gqa"),
    ("cuda", "bf16", 128, 32, 8, True, False, 0.0, (10, 0), (2, 13), "cudnn", "sm100 preferred too"),
    ("cuda", "bf16", 256, 32, 8, True, False, 0.0, (9, 0), (2, 13), "flash", "cuDNN head dim <= 128"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.0, (12, 0), (2, 13), "flash", "sm120 not cuDNN-first"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.1, (9, 0), (2, 13), "flash", "cuDNN dropout: multiple of 1/16"),
    ("cuda", "bf16", 128, 32, 32, False, False, 0.125, (9, 0), (2, 13), "cudnn", "2/16 dropout accepted"),
]


@pytest.mark.parametrize("case", RULES, ids=[c[-1] for c in RULES])
def test_dispatch_rules(case):
    device, dtype, hd, hq, hkv, gqa, mask, p, cap, version, expected, _ = case
    got = A.sdpa_backend(
        device,
        dtype,
        hd,
        hq,
        hkv,
        enable_gqa=gqa,
        attn_mask=mask,
        dropout=p,
        capability=cap,
        torch_version=version,
    )
    assert got == expected


def test_dispatch_edges():
    # check_flash_causal_non_square_seqlens: causal flash needs q_len == kv_len; efficient takes it.
    kw = dict(enable_gqa=False, capability=(9, 0), torch_version=(2, 8))
    assert A.sdpa_backend("cuda", "bf16", 128, 8, 8, q_len=16, kv_len=64, **kw) == "efficient"
    assert A.sdpa_backend("cuda", "bf16", 128, 8, 8, causal=False, q_len=16, kv_len=64, **kw) == "flash"
    # explicit cudnn_version: 2.10 with a cuDNN newer than 9.15.0 prefers cuDNN; 9.15.0 itself does not.
    kw = dict(enable_gqa=False, capability=(9, 0), torch_version=(2, 10))
    assert A.sdpa_backend("cuda", "bf16", 128, 8, 8, cudnn_version=91501, **kw) == "cudnn"
    assert A.sdpa_backend("cuda", "bf16", 128, 8, 8, cudnn_version=91500, **kw) == "flash"
    # sm90a-like minor 3 parts count as preferred from 2.10; H20 (9.0) too; 8.9 never.
    assert A.cuda_priority((2, 13), (10, 3))[0] == "cudnn"
    assert A.cuda_priority((2, 13), (8, 9))[0] == "flash"
    with pytest.raises(ValueError):
        A.sdpa_backend("cuda", "bf16", 128, 32, 8, enable_gqa=False)  # cannot broadcast 8 onto 32 heads
    with pytest.raises(ValueError):
        A.sdpa_backend("cuda", "bf16", 128, 32, 6, enable_gqa=True)
    with pytest.raises(ValueError):
        A.sdpa_backend("cuda", "bf16", 128, 8, 8, enable_gqa=False, torch_version=(2, 5))
    # MQA without enable_gqa: the math matmul broadcasts one K/V head; fused kernels refuse.
    assert A.sdpa_backend("cuda", "bf16", 128, 8, 1, enable_gqa=False, torch_version=(2, 8)) == "math"


def test_saved_bytes_cuda_formulas():
    """CUDA-only kernels: read from the source (not measurable here)."""
    b, s, hq, hkv, hd = 2, 100, 8, 2, 64
    assert A.saved_bytes("flash", b, s, hq, hkv, hd, 2, enable_gqa=True, device="cuda") == {
        "lse": b * hq * s * 4,
        "rng_state": 16,
    }
    assert A.saved_bytes("efficient", b, s, hq, hq, hd, 2, enable_gqa=False, device="cuda")["lse"] == b * hq * 128 * 4
    assert A.saved_bytes("cudnn", b, s, hq, hkv, hd, 2, enable_gqa=True, device="cuda")["lse"] == b * hq * s * 4
    math = A.saved_bytes("math", b, s, hq, hkv, hd, 2, enable_gqa=True, device="cuda", dropout=True)
    assert math["dropout_mask"] == b * hq * s * s  # native_dropout: bool mask
    assert math["probs"] == math["probs_dropped"] == b * hq * s * s * 4  # fp32 under the upcast
    reduced = A.saved_bytes(
        "math", b, s, hq, hq, hd, 2, enable_gqa=False, device="cuda", allow_fp16_bf16_reduction=True
    )
    assert reduced == {"q_scaled": b * hq * s * hd * 2, "k_scaled": b * hq * s * hd * 2, "probs": b * hq * s * s * 2}


# ---- measured on CPU -------------------------------------------------------------------------

torch = pytest.importorskip("torch")
F = torch.nn.functional
SDPBackend = torch.nn.attention.SDPBackend
sdpa_kernel = torch.nn.attention.sdpa_kernel

FORCE = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _run(backend, dtype, *, gqa, b=2, s=64, hq=4, hkv=2, hd=32, dropout=0.0, causal=True):
    """Run SDPA (forced to ``backend`` unless None) and return (out, q, k, v, saved tensors)."""
    torch.manual_seed(0)
    kv = hkv if gqa else hq
    q = torch.randn(b, hq, s, hd, dtype=DTYPES[dtype], requires_grad=True)
    k = torch.randn(b, kv, s, hd, dtype=DTYPES[dtype], requires_grad=True)
    v = torch.randn(b, kv, s, hd, dtype=DTYPES[dtype], requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, enable_gqa=gqa)
        else:
            with sdpa_kernel(FORCE[backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, enable_gqa=gqa)
    return out, q, k, v, saved


def _measure(out, q, k, v, saved):
    """(bytes of saved storages other than q, k, v, out; which of q, k, v, out are saved)."""
    named = {t.untyped_storage().data_ptr(): name for name, t in (("q", q), ("k", k), ("v", v), ("out", out))}
    seen = {}
    for t in saved:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    kept = frozenset(named[p] for p in seen if p in named)
    extra = sum(n for p, n in seen.items() if p not in named)
    return extra, kept


CASES = [
    (backend, dtype, gqa, hd)
    for backend in ("math", "flash")
    for dtype in ("fp32", "bf16")
    for gqa in (False, True)
    for hd in (16, 64)
]


@pytest.mark.parametrize("backend,dtype,gqa,hd", CASES)
def test_saved_bytes_measured_cpu(backend, dtype, gqa, hd):
    b, s, hq, hkv = 2, 96, 4, 2
    kv = hkv if gqa else hq
    d = DTYPES[dtype].itemsize
    out, q, k, v, saved = _run(backend, dtype, gqa=gqa, b=b, s=s, hq=hq, hkv=hkv, hd=hd)
    extra, kept = _measure(out, q, k, v, saved)
    model = A.saved_bytes(backend, b, s, hq, kv, hd, d, enable_gqa=gqa, device="cpu")
    assert extra == sum(model.values()), model
    assert kept == A.kept_inputs(backend, hq, kv, d, enable_gqa=gqa)
    total = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in saved}.values())
    assert total == A.total_saved_bytes(backend, b, s, hq, kv, hd, d, enable_gqa=gqa, device="cpu")


@pytest.mark.parametrize("dtype,gqa", [("fp32", False), ("bf16", True)])
def test_saved_bytes_measured_cpu_math_dropout(dtype, gqa):
    b, s, hq, hkv, hd = 2, 64, 4, 2, 32
    kv = hkv if gqa else hq
    d = DTYPES[dtype].itemsize
    extra, kept = _measure(*_run("math", dtype, gqa=gqa, b=b, s=s, hq=hq, hkv=hkv, hd=hd, dropout=0.25))
    model = A.saved_bytes("math", b, s, hq, kv, hd, d, enable_gqa=gqa, device="cpu", dropout=True)
    assert extra == sum(model.values()), model
    assert kept == A.kept_inputs("math", hq, kv, d, enable_gqa=gqa)


def _signature(result):
    """grad_fn name and the saved tensors' (shape, dtype) multiset: which kernel built the graph."""
    out, *_, saved = result
    return out.grad_fn.name(), sorted((tuple(t.shape), str(t.dtype)) for t in saved)


DEFAULT_CASES = [
    ("fp32", False, 0.0, True),
    ("bf16", True, 0.0, True),
    ("fp16", True, 0.0, False),
    ("fp32", True, 0.2, True),
    ("bf16", False, 0.2, False),
]


@pytest.mark.parametrize("dtype,gqa,dropout,causal", DEFAULT_CASES)
def test_cpu_default_dispatch_matches_model(dtype, gqa, dropout, causal):
    expected = A.sdpa_backend(
        "cpu", dtype, 32, 4, 2 if gqa else 4, enable_gqa=gqa, dropout=dropout, causal=causal, torch_version=(2, 13)
    )
    kw = dict(gqa=gqa, dropout=dropout, causal=causal, s=48, hd=32)
    default = _signature(_run(None, dtype, **kw))
    forced = {name: _signature(_run(name, dtype, **kw)) for name in FORCE if name == "math" or dropout == 0.0}
    matching = {name for name, sig in forced.items() if sig == default}
    assert matching == {expected}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cpu_flash_refuses_dropout_when_forced():
    with pytest.raises(RuntimeError):
        _run("flash", "fp32", gqa=False, dropout=0.1)


def test_module_does_not_import_torch():
    code = "import memplan.costmodel.attention, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unequal_value_heads_rule_out_flash_and_cudnn():
    """MLA (q/k heads 192 wide, v 128): CPU's flash and CUDA's flash need one head dim for q, k and v
    (check_head_dim_size_cpp / check_head_dim_size_flash); the memory-efficient kernel takes both aligned."""
    from memplan.costmodel.attention import sdpa_backend

    assert sdpa_backend("cpu", "bf16", 192, 128, 128, enable_gqa=True, v_head_dim=128) == "math"
    assert sdpa_backend("cpu", "bf16", 128, 128, 128, enable_gqa=True, v_head_dim=128) == "flash"
    assert sdpa_backend("cuda", "bf16", 192, 128, 128, enable_gqa=True, v_head_dim=128) == "efficient"
    assert sdpa_backend("cuda", "bf16", 192, 128, 128, enable_gqa=True, v_head_dim=130) == "math"
